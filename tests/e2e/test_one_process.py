"""The agg graph in one process (``--VllmWorker.ServiceArgs.embed-in=Frontend``) served as
users run it: Frontend, Processor and VllmWorker in the Frontend's process, the engine
core in its own, as vLLM's own server lays itself out. Its answers equal the agg graph's
with the VllmWorker in a process of its own."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.cores import assert_cores_kept
from tests.support.serve import ServeProcess, graph_env, served

from .conftest import MAX_MODEL_LEN

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def one_process(model_dir: Path, etcd_url: str, nats_url: str) -> Iterator[ServeProcess]:
    with served(["graphs.agg:Frontend", "-f", "configs/agg.yaml", "--Frontend.port=0",
                 f"--Common.model={model_dir}", f"--Common.max-model-len={MAX_MODEL_LEN}",
                 "--VllmWorker.ServiceArgs.embed-in=Frontend"],
                {**graph_env(etcd_url, nats_url), "VLLM_LOGGING_LEVEL": "INFO"},
                ready_timeout=300) as sp:
        yield sp


def test_the_whole_graph_runs_in_one_process(one_process: ServeProcess) -> None:
    out = one_process.output()
    assert "1 process (Frontend with Processor, VllmWorker inside)" in out
    pids = dict(re.findall(r"^\s+(\w+)\[0\] pid=(\d+)", out, re.MULTILINE))
    assert pids["Frontend"] == pids["Processor"] == pids["VllmWorker"], pids


def test_the_engine_core_sleeps_while_its_model_runner_works(one_process: ServeProcess) -> None:
    # engine-core-spin-s 0 (the default) reached the engine core's process through the
    # VllmWorker's environment and vLLM's plugin hook (dynagraph.llm.engines.vllm.engine_spin).
    assert "engine core: shared-memory readers busy-wait 0.000 s" in one_process.output()


def test_the_graph_keeps_off_the_model_runner_s_cores(one_process: ServeProcess) -> None:
    # dynamo serve's core keeper (--engine-cores keep-off, the default) bound the graph's
    # processes before it said ready; vLLM's own processes keep vLLM's placement.
    assert_cores_kept(one_process.proc.pid, one_process.output())


def complete(url: str, prompt: str) -> str:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": "tiny-llama", "prompt": prompt, "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200, r.text
    text: str = r.json()["choices"][0]["text"]
    return text


def test_greedy_answers_equal_the_graph_with_a_worker_process(
        one_process: ServeProcess, base_url: str) -> None:
    for prompt in PROMPTS:
        assert complete(one_process.url(), prompt) == complete(base_url, prompt), prompt


def test_a_stream_arrives_whole_with_its_usage(one_process: ServeProcess) -> None:
    text, usage = [], None
    with httpx.stream("POST", f"{one_process.url()}/v1/chat/completions", timeout=120, json={
            "model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 12, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                text += [c["delta"].get("content") or "" for c in chunk["choices"]]
    assert usage is not None and usage["completion_tokens"] == 12 and "".join(text)


def test_bad_input_keeps_its_status(one_process: ServeProcess) -> None:
    r = httpx.post(f"{one_process.url()}/v1/completions", timeout=30,
                   json={"model": "tiny-llama", "prompt": "hi", "max_tokens": -1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
