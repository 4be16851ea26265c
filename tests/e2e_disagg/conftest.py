"""One real disagg graph (`dynamo serve graphs.disagg:Frontend`, two prefill workers)
shared by the ``nixl`` tests.

The graph gets its own etcd and NATS (package scope) so it never shares the ``dynamo``
namespace with another graph of the same test session. Before it starts, an agg graph
is run once over the same prompts to record the reference outputs, then stopped, so
at most one engine-bearing graph runs at a time.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import httpx
import pytest

from dynagraph.runtime.infra import LocalService
from tests.support.greedy import TOP_LOGPROBS, Greedy, assert_agrees
from tests.support.infra import own_infra
from tests.support.metrics import scrape, total
from tests.support.serve import ServeProcess, graph_env, served

S = TypeVar("S")

MODEL = "tiny-llama"
THRESHOLD = 256
"""max-local-prefill-length of the test graph (tokens)."""
REMOTE_TIMEOUT = 10.0
ACK_WAIT = 3.0
"""The shipped config's values: a dead prefill worker's job is redelivered in time."""
MAX_TOKENS = 16
NIXL_ONLY = ["--VllmWorker.kv-transport=nixl", "--PrefillWorker.kv-transport=nixl"]
"""The shipped configs copy a same-host prefill's KV (``kv-transport: auto``): this graph
tests the NIXL READ (``tests/e2e_disagg_shm`` the copies)."""
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


def complete(base_url: str, prompt: str, timeout: float = 120.0, **extra: object
             ) -> dict[str, object]:
    r = httpx.post(f"{base_url}/v1/completions", timeout=timeout, json={
        "model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, **extra,
    })
    r.raise_for_status()
    body: dict[str, object] = r.json()
    return body


def text_of(body: dict[str, object]) -> str:
    choices = body["choices"]
    assert isinstance(choices, list)
    return str(choices[0]["text"])


def check_remote_prompts(g: DisaggGraph, reference: dict[str, Greedy],
                         before: Callable[[], S], after: Callable[[int, S], None]) -> int:
    """Every prompt of ``PROMPTS`` through ``g``, its greedy text checked against the agg
    graph's; for each long (remote) one, ``after(prompt_tokens, before())`` with
    ``before`` taken just before its request. Returns how many were remote."""
    remote = 0
    for p in PROMPTS:
        state = before()
        body = complete(g.url, p.text)
        usage = body["usage"]
        assert isinstance(usage, dict)
        n = int(usage["prompt_tokens"])
        assert_agrees(reference[p.text], text_of(body), f"{p.words} words / {n} tokens")
        if n > THRESHOLD:
            remote += 1
            after(n, state)
    return remote


@pytest.fixture(scope="package")
def infra() -> Iterator[tuple[LocalService, LocalService]]:
    with own_infra() as services:
        yield services


_AGG_REFERENCE: dict[str, Greedy] = {}
"""The agg graph's answers, computed once per test session: the disagg packages that
import ``agg_reference`` (nixl, shm, tier, wire) all check against the same prompts."""


@pytest.fixture(scope="package")
def agg_reference(model_dir: Path, infra: tuple[LocalService, LocalService]
                  ) -> dict[str, Greedy]:
    """Greedy output of the agg graph for every prompt (the graph is stopped afterwards),
    with each token's lead over the runner-up (``tests.support.greedy``); served by the
    first package that asks, then kept."""
    if not _AGG_REFERENCE:
        _AGG_REFERENCE.update(_serve_agg_reference(model_dir, infra))
    return _AGG_REFERENCE


def _serve_agg_reference(model_dir: Path, infra: tuple[LocalService, LocalService]
                         ) -> dict[str, Greedy]:
    etcd, nats = infra
    with served(["graphs.agg:Frontend", "-f", "configs/agg.yaml", "--Frontend.port=0",
                 f"--Common.model={model_dir}", '--VllmWorker.cpu-threads-bind="0"',
                 "--VllmWorker.cpu-reserved-cores=0"],
                graph_env(etcd.url, nats.url), ready_timeout=300) as sp:
        url = sp.url()
        out: dict[str, Greedy] = {}
        for p in [*PROMPTS, KILL_PROMPT]:
            choices = complete(url, p.text, logprobs=TOP_LOGPROBS)["choices"]
            assert isinstance(choices, list)
            out[p.text] = Greedy.of(choices[0])
        return out


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
        text = scrape(self.worker_metrics)
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith(("vllm:prompt_tokens_by_source_total", "vllm:nixl_bytes_transferred",
                                "vllm:nixl_xfer_time_seconds", "dynamo_worker_prefill_requests_total")):
                name, _, value = line.rpartition(" ")
                name = re.sub(r'(engine|model_name)="[^"]*",?', "", name).replace(",}", "}")
                out[name] = float(value)
        return out


@contextlib.contextmanager
def serve_disagg(model_dir: Path, infra: tuple[LocalService, LocalService],
                 args: Sequence[str], extra_env: dict[str, str] | None = None
                 ) -> Iterator[DisaggGraph]:
    """``graphs.disagg`` as shipped but for ``args`` (every prompt longer than
    ``THRESHOLD`` prefilled remotely), on ``infra``; stopped on exit."""
    etcd, nats = infra
    with served(["graphs.disagg:Frontend", "-f", "configs/disagg.yaml", "--Frontend.port=0",
                 f"--Common.model={model_dir}",
                 f"--VllmWorker.max-local-prefill-length={THRESHOLD}", *args],
                {**graph_env(etcd.url, nats.url), **(extra_env or {})}) as sp:
        banner = sp.wait_for_line("VllmWorker[0] pid=")
        m = re.search(r"metrics=(\S+)", banner)
        assert m is not None, banner
        yield DisaggGraph(sp, sp.url(), m.group(1), etcd.url, nats.url)


BLOCK = 32
BLOCK_BYTES = 64 * 1024  # the tiny model: 4 layers x K,V x 2 heads x 64 x bf16 x 32 tokens
REMOTE = 'dynamo_worker_prefill_requests_total{reason="long-prompt",where="remote"}'


def transferred(g: DisaggGraph) -> tuple[float, float]:
    """The decode worker's KV transfers and their bytes so far."""
    text = scrape(g.worker_metrics)
    return (total(text, "dynamo_worker_kv_transfers_total"),
            total(text, "dynamo_worker_kv_transfer_bytes_total"))


