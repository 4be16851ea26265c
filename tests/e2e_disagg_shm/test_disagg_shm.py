"""``kv-transport: shm``: a remote prefill's KV reaches the decode engine as copies from
the prefill engine's shared KV cache, and the greedy output equals the agg graph's."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from dynagraph.llm.kv.shm_direct import MANIFEST_DIR, MANIFEST_PREFIX
from tests.e2e_disagg.conftest import DisaggGraph, check_remote_prompts
from tests.support.greedy import Greedy
from tests.support.kvmem import kv_memfd_inodes
from tests.support.metrics import scrape, total

pytestmark = [pytest.mark.nixl, pytest.mark.vllm]

BLOCK = 32
BLOCK_BYTES = 64 * 1024  # the tiny model: 4 layers x K,V x 2 heads x 64 x bf16 x 32 tokens
REMOTE = 'dynamo_worker_prefill_requests_total{reason="long-prompt",where="remote"}'


def transferred(g: DisaggGraph) -> tuple[float, float]:
    text = scrape(g.worker_metrics)
    return (total(text, "dynamo_worker_kv_transfers_total"),
            total(text, "dynamo_worker_kv_transfer_bytes_total"))


def test_greedy_output_equals_agg_and_the_kv_is_copied_from_the_prefill_engine(
        shm_graph: DisaggGraph, agg_reference: dict[str, Greedy]) -> None:
    def arrived(n: int, before: tuple[dict[str, float], tuple[float, float]]) -> None:
        metrics, (count, nbytes) = before
        deadline = time.monotonic() + 5  # the step's stats reach the metrics just after it
        while transferred(shm_graph)[0] == count:
            assert time.monotonic() < deadline, n
            time.sleep(0.05)
        moved = transferred(shm_graph)[1] - nbytes
        assert moved >= (n // BLOCK - 1) * BLOCK_BYTES, (n, moved)
        after = shm_graph.metrics()
        assert after.get(REMOTE, 0) - metrics.get(REMOTE, 0) == 1, (n, metrics, after)

    remote = check_remote_prompts(shm_graph, agg_reference,
                                  lambda: (shm_graph.metrics(), transferred(shm_graph)), arrived)
    assert remote >= 10
    # the copies' evidence: both engines published their caches, and one process (the
    # decode engine) maps two of them, its own and the prefill engine's
    assert len(list(Path(MANIFEST_DIR).glob(f"{MANIFEST_PREFIX}*.json"))) >= 2
    maps = kv_memfd_inodes(shm_graph.proc.pid)
    assert len(maps) >= 2 and max(len(v) for v in maps.values()) == 2, maps
