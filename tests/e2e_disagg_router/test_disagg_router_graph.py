"""The full graph users run: `dynamo serve graphs.disagg_router:Frontend -f configs/disagg_router.yaml`.

Frontend -> Processor -> KV Router -> two VllmWorkers (remote prefill on) -> one
PrefillWorker, three NIXL engines, the config file as shipped (ports 0, the test model).
Its own etcd and NATS, in its own package so no other engine-bearing graph runs at the
same time. Long prompts are prefilled remotely and their KV arrives (copied from the
prefill engine's shared memory: the config's ``kv-transport: auto``; NIXL's protocol); their
greedy text, remote and again from the cache, is that of a plain vLLM ``AsyncLLM`` run on the
prompt before the graph starts (no KV transfer); the Router decides every request; no prefill's KV
outlives its lease unread; the graph stops cleanly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.greedy import TOP_LOGPROBS, Greedy, assert_agrees
from tests.support.infra import own_infra
from tests.support.metrics import scrape, total
from tests.support.serve import REPO, ServeProcess, graph_env, served

pytestmark = [pytest.mark.nixl, pytest.mark.vllm, pytest.mark.integration]

SENTENCE = "Routing and disaggregation meet in one graph here. "
LONG = [f"Story {i}: " + SENTENCE * 40 for i in range(3)]  # ~800 tokens > 512: remote
SHORT = ["Say hello.", "Count to three."]


def _metric_sum(address: str, name: str, labels: str = "") -> float:
    return total(scrape(address), name, labels)


MAX_TOKENS = 12
MAX_MODEL_LEN = 4096  # configs/disagg_router.yaml's


@pytest.fixture(scope="module")
def long_ids(model_dir: Path) -> list[list[int]]:
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return [tokenizer(p)["input_ids"] for p in LONG]


@pytest.fixture(scope="module")
def direct(model_dir: Path, long_ids: list[list[int]]) -> list[str]:
    """The greedy text of each LONG prompt from a plain vLLM ``AsyncLLM`` (its own process,
    stopped before the graph starts): the reference that involves no KV transfer."""
    from transformers import AutoTokenizer
    out = subprocess.run(
        [sys.executable, "-m", "tests.e2e.direct_greedy", str(model_dir), str(MAX_MODEL_LEN),
         str(MAX_TOKENS)],
        input=json.dumps(long_ids), capture_output=True, text=True, cwd=REPO, timeout=600,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert out.returncode == 0, out.stderr[-3000:]
    ids = json.loads(out.stdout.strip().splitlines()[-1])
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return [tokenizer.decode(i, skip_special_tokens=True) for i in ids]


@pytest.fixture(scope="module")
def graph(model_dir: Path, direct: list[str]) -> Iterator[ServeProcess]:
    with own_infra() as (etcd, nats), served(
            ["graphs.disagg_router:Frontend", "-f", "configs/disagg_router.yaml",
             "--Frontend.port=0", f"--Common.model={model_dir}"],
            graph_env(etcd.url, nats.url), ready_timeout=300) as sp:
        yield sp


def _choice(url: str, prompt: str | list[int], **extra: object) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": "tiny-llama", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    choice: dict[str, Any] = r.json()["choices"][0]
    return choice


def _complete(url: str, prompt: str | list[int]) -> str:
    return str(_choice(url, prompt)["text"])


def test_long_prompts_prefill_remotely_and_the_router_decides(
        graph: ServeProcess, long_ids: list[list[int]], direct: list[str]) -> None:
    url = graph.url()
    workers = graph.metrics_addresses("VllmWorker")
    routers = graph.metrics_addresses("Router")
    assert len(workers) == 2 and len(routers) == 1, (workers, routers)
    # token ids, so the graph and the direct engine see the same prompt
    first = [Greedy.of(_choice(url, ids, logprobs=TOP_LOGPROBS)) for ids in long_ids]
    for p, remote, reference in zip(LONG, first, direct, strict=True):
        # the remote prefill's text is the plain engine's (up to a near tie)
        assert_agrees(remote, reference, f"remote vs direct, {p[:30]}")
    for p in SHORT:
        assert _complete(url, p)
    for p, ids, remote in zip(LONG, long_ids, first, strict=True):
        cached = _complete(url, ids)  # served from the transferred KV, now cached
        assert_agrees(remote, cached, f"cached vs remote, {p[:30]}")  # remote ~ direct above
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
