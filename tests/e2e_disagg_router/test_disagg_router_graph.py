"""The full graph users run: `dynamo serve graphs.disagg_router:Frontend -f configs/disagg_router.yaml`.

Frontend -> Processor -> KV Router -> two VllmWorkers (remote prefill on) -> one
PrefillWorker, three NIXL engines, the config file as shipped (ports 0, the test model).
Its own etcd and NATS, in its own package so no other engine-bearing graph runs at the
same time. Long prompts are prefilled remotely and their KV arrives (copied from the
prefill engine's shared memory: the config's ``kv-transport: auto``; NIXL's protocol); a repeated
prompt gives the same greedy text; the Router decides every request; no prefill's KV
outlives its lease unread; the graph stops cleanly.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.greedy import TOP_LOGPROBS, Greedy, assert_agrees
from tests.support.infra import own_infra
from tests.support.metrics import scrape, total
from tests.support.serve import ServeProcess, graph_env, served

pytestmark = [pytest.mark.nixl, pytest.mark.vllm, pytest.mark.integration]

SENTENCE = "Routing and disaggregation meet in one graph here. "
LONG = [f"Story {i}: " + SENTENCE * 40 for i in range(3)]  # ~800 tokens > 512: remote
SHORT = ["Say hello.", "Count to three."]


def _metric_sum(address: str, name: str, labels: str = "") -> float:
    return total(scrape(address), name, labels)


@pytest.fixture(scope="module")
def graph(model_dir: Path) -> Iterator[ServeProcess]:
    with own_infra() as (etcd, nats), served(
            ["graphs.disagg_router:Frontend", "-f", "configs/disagg_router.yaml",
             "--Frontend.port=0", f"--Common.model={model_dir}"],
            graph_env(etcd.url, nats.url), ready_timeout=300) as sp:
        yield sp


def _choice(url: str, prompt: str, **extra: object) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": "tiny-llama", "prompt": prompt, "max_tokens": 12, "temperature": 0,
        "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    choice: dict[str, Any] = r.json()["choices"][0]
    return choice


def _complete(url: str, prompt: str) -> str:
    return str(_choice(url, prompt)["text"])


def test_long_prompts_prefill_remotely_and_the_router_decides(graph: ServeProcess) -> None:
    url = graph.url()
    workers = graph.metrics_addresses("VllmWorker")
    routers = graph.metrics_addresses("Router")
    assert len(workers) == 2 and len(routers) == 1, (workers, routers)
    first = {p: Greedy.of(_choice(url, p, logprobs=TOP_LOGPROBS)) for p in LONG}
    for p in SHORT:
        assert _complete(url, p)
    for p in LONG:  # cached now: the same greedy text (up to a near tie)
        assert_agrees(first[p], _complete(url, p), p[:30])
    remote = sum(_metric_sum(w, "dynamo_worker_prefill_requests_total", 'where="remote"')
                 for w in workers)
    assert remote >= len(LONG)
    transfers = sum(_metric_sum(w, "dynamo_worker_kv_transfers_total") for w in workers)
    assert transfers >= len(LONG)
    decisions = _metric_sum(routers[0], "dynamo_router_decisions_total")
    assert decisions >= 2 * len(LONG) + len(SHORT)


def test_no_prefill_kv_outlived_its_lease(graph: ServeProcess) -> None:
    expired = [line for line in graph.lines
               if "Releasing expired KV blocks" in line or "Potentially invalid KV blocks" in line]
    assert expired == []
