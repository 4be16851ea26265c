"""The disagg_router graph on three "hosts" (network namespaces on a bridge, addresses from
198.18.0.0/24), as ``tests.support.multihost`` builds it. Root only: skipped with the
reason when not root; as root (CI) a lab that cannot be built fails the tests, naming why.

An agg graph runs first (on loopback, its own etcd/NATS) to record the greedy reference
outputs, then stops, so only one engine-bearing graph runs at a time.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.support.greedy import TOP_LOGPROBS, Greedy
from tests.support.infra import own_infra
from tests.support.multihost import ThreeHostGraph, three_host_graph
from tests.support.netns import unavailable_reason
from tests.support.serve import graph_env, served

MODEL = "tiny-llama"
WORDS = [f"{a}{b}" for a in ("ka", "lo", "mi", "su", "te", "ra")
         for b in ("n", "sh", "p", "t", "x")]
PROMPTS = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(n))
           for i, n in enumerate((6, 40, 150, 400, 900))]
"""Short and long: every one is prefilled on the prefill host (conditional-disagg off)."""
SHORT_TOKENS = 12
STREAM_PROMPTS = [f"Stream {i}: " + " ".join(WORDS[(i * 5 + j) % len(WORDS)] for j in range(120))
                  for i in range(4)]
STREAM_TOKENS = 1000  # long enough to be running when the victim is chosen on a fast machine


@pytest.fixture(scope="package", autouse=True)
def _needs_netns() -> None:
    reason = unavailable_reason()
    if reason is None:
        return
    if os.geteuid() != 0:
        pytest.skip(f"multi-host test: {reason}")
    pytest.fail(f"multi-host test: running as root, yet {reason}", pytrace=False)


def complete(url: str, prompt: str, max_tokens: int, **extra: object) -> dict[str, object]:
    r = httpx.post(f"{url}/v1/completions", timeout=180, json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    body: dict[str, object] = r.json()
    return body


def text_of(body: dict[str, object]) -> str:
    choices = body["choices"]
    assert isinstance(choices, list)
    return str(choices[0]["text"])


@pytest.fixture(scope="package")
def agg_reference(model_dir: Path) -> dict[str, Greedy]:
    """Greedy output of the agg graph for every prompt (stopped afterwards), with each
    token's lead over the runner-up: other paths may part from it at a near tie."""
    # its temp files (vLLM's IPC sockets, vllm_dist_*) in a directory removed afterwards
    with tempfile.TemporaryDirectory(prefix="dynagraph-mh-tmp-") as tmp_dir, \
            own_infra() as (etcd, nats), served(
            ["graphs.agg:Frontend", "-f", "configs/agg.yaml", "--Frontend.port=0",
             f"--Common.model={model_dir}", '--VllmWorker.cpu-threads-bind="0"',
             "--VllmWorker.cpu-reserved-cores=0"],
            {**graph_env(etcd.url, nats.url), "TMPDIR": tmp_dir},
            ready_timeout=300) as sp:
        url = sp.url()
        asks = [(p, SHORT_TOKENS) for p in PROMPTS] + [(p, STREAM_TOKENS) for p in STREAM_PROMPTS]
        with ThreadPoolExecutor(len(asks)) as pool:  # one batch: the long ones take a while
            answers = pool.map(lambda ask: _reference(url, *ask), asks)
            return {p: answer for (p, _), answer in zip(asks, answers, strict=True)}


def _reference(url: str, prompt: str, max_tokens: int) -> Greedy:
    choices = complete(url, prompt, max_tokens, logprobs=TOP_LOGPROBS)["choices"]
    assert isinstance(choices, list)
    return Greedy.of(choices[0])


@pytest.fixture(scope="package")
def three_hosts(model_dir: Path, agg_reference: dict[str, Greedy]) -> Iterator[ThreeHostGraph]:
    with three_host_graph(model_dir) as g:
        yield g
