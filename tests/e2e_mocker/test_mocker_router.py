"""``graphs.mocker_router`` served as users run it: 2 processes x 5 engines behind the Router.

Every engine is its own instance (lease, instance id, request-plane server); the Router
follows each one's ``kv_events`` and ``load_metrics`` and sends a repeated prefix to the
engine that holds it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynagraph.runtime.infra import LocalService
from tests.support.serve import ServeProcess, graph_env, served

from .conftest import complete, per_worker, token_ids, wait_records

pytestmark = pytest.mark.integration

WORKERS, ENGINES = 2, 5
BLOCK = 32
rng = random.Random(14)


def tokens(n: int) -> list[int]:
    return token_ids(rng, n)


@pytest.fixture(scope="module")
def graph(mocker_infra: tuple[LocalService, LocalService], model_dir: Path
          ) -> Iterator[ServeProcess]:
    etcd, nats = mocker_infra
    # overlap-weight 2: right after a request ends, its engine's last load sample (10 per
    # second) may still count the request's blocks, and with weight 1 that ties the cost
    # of a hit with a miss elsewhere (benchmarks/results/routing.md saw the same on vLLM).
    with served(["graphs.mocker_router:Frontend", "-f", "configs/mocker_router.yaml",
                 "--Frontend.port=0", f"--Common.model={model_dir}",
                 f"--MockerWorker.ServiceArgs.workers={WORKERS}",
                 f"--MockerWorker.engines-per-process={ENGINES}",
                 "--Router.overlap-weight=2"],
                graph_env(etcd.url, nats.url), ready_timeout=120) as sp:
        yield sp


def test_each_engine_is_an_instance_of_its_own(
        graph: ServeProcess, mocker_infra: tuple[LocalService, LocalService]) -> None:
    recs = wait_records(mocker_infra[0].url, "MockerWorker", WORKERS * ENGINES)
    assert len({r["pid"] for r in recs.values()}) == WORKERS
    assert sorted(r["worker_index"] for r in recs.values()) == list(range(WORKERS * ENGINES))
    assert len({r["address"] for r in recs.values()}) == WORKERS * ENGINES
    assert {(r["block_size"], r["kv_events"], r["engine"]) for r in recs.values()} == {
        (BLOCK, True, "mocker")}
    assert f"MockerWorker: {WORKERS * ENGINES} instances in {WORKERS} processes" in (
        graph.output())


def test_a_repeated_prefix_goes_to_the_engine_holding_it(
        graph: ServeProcess, mocker_infra: tuple[LocalService, LocalService]) -> None:
    recs = wait_records(mocker_infra[0].url, "MockerWorker", WORKERS * ENGINES)
    metrics = sorted({r["metrics"] for r in recs.values()})
    queries = "dynamo_worker_prefix_cache_queries_total"
    holders = set()
    for _ in range(5):
        prefix = tokens(8 * BLOCK)
        before = per_worker(metrics, queries)
        first = complete(graph.url(), prefix + tokens(20))
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        after = per_worker(metrics, queries)
        rose = [w for w in after if after[w] > before.get(w, 0.0)]
        assert len(rose) == 1, rose
        holder = rose[0]
        holders.add(holder)
        for _ in range(3):
            before = after
            again = complete(graph.url(), prefix + tokens(20))
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 8 * BLOCK
            after = per_worker(metrics, queries)
            assert [w for w in after if after[w] > before.get(w, 0.0)] == [holder]
    assert len(holders) > 1  # new prefixes spread over the engines (the cost's load term)
