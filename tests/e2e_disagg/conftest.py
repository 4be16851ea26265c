"""One real disagg graph (`dynamo serve graphs.disagg:Frontend`) shared by the ``nixl`` tests.

The graph gets its own etcd and NATS (package scope) so it never shares the ``dynamo``
namespace with another graph of the same test session. Before it starts, an agg graph
is run once over the same prompts to record the reference outputs, then stopped, so
at most one engine-bearing graph runs at a time.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from dynagraph.runtime.infra import LocalService, start_etcd, start_nats
from tests.support.serve import REPO, ServeProcess
from tools.model_builder import ensure_model

MODEL_DIR = REPO / "models" / "tiny-llama"
MODEL = "tiny-llama"
THRESHOLD = 256
"""max-local-prefill-length of the test graph (tokens)."""
REMOTE_TIMEOUT = 8.0
ACK_WAIT = 4.0
MAX_TOKENS = 16
WORDS = [f"{a}{b}" for a in ("ka", "lo", "mi", "su", "te", "ra", "no", "vi") for b in
         ("n", "sh", "p", "t", "r", "m", "l", "x")]


@dataclass(frozen=True)
class Prompt:
    text: str
    words: int


def make_prompts() -> list[Prompt]:
    """24 prompts with distinct beginnings: 10 short (< THRESHOLD tokens), 14 long."""
    rng = random.Random(1234)
    sizes = [8, 20, 30, 45, 60, 70, 80, 90, 100, 110,
             150, 200, 260, 320, 400, 500, 600, 700, 800, 900, 1000, 1100, 1200, 1300]
    return [Prompt(" ".join(rng.choice(WORDS) for _ in range(n)), n) for n in sizes]


PROMPTS = make_prompts()
KILL_PROMPT = Prompt(" ".join(f"zu{i % 41}x" for i in range(700)), 700)
"""Long and unlike the others: the kill test's request is remote (nothing cached)."""


def complete(base_url: str, prompt: str, timeout: float = 120.0) -> dict[str, object]:
    r = httpx.post(f"{base_url}/v1/completions", timeout=timeout, json={
        "model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True,
    })
    r.raise_for_status()
    body: dict[str, object] = r.json()
    return body


def text_of(body: dict[str, object]) -> str:
    choices = body["choices"]
    assert isinstance(choices, list)
    return str(choices[0]["text"])


def serve_env(etcd: str, nats: str) -> dict[str, str]:
    """As served: the test environment's VLLM_ENABLE_V1_MULTIPROCESSING is not passed on,
    so the components choose (``nixl_side`` picks vLLM's single-process executor for NIXL
    engines). The tests once set it for every engine while ``dynamo serve`` did not, and
    passed while every served remote prefill stalled."""
    env = {**os.environ, "ETCD_ENDPOINTS": etcd, "NATS_SERVER": nats, "PYTHONUNBUFFERED": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    return env


@pytest.fixture(scope="package")
def model_dir() -> Path:
    return ensure_model(MODEL_DIR)


@pytest.fixture(scope="package")
def infra() -> Iterator[tuple[LocalService, LocalService]]:
    etcd = start_etcd()
    try:
        nats = start_nats()
        try:
            yield etcd, nats
        finally:
            nats.stop()
    finally:
        etcd.stop()


@pytest.fixture(scope="package")
def agg_reference(model_dir: Path, infra: tuple[LocalService, LocalService]) -> dict[str, str]:
    """Greedy output of the agg graph for every prompt (the graph is stopped afterwards)."""
    etcd, nats = infra
    sp = ServeProcess(
        ["graphs.agg:Frontend", "-f", "configs/agg.yaml", "--Frontend.port=0",
         f"--Common.model={model_dir}", f"--Processor.model={model_dir}",
         f"--VllmWorker.model={model_dir}", '--VllmWorker.cpu-threads-bind="0"',
         "--VllmWorker.cpu-reserved-cores=0"],
        serve_env(etcd.url, nats.url),
    )
    try:
        sp.wait_ready(180)
        url = sp.url()
        return {p.text: text_of(complete(url, p.text)) for p in [*PROMPTS, KILL_PROMPT]}
    finally:
        code = sp.stop()
        assert code == 0, sp.output()[-3000:]


@dataclass
class DisaggGraph:
    proc: ServeProcess
    url: str
    worker_metrics: str
    etcd_url: str
    nats_url: str

    def etcdctl(self, *args: str) -> str:
        out = subprocess.run(["etcdctl", f"--endpoints={self.etcd_url}", *args],
                             env={**os.environ, "ETCDCTL_API": "3"}, capture_output=True,
                             text=True, timeout=10, check=True)
        return out.stdout

    def metrics(self) -> dict[str, float]:
        """The decode worker's samples (name{labels} -> value), for the series tests read."""
        text = httpx.get(f"http://{self.worker_metrics}/metrics", timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith(("vllm:prompt_tokens_by_source_total", "vllm:nixl_bytes_transferred",
                                "vllm:nixl_xfer_time_seconds", "dynamo_worker_prefill_requests_total")):
                name, _, value = line.rpartition(" ")
                name = re.sub(r'(engine|model_name)="[^"]*",?', "", name).replace(",}", "}")
                out[name] = float(value)
        return out


@pytest.fixture(scope="package")
def disagg_graph(model_dir: Path, infra: tuple[LocalService, LocalService],
                 agg_reference: dict[str, str]) -> Iterator[DisaggGraph]:
    etcd, nats = infra
    sp = ServeProcess(
        ["graphs.disagg:Frontend", "-f", "configs/disagg.yaml", "--Frontend.port=0",
         f"--Common.model={model_dir}", f"--Processor.model={model_dir}",
         f"--VllmWorker.model={model_dir}", f"--PrefillWorker.model={model_dir}",
         f"--VllmWorker.max-local-prefill-length={THRESHOLD}",
         f"--VllmWorker.remote-prefill-timeout={REMOTE_TIMEOUT}",
         f"--VllmWorker.prefill-queue-ack-wait={ACK_WAIT}",
         f"--PrefillWorker.prefill-queue-ack-wait={ACK_WAIT}"],
        serve_env(etcd.url, nats.url),
    )
    try:
        sp.wait_ready(240)
        banner = sp.wait_for_line("VllmWorker[0] pid=")
        m = re.search(r"metrics=(\S+)", banner)
        assert m is not None, banner
        yield DisaggGraph(sp, sp.url(), m.group(1), etcd.url, nats.url)
    finally:
        code = sp.stop(timeout=30)
        log_path = os.environ.get("DYNAGRAPH_TEST_GRAPH_LOG")
        if log_path:  # the graph's whole output, for post-mortems of a CI run
            Path(log_path).write_text(sp.output())
        assert code == 0, sp.output()[-3000:]
