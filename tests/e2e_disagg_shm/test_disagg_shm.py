"""``kv-transport: shm``: a remote prefill's KV reaches the decode engine as copies from
the prefill engine's shared KV cache, and the greedy output equals the agg graph's."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dynagraph.cli.core_keeper import split_processes
from dynagraph.llm.kv.transfer.shm_memory import MANIFEST_DIR, MANIFEST_PREFIX
from tests.e2e_disagg.conftest import (
    BLOCK,
    BLOCK_BYTES,
    DisaggGraph,
    check_remote_prompts,
    check_transfer,
    transferred,
)
from tests.support.cores import assert_cores_kept
from tests.support.greedy import Greedy
from tests.support.kvmem import kv_memfd_inodes

pytestmark = [pytest.mark.nixl, pytest.mark.vllm]


def test_greedy_output_equals_agg_and_the_kv_is_copied_from_the_prefill_engine(
        shm_graph: DisaggGraph, agg_reference: dict[str, Greedy]) -> None:
    def arrived(n: int, before: tuple[dict[str, float], tuple[float, float]]) -> None:
        check_transfer(shm_graph, n, before, low=(n // BLOCK - 1) * BLOCK_BYTES)

    remote = check_remote_prompts(shm_graph, agg_reference,
                                  lambda: (shm_graph.metrics(), transferred(shm_graph)), arrived)
    assert remote >= 10
    # the copies' evidence: both engines published their caches, and one process (the
    # decode engine) maps two of them, its own and the prefill engine's
    assert len(list(Path(MANIFEST_DIR).glob(f"{MANIFEST_PREFIX}*.json"))) >= 2
    maps = kv_memfd_inodes(shm_graph.proc.pid)
    assert len(maps) >= 2 and max(len(v) for v in maps.values()) == 2, maps


def test_both_engines_run_on_the_core_vllms_nixl_worker_binds_and_the_graph_keeps_off_it(
        shm_graph: DisaggGraph) -> None:
    """vLLM's NIXL worker binds the engine core's main thread (which runs our in-process
    engines' forward passes) to the last core; that is kept on purpose
    (``dynagraph.llm.kv.transfer.nixl_connector``), and ``dynamo serve``'s keeper then keeps the graph
    on the other cores with the engines at niceness 0."""
    serve_pid = shm_graph.proc.pid
    engines, _ = split_processes(serve_pid)
    assert len(engines) == 2, engines
    allowed = frozenset(os.sched_getaffinity(serve_pid))
    bound = set(engines.values())
    assert len(bound) == 1, engines  # one binding for both: the last core of each node
    if len(allowed) > 1:
        (cores,) = bound
        assert max(allowed) in cores and cores < allowed, engines
    assert_cores_kept(serve_pid, shm_graph.proc.output())
