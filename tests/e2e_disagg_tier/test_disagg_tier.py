"""``kv-transport: tier``: a remote prefill's KV reaches the decode worker through the KV
tier both share on /dev/shm, not NIXL, and the greedy output equals the agg graph's."""

from __future__ import annotations

import time

import pytest

from tests.e2e_disagg.conftest import BLOCK, REMOTE, DisaggGraph, check_remote_prompts
from tests.support.greedy import Greedy
from tests.support.metrics import scrape, total

pytestmark = [pytest.mark.nixl, pytest.mark.vllm]

NIXL_BYTES = "vllm:nixl_bytes_transferred_sum{}"


def tier_hits(g: DisaggGraph) -> float:
    return total(scrape(g.worker_metrics), "dynamo_worker_kv_tier_hit_tokens_total")


def test_greedy_output_equals_agg_and_the_kv_comes_through_the_shared_tier(
        tier_graph: DisaggGraph, agg_reference: dict[str, Greedy]) -> None:
    def came_through_the_tier(n: int, before: tuple[dict[str, float], float]) -> None:
        metrics, hits = before
        deadline = time.monotonic() + 5  # the step's stats reach the metrics just after it
        while tier_hits(tier_graph) - hits < (n // BLOCK - 1) * BLOCK:
            assert time.monotonic() < deadline, (n, tier_hits(tier_graph) - hits)
            time.sleep(0.05)
        after = tier_graph.metrics()
        assert after.get(REMOTE, 0) - metrics.get(REMOTE, 0) == 1, (n, metrics, after)
        assert after.get(NIXL_BYTES, 0) == metrics.get(NIXL_BYTES, 0), (n, metrics, after)

    remote = check_remote_prompts(tier_graph, agg_reference,
                                  lambda: (tier_graph.metrics(), tier_hits(tier_graph)),
                                  came_through_the_tier)
    assert remote >= 10
