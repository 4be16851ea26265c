"""Attention-FFN disaggregation of the dense model, as served.

``dynamo serve graphs.agg_afd:Frontend -f configs/agg_afd.yaml`` with three FfnWorkers
(``split: layers``, two shards: layers 0-1 on workers 0 and 2, layers 2-3 on worker 1)
against ``graphs.agg`` on the same model: the greedy text is the same, one request at a
time and eight at once (the engine then splits its batches into two micro-batches in
ping-pong), and killing the FfnWorker the engine uses mid-stream fails over to its
replica without changing a token.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.greedy import Greedy, assert_agrees
from tests.support.metrics import scrape, total
from tests.support.poll import wait_until
from tests.support.serve import ServeProcess, served

from .conftest import (
    PROMPTS,
    assert_all_agree,
    complete,
    complete_all,
    model_arg,
    processes,
    reference_of,
    references_all,
    stream_completion,
)

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

MODEL = "tiny-llama"
LONG_PROMPT = "The Python language reference describes"
LONG_TOKENS = 160


@pytest.fixture(scope="module")
def reference(model_dir: Path, env: dict[str, str]) -> dict[str, Greedy]:
    """Greedy texts of the monolithic graph (one at a time, eight at once, one long)."""
    with served(["graphs.agg:Frontend", "-f", "configs/agg.yaml", "--Frontend.port=0",
                 model_arg(model_dir)], env, ready_timeout=300) as sp:
        url = sp.url()
        alone = references_all(url, MODEL)
        # vLLM's CPU kernels give each request the same tokens whatever its batch (up to a
        # near tie): the premise of comparing batched AFD output with these texts
        assert_all_agree(alone, complete_all(url, MODEL, concurrent=True))
        alone[LONG_PROMPT + "#long"] = reference_of(url, LONG_PROMPT, MODEL, LONG_TOKENS)
        return alone


@pytest.fixture(scope="module")
def afd(model_dir: Path, env: dict[str, str], reference: dict[str, Greedy]
        ) -> Iterator[ServeProcess]:
    with served(["graphs.agg_afd:Frontend", "-f", "configs/agg_afd.yaml", "--Frontend.port=0",
                 model_arg(model_dir), "--FfnWorker.ServiceArgs.workers=3"], env,
                ready_timeout=300) as sp:
        yield sp


def test_greedy_text_equals_the_monolithic_model(afd: ServeProcess,
                                                 reference: dict[str, Greedy]) -> None:
    assert_all_agree(reference, complete_all(afd.url(), MODEL, concurrent=False))


def test_batched_ping_pong_keeps_every_token(afd: ServeProcess,
                                             reference: dict[str, Greedy]) -> None:
    ((_, worker),) = processes(afd, "VllmWorker")
    before = total(scrape(worker), "dynamo_worker_afd_microbatched_forwards_total")
    assert_all_agree(reference, complete_all(afd.url(), MODEL, concurrent=True))
    # The engine publishes its exchange counters twice a second (later on a busy box).
    deadline = time.monotonic() + 10
    while True:
        text = scrape(worker)
        after = total(text, "dynamo_worker_afd_microbatched_forwards_total")
        if after > before or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert after > before, ("no forward pass ran as two micro-batches; forwards: "
                            f"{total(text, 'dynamo_worker_afd_forwards_total')}")


def test_killing_the_ffn_worker_in_use_fails_over_mid_stream(
        afd: ServeProcess, reference: dict[str, Greedy]) -> None:
    ffn = processes(afd, "FfnWorker")
    assert len(ffn) == 3
    # Workers 0 and 2 both hold layers 0-1; the one in use is the one whose calls grow
    # during a request (a connection to the other may stay open from earlier tests).
    pair = (ffn[0], ffn[2])
    before = [total(scrape(m), "dynamo_ffn_calls_total") for _, m in pair]
    assert_agrees(reference[PROMPTS[0]], complete(afd.url(), PROMPTS[0], MODEL))
    grew = [total(scrape(m), "dynamo_ffn_calls_total") - b for (_, m), b in zip(pair, before,
                                                                            strict=True)]
    assert max(grew) > 0, grew
    in_use = pair[grew.index(max(grew))]
    victim = in_use[0]
    spare = pair[1] if in_use == pair[0] else pair[0]
    ((_, worker),) = processes(afd, "VllmWorker")
    spare_calls = total(scrape(spare[1]), "dynamo_ffn_calls_total")
    began = time.monotonic()
    text = stream_completion(afd.url(), LONG_PROMPT, MODEL, LONG_TOKENS,
                             on_first=lambda: os.kill(victim, signal.SIGKILL))
    assert time.monotonic() - began < 120
    assert_agrees(reference[LONG_PROMPT + "#long"], text)
    assert total(scrape(spare[1]), "dynamo_ffn_calls_total") > spare_calls
    wait_until(lambda: total(scrape(worker), "dynamo_worker_afd_failovers_total") >= 1,
               10, "an AFD failover counted (published twice a second)", interval=0.1)
    # and the graph keeps serving
    assert_agrees(reference[PROMPTS[0]], complete(afd.url(), PROMPTS[0], MODEL))