def check_transfer(g: DisaggGraph, n: int,
                   before: tuple[dict[str, float], tuple[float, float]],
                   low: float, high: float = float("inf")) -> float:
    """After a remote prompt of ``n`` tokens (``before``: the metrics and
    :func:`transferred` just before it): one remote prefill, one transfer whose bytes are
    within ``low``..``high``. Returns the bytes."""
    metrics, (count, nbytes) = before
    deadline = time.monotonic() + 5  # the step's stats reach the metrics just after it
    while transferred(g)[0] == count:
        assert time.monotonic() < deadline, n
        time.sleep(0.05)
    moved = transferred(g)[1] - nbytes
    assert low <= moved <= high, (n, moved, low, high)
    after = g.metrics()
    assert after.get(REMOTE, 0) - metrics.get(REMOTE, 0) == 1, (n, metrics, after)
    return moved


@pytest.fixture(scope="package")
def disagg_graph(model_dir: Path, infra: tuple[LocalService, LocalService],
                 agg_reference: dict[str, Greedy]) -> Iterator[DisaggGraph]:
    with serve_disagg(model_dir, infra, [
            f"--VllmWorker.remote-prefill-timeout={REMOTE_TIMEOUT}",
            f"--Common.prefill-queue-ack-wait={ACK_WAIT}",
            *NIXL_ONLY, "--PrefillWorker.ServiceArgs.workers=2"],
            {"DYNAGRAPH_FAULT_INJECTION": "1"}) as g:
        yield g
