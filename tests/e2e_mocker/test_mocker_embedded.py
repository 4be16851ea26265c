"""``ServiceArgs.embed-in`` served as users run it: the Processor inside the Frontend's
process (``graphs.mocker_agg``), called there without the request plane's socket."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dynagraph.runtime.infra import LocalService
from tests.support.serve import ServeProcess, graph_env, served

from .conftest import MODEL, complete, wait_records

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def graph(mocker_infra: tuple[LocalService, LocalService], model_dir: Path
          ) -> Iterator[ServeProcess]:
    etcd, nats = mocker_infra
    with served(["graphs.mocker_agg:Frontend", "-f", "configs/mocker_agg.yaml",
                 "--Frontend.port=0", f"--Common.model={model_dir}",
                 "--Processor.ServiceArgs.embed-in=Frontend"],
                graph_env(etcd.url, nats.url), ready_timeout=120) as sp:
        yield sp


def test_the_processor_runs_in_the_frontends_process(
        graph: ServeProcess, mocker_infra: tuple[LocalService, LocalService]) -> None:
    (front,) = wait_records(mocker_infra[0].url, "Frontend", 1).values()
    (proc,) = wait_records(mocker_infra[0].url, "Processor", 1).values()
    (worker,) = wait_records(mocker_infra[0].url, "MockerWorker", 1).values()
    assert proc["pid"] == front["pid"] != worker["pid"]
    assert "2 processes (Frontend with Processor inside, MockerWorker)" in graph.output()


def test_requests_stream_whole_through_the_embedded_processor(graph: ServeProcess) -> None:
    got = complete(graph.url(), list(range(10, 60)), max_tokens=12)
    assert got["usage"]["completion_tokens"] == 12
    tokens = 0
    with httpx.stream("POST", f"{graph.url()}/v1/chat/completions", timeout=60, json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 9, "stream": True,
            "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                tokens = usage["completion_tokens"] if usage else tokens
    assert tokens == 9


def test_the_processors_errors_keep_their_status(graph: ServeProcess) -> None:
    r = httpx.post(f"{graph.url()}/v1/completions", timeout=30,
                   json={"model": "nope", "prompt": "hi", "max_tokens": 2})
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(f"{graph.url()}/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": [10, 999999], "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt"
