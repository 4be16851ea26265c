"""SLO-aware admission as served: `dynamo serve graphs.agg_router` with an interactive and a
batch tenant. While interactive streams keep both workers busy, a batch request is delayed
(it finishes only after the pressure is gone) or, past max-delay, shed with 429 +
Retry-After and an OpenAI error naming the reason; interactive requests are served."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.infra import own_infra
from tests.support.metrics import scrape, total
from tests.support.serve import ServeProcess, graph_env, served

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

MODEL = "tiny-llama"
KEY_I, KEY_B = "sk-live-4c1d7e9a0b23", "sk-nightly-7a2f5c8e1d90"
MAX_DELAY = 2.5
ADMISSION = ("{enabled: true, defer-classes: [batch], delay-at-requests: 1, "
             f"shed-at-requests: 1000, delay-step: 0.1, max-delay: {MAX_DELAY}}}")


@pytest.fixture(scope="module")
def graph(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    tenants = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    tenants.write_text(f"{KEY_I}: {{tenant: live-co, slo-class: interactive}}\n"
                       f"{KEY_B}: {{tenant: nightly, slo-class: batch}}\n")
    with own_infra() as (etcd, nats), served(
            ["graphs.agg_router:Frontend", "-f", "configs/agg_router.yaml", "--Frontend.port=0",
             f"--Common.model={model_dir}", "--Common.max-model-len=4096",
             f"--Frontend.tenants-file={tenants}", f"--Processor.slo-admission={ADMISSION}"],
            graph_env(etcd.url, nats.url, in_process_engines=True), ready_timeout=300) as sp:
        yield sp


def post(graph: ServeProcess, key: str, prompt: str, max_tokens: int = 2) -> httpx.Response:
    return httpx.post(f"{graph.url()}/v1/completions", timeout=120,
                      headers={"authorization": f"Bearer {key}"},
                      json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                            "temperature": 0})


def hold_pressure(stack: ExitStack, graph: ServeProcess, n: int = 8,
                  most: int = 16) -> list[Iterator[bytes]]:
    """Open ``n`` long interactive streams (each on its own prompt, so the Router spreads
    them by load) and wait for their first bytes: both workers are busy for seconds (the
    tiny model decodes thousands of tokens a second) or until the stack closes them (a
    client disconnect cancels the request down to the engine). The Router places by
    learned speed, so nothing makes it use both workers: in one full-suite run on a
    loaded box a batch request was admitted under this pressure, which takes a worker
    with no request. So more are opened, up to ``most``, until every worker runs one."""
    client = stack.enter_context(httpx.Client(timeout=120))
    readers: list[Iterator[bytes]] = []  # held: a reader dropped early closes its stream
    workers = graph.metrics_addresses("VllmWorker")
    assert len(workers) == 2, graph.output()[-2000:]

    def open_one(i: int) -> None:
        prompt = f"Stream {i}: " + " ".join(f"w{i}x{j}" for j in range(30))
        resp = stack.enter_context(client.stream(
            "POST", f"{graph.url()}/v1/completions",
            headers={"authorization": f"Bearer {KEY_I}"},
            json={"model": MODEL, "prompt": prompt, "max_tokens": 3500, "ignore_eos": True,
                  "stream": True, "temperature": 0}))
        assert resp.status_code == 200, resp.read()
        readers.append(resp.iter_bytes())
        next(readers[-1])

    def idle() -> list[str]:
        """The workers that report no running request (their reports lag a step)."""
        deadline = time.monotonic() + 1.0
        while True:
            out = [w for w in workers
                   if total(scrape(w), "dynamo_worker_requests_running") < 1]
            if not out or time.monotonic() > deadline:
                return out
            time.sleep(0.05)

    for i in range(n):
        open_one(i)
    while (left := idle()) and len(readers) < most:
        open_one(len(readers))
    assert not left, f"{left} idle with {len(readers)} streams open"
    return readers


def test_batch_is_served_without_pressure(graph: ServeProcess) -> None:
    r = post(graph, KEY_B, "A quiet moment for a batch job.")
    assert r.status_code == 200, r.text


def test_under_pressure_batch_is_shed_after_max_delay_and_interactive_served(
        graph: ServeProcess) -> None:
    with ExitStack() as stack:
        readers = hold_pressure(stack, graph)
        t0 = time.monotonic()
        shed = post(graph, KEY_B, "A batch job that arrives at a busy time.")
        waited = time.monotonic() - t0
        live = post(graph, KEY_I, "An interactive question at a busy time.")
        assert len(readers) >= 8
    assert shed.status_code == 429, shed.text
    assert int(shed.headers["retry-after"]) >= 1
    error = shed.json()["error"]
    assert error["type"] == "rate_limit_exceeded" and error["code"] == "slo_shed", error
    assert "batch work shed after waiting" in error["message"], error
    assert "requests on the least loaded worker" in error["message"], error
    assert waited >= MAX_DELAY - 0.5, waited
    assert live.status_code == 200, live.text


def test_a_delayed_batch_request_is_served_once_the_pressure_is_gone(
        graph: ServeProcess) -> None:
    result: dict[str, Any] = {}

    def send() -> None:
        result["response"] = post(graph, KEY_B, "A batch job that can wait a little.")
        result["done"] = time.monotonic()

    with ExitStack() as stack:
        readers = hold_pressure(stack, graph)
        sender = threading.Thread(target=send)
        sender.start()
        time.sleep(1.5)
        assert "done" not in result  # held back while the interactive streams run
        assert len(readers) >= 8
    released = time.monotonic()
    sender.join(timeout=60)
    assert not sender.is_alive()
    assert result["response"].status_code == 200, result["response"].text
    assert result["done"] >= released
