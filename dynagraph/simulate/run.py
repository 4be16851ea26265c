"""``dynamo simulate``'s work: config and trace in, ``summary.json``, ``requests.jsonl`` and
plots out. The only module of the package that touches files.

The graph and its config are resolved exactly as ``dynamo serve`` resolves them (same
overrides, same ``ConfigError`` naming file, component and key); ``plan.py`` refuses
what the simulator does not run (``GraphError`` naming the component).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dynagraph.errors import ConfigError
from dynagraph.sdk._config import resolve_config
from dynagraph.sdk._graph import resolve_target

from .fleet import Progress, Simulation
from .plan import SimPlan, check_graph, plan_simulation
from .plots import write_plots
from .report import hit_rate_series, request_line, summarize
from .trace import DEFAULT_TRACE_BLOCK_SIZE, read_trace

SUMMARY = "summary.json"
REQUESTS = "requests.jsonl"


@dataclass(frozen=True)
class SimulateOptions:
    """The command line of ``dynamo simulate`` (``overrides``: ``--Component.key=value``)."""

    target: str
    config: str | None
    trace: str
    out: str
    overrides: tuple[str, ...] = ()
    speedup: float = 1.0
    block_size: int = DEFAULT_TRACE_BLOCK_SIZE
    slo_ttft_ms: float | None = None
    slo_itl_ms: float | None = None
    seed: int = 0
    plots: bool = True


def graph_target(target: str) -> str:
    """``graphs.mocker_router`` means the module's ``graph``; ``module:Name`` is kept."""
    return target if ":" in target else f"{target}:graph"


def load_plan(target: str, config: str | None, overrides: tuple[str, ...] = ()) -> SimPlan:
    """Resolve the graph and its config as ``dynamo serve`` does, then plan the run."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    graph = resolve_target(graph_target(target))
    check_graph(target, graph.names())  # before its config: the graph is the first problem
    configs = resolve_config(graph, config, list(overrides))
    return plan_simulation(target, configs, file=config)


def simulate(opts: SimulateOptions, *, progress: Callable[[Progress], None] | None = None,
             note: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run one simulation and write its files into ``opts.out``; returns the summary.

    Raises ``ConfigError``, ``GraphError`` or ``TraceError`` before anything is written.
    ``note`` receives the plan's notes (keys with no effect and the like).
    """
    t0 = time.perf_counter()
    if opts.plots and importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("the plots need matplotlib (pip install matplotlib); or --no-plots")
    plan = load_plan(opts.target, opts.config, opts.overrides)
    for line in plan.notes:
        if note is not None:
            note(line)
    requests = read_trace(opts.trace, block_size=opts.block_size, speedup=opts.speedup)
    result = Simulation(plan, requests, trace_block_size=opts.block_size, seed=opts.seed,
                        progress=progress).run()
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    with (out / REQUESTS).open("w") as f:
        for rec in result.records:
            f.write(json.dumps(request_line(rec)) + "\n")
    summary = summarize(result, slo_ttft_ms=opts.slo_ttft_ms, slo_itl_ms=opts.slo_itl_ms)
    if opts.plots:
        bin_s = max(1.0, round(result.span_s / 60.0))
        title = f"{opts.target}, {result.engines} workers, {result.mode}"
        ttfts = [1000 * t for r in result.records if r.completed and (t := r.ttft_s) is not None]
        write_plots(out, title=title, ttfts_ms=ttfts, workers=result.series,
                    hit_rate=hit_rate_series(result.records, bin_s), bin_s=bin_s)
    summary["sim_wall_s"] = summary.pop("wall_s")
    summary["wall_s"] = round(time.perf_counter() - t0, 3)
    summary["trace"] = {"file": opts.trace, "speedup": opts.speedup,
                        "block_size": opts.block_size}
    summary["config"] = {"graph": opts.target, "file": opts.config,
                         "overrides": list(opts.overrides), "seed": opts.seed,
                         "max_model_len": plan.max_model_len,
                         "profile": plan.profile.name}
    summary["notes"] = plan.notes
    (out / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
    return summary
