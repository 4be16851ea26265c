"""Attention-FFN disaggregation of the MoE model with expert parallelism, as served.

``dynamo serve graphs.agg_afd:Frontend -f configs/agg_afd.yaml`` on the tiny Mixtral-style
model (``tools/moe_builder.py``) with two FfnWorkers holding two of the four experts of
every layer each (``split: experts``), against ``graphs.agg`` on the same model: the
greedy text is the same, one request at a time and eight at once.

Expert parallel adds each token's partial sums from the two workers: a token whose two
chosen experts live on one worker gets exactly the monolithic value, a token whose
experts are split gets one more bfloat16 rounding than vLLM's fused kernel (see
``dynagraph.llm.afd.ffn``). That can flip a near tie, so the texts are compared up to
one (``tests.support.greedy``): they may part only where the monolithic model's two best
tokens were within rounding of each other.

Then the worker holding experts 2-3 is killed with no replica and a one-second failover
timeout: the next request fails with an error naming the layer that cannot be computed,
within seconds (nothing hangs); once ``dynamo serve`` has restarted that worker, the
VllmWorker starts a new engine and the same request gives the same text again.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.greedy import Greedy, assert_agrees
from tests.support.poll import wait_until
from tests.support.serve import ServeProcess, served
from tools.moe_builder import ensure_moe_model

from .conftest import (
    PROMPTS,
    assert_all_agree,
    complete_all,
    model_arg,
    processes,
    references_all,
)

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

MODEL = "tiny-moe"


@pytest.fixture(scope="module")
def moe_dir(model_dir: Path) -> Path:
    return ensure_moe_model(model_dir.parent / "tiny-moe", dense_dir=model_dir)


@pytest.fixture(scope="module")
def reference(moe_dir: Path, env: dict[str, str]) -> dict[str, Greedy]:
    with served(["graphs.agg:Frontend", "-f", "configs/agg.yaml", "--Frontend.port=0",
                 model_arg(moe_dir), f"--Common.served-model-name={MODEL}"], env,
                ready_timeout=300) as sp:
        alone = references_all(sp.url(), MODEL)
        assert_all_agree(alone, complete_all(sp.url(), MODEL, concurrent=True))
        return alone


@pytest.fixture(scope="module")
def afd(moe_dir: Path, env: dict[str, str], reference: dict[str, Greedy]
        ) -> Iterator[ServeProcess]:
    with served(["graphs.agg_afd:Frontend", "-f", "configs/agg_afd.yaml", "--Frontend.port=0",
                 model_arg(moe_dir), f"--Common.served-model-name={MODEL}",
                 "--FfnWorker.split=experts", "--VllmWorker.afd={failover-timeout-s: 1}"],
                env, ready_timeout=300) as sp:
        yield sp


def test_expert_parallel_greedy_text_equals_the_monolithic_model(
        afd: ServeProcess, reference: dict[str, Greedy]) -> None:
    assert_all_agree(reference, complete_all(afd.url(), MODEL, concurrent=False))
    assert_all_agree(reference, complete_all(afd.url(), MODEL, concurrent=True))


def test_losing_an_expert_group_fails_requests_clearly(afd: ServeProcess) -> None:
    ffn = processes(afd, "FfnWorker")
    assert len(ffn) == 2
    os.kill(ffn[1][0], signal.SIGKILL)  # experts 2-3; dynamo serve restarts it, slowly
    began = time.monotonic()
    r = httpx.post(f"{afd.url()}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0})
    assert time.monotonic() - began < 30
    assert r.status_code >= 500, r.text
    assert "no FfnWorker can compute layer" in r.text, r.text


def test_the_graph_recovers_when_the_expert_group_is_back(
        afd: ServeProcess, reference: dict[str, Greedy]) -> None:
    def answers() -> str | None:
        r = httpx.post(f"{afd.url()}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": PROMPTS[0], "max_tokens": 32, "temperature": 0,
            "ignore_eos": True})
        return str(r.json()["choices"][0]["text"]) if r.status_code == 200 else None

    text = wait_until(answers, 240, "the VllmWorker's restarted engine", interval=2.0)
    assert text is not None
    assert_agrees(reference[PROMPTS[0]], text)
