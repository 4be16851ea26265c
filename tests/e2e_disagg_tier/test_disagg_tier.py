"""``kv-transport: tier``: a remote prefill's KV reaches the decode worker through the KV
tier both share on /dev/shm, not NIXL, and the greedy output equals the agg graph's."""

from __future__ import annotations

import time

import pytest

from tests.e2e_disagg.conftest import PROMPTS, THRESHOLD, DisaggGraph, complete, text_of
from tests.support.greedy import Greedy, assert_agrees
from tests.support.metrics import scrape, total

pytestmark = [pytest.mark.nixl, pytest.mark.vllm]

BLOCK = 32
REMOTE = 'dynamo_worker_prefill_requests_total{reason="long-prompt",where="remote"}'
NIXL_BYTES = "vllm:nixl_bytes_transferred_sum{}"


def tier_hits(g: DisaggGraph) -> float:
    return total(scrape(g.worker_metrics), "dynamo_worker_kv_tier_hit_tokens_total")


def test_greedy_output_equals_agg_and_the_kv_comes_through_the_shared_tier(
        tier_graph: DisaggGraph, agg_reference: dict[str, Greedy]) -> None:
    remote = 0
    for p in PROMPTS:
        before, hits = tier_graph.metrics(), tier_hits(tier_graph)
        body = complete(tier_graph.url, p.text)
        usage = body["usage"]
        assert isinstance(usage, dict)
        n = int(usage["prompt_tokens"])
        assert_agrees(agg_reference[p.text], text_of(body), f"{p.words} words / {n} tokens")
        if n <= THRESHOLD:
            continue
        remote += 1
        deadline = time.monotonic() + 5  # the step's stats reach the metrics just after it
        while tier_hits(tier_graph) - hits < (n // BLOCK - 1) * BLOCK:
            assert time.monotonic() < deadline, (n, tier_hits(tier_graph) - hits)
            time.sleep(0.05)
        after = tier_graph.metrics()
        assert after.get(REMOTE, 0) - before.get(REMOTE, 0) == 1, (n, before, after)
        assert after.get(NIXL_BYTES, 0) == before.get(NIXL_BYTES, 0), (n, before, after)
    assert remote >= 10
