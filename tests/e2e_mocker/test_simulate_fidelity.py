"""``dynamo simulate`` agrees with the graph it simulates: a small Mooncake slice through
both (the served ``graphs.mocker_router`` and the in-process simulation, same config and
overrides), compared on cached prompt tokens and TTFT p50.

The slice (``benchmarks/traces/data/mooncake_conversations_slice.jsonl``, see its
README): whole conversations (two or more turns sharing a prefix) from the Mooncake
conversation trace's first 10 minutes, 39 requests, arrivals compressed to ~15 s, lengths
shrunk as ``benchmarks/simulate_fidelity.py`` shrinks them (one 512-token trace block =
one 32-token engine block), so the Router's choices decide most of the cache hits.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dynagraph.runtime.infra import LocalService
from dynagraph.simulate.run import SimulateOptions, load_plan, simulate
from dynagraph.simulate.served import (
    compare,
    completion_body,
    served_summary,
    shrink,
    write_trace,
)
from dynagraph.simulate.trace import read_trace
from tests.support.paths import REPO
from tests.support.serve import ServeProcess, graph_env, served
from tests.support.trace_replay import replay_open_loop

from .conftest import MODEL, wait_records

pytestmark = pytest.mark.integration

SLICE = REPO / "benchmarks" / "traces" / "data" / "mooncake_conversations_slice.jsonl"
CONFIG = "configs/mocker_router.yaml"
ENGINES = 4
OVERRIDES = [f"--MockerWorker.engines-per-process={ENGINES}", "--MockerWorker.speed=0.25"]
SPEEDUP = 40.0
TOKEN_SCALE = 16
BLOCK = 512 // TOKEN_SCALE
# Generous, yet far tighter than what a wrong policy gives: round-robin routing in the
# simulator finds about a quarter of kv's cached tokens on this slice.
CACHED_WITHIN, TTFT_P50_WITHIN = 0.10, 0.35


@pytest.fixture(scope="module")
def slice_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    got = shrink(read_trace(SLICE), token_scale=TOKEN_SCALE, output_scale=16)
    path = tmp_path_factory.mktemp("slice") / "slice.jsonl"
    write_trace(path, got)
    return path


@pytest.fixture(scope="module")
def graph(mocker_infra: tuple[LocalService, LocalService], model_dir: Path
          ) -> Iterator[ServeProcess]:
    etcd, nats = mocker_infra
    with served(["graphs.mocker_router:Frontend", "-f", CONFIG, "--Frontend.port=0",
                 f"--Common.model={model_dir}", *OVERRIDES],
                graph_env(etcd.url, nats.url), ready_timeout=120) as sp:
        wait_records(etcd.url, "MockerWorker", ENGINES)
        yield sp


def test_simulated_and_served_agree(graph: ServeProcess, slice_file: Path, model_dir: Path,
                                    tmp_path: Path) -> None:
    overrides = (f"--Common.model={model_dir}", *OVERRIDES)
    simulated = simulate(SimulateOptions(
        target="graphs.mocker_router", config=CONFIG, trace=str(slice_file),
        out=str(tmp_path / "sim"), overrides=overrides, speedup=SPEEDUP, block_size=BLOCK,
        plots=False))
    requests = read_trace(slice_file, block_size=BLOCK, speedup=SPEEDUP)
    vocab = load_plan("graphs.mocker_router", CONFIG, overrides).engine_args.vocab_size
    bodies = [completion_body(r, model=MODEL, trace_block_size=BLOCK, vocab_size=vocab)
              for r in requests]
    results = asyncio.run(replay_open_loop(graph.url(), requests, bodies))
    srv = served_summary(results)
    rows = {r["metric"]: r for r in compare(simulated, srv, {
        "cached_prompt_tokens": CACHED_WITHIN, "ttft_p50": TTFT_P50_WITHIN})}
    why = _explain(simulated, srv, rows)
    assert srv["errors"] == 0, why
    assert (simulated["completed"], simulated["rejected"]) == (
        srv["completed"], srv["rejected"]), why
    assert simulated["prompt_tokens"] == srv["prompt_tokens"], why
    assert simulated["cached_prompt_tokens"] > 0.25 * simulated["prompt_tokens"], why
    assert rows["cached_prompt_tokens"]["ok"], why
    assert rows["ttft_p50"]["ok"], why


def _explain(sim: dict[str, Any], srv: dict[str, Any], rows: dict[str, Any]) -> str:
    return (f"simulated vs served: {rows}; completed {sim['completed']}/{srv['completed']}, "
            f"rejected {sim['rejected']}/{srv['rejected']}, prompt tokens "
            f"{sim['prompt_tokens']}/{srv['prompt_tokens']}, first error {srv['first_error']}")
