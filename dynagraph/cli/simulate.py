"""``dynamo simulate GRAPH -f CONFIG --trace FILE --out DIR``: replay a request trace
through a mocker graph's policy code on a virtual clock (``dynagraph.simulate``).

    dynamo simulate graphs.mocker_router -f configs/mocker_mooncake.yaml \\
        --trace ../shared/traces/mooncake_conversation_trace.jsonl --out DIR \\
        [--speedup X] [--block-size N] [--slo-ttft-ms T] [--slo-itl-ms I] [--seed S] \\
        [--no-plots] [--Component.key=value ...]

The graph and config are resolved exactly as ``dynamo serve`` resolves them (same
overrides, same errors). Writes ``DIR/summary.json``, ``DIR/requests.jsonl`` and PNG
plots; a progress line goes to stderr while it runs.

Exit codes: 0 done, 2 bad command line, config, graph or trace (nothing written).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from dynagraph.errors import ConfigError, GraphError, TraceError

PROG = "dynamo simulate"


def add_parser(sub: Any) -> None:
    """Add ``simulate`` to the ``dynamo`` command's subparsers."""
    p = sub.add_parser(
        "simulate", help="replay a trace through a mocker graph on a virtual clock",
        description="Replay a Mooncake JSONL trace through GRAPH's own routing and simulated "
        "engines (graphs.mocker_router, graphs.mocker_agg) on a virtual clock, in one "
        "process. Extra arguments --Component.key=value override the config file, as for "
        "dynamo serve.")
    p.add_argument("target", metavar="GRAPH",
                   help="graph module (its `graph`) or MODULE:Component, e.g. "
                   "graphs.mocker_router")
    p.add_argument("-f", "--config", help="YAML config file (as for dynamo serve)")
    p.add_argument("--trace", required=True, metavar="FILE",
                   help="Mooncake JSONL: timestamp (ms), input_length, output_length, hash_ids")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="directory for summary.json, requests.jsonl and the plots")
    p.add_argument("--speedup", type=float, default=1.0, metavar="X",
                   help="divide every arrival time by X (default 1)")
    p.add_argument("--block-size", type=int, default=512, metavar="N",
                   help="tokens per hash id in the trace (default 512, Mooncake's)")
    p.add_argument("--slo-ttft-ms", type=float, metavar="T",
                   help="goodput counts requests whose time to first token is at most T ms")
    p.add_argument("--slo-itl-ms", type=float, metavar="I",
                   help="goodput counts requests whose mean inter-token latency is at most I ms")
    p.add_argument("--seed", type=int, default=0,
                   help="seeds the Router's tie-breaking (unless Router.seed is set) and the "
                   "Processor's random mode (default 0)")
    p.add_argument("--no-plots", action="store_true", help="write no PNG plots")


def simulate_command(args: argparse.Namespace, overrides: list[str]) -> int:
    from dynagraph.simulate.fleet import Progress
    from dynagraph.simulate.run import SimulateOptions, simulate

    tty = sys.stderr.isatty()

    def progress(p: Progress) -> None:
        line = (f"{PROG}: simulated {p.now_s:.1f} s (arrivals until {p.last_arrival_s:.1f} s), "
                f"{p.done}/{p.total} requests done, {p.wall_s:.1f} s wall")
        print(("\r" + line) if tty else line, end="" if tty else "\n", file=sys.stderr,
              flush=True)

    def note(line: str) -> None:
        print(f"{PROG}: note: {line}", file=sys.stderr)

    opts = SimulateOptions(
        target=args.target, config=args.config, trace=args.trace, out=args.out,
        overrides=tuple(overrides), speedup=args.speedup, block_size=args.block_size,
        slo_ttft_ms=args.slo_ttft_ms, slo_itl_ms=args.slo_itl_ms, seed=args.seed,
        plots=not args.no_plots)
    try:
        summary = simulate(opts, progress=progress, note=note)
    except (ConfigError, GraphError, TraceError) as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    if tty:
        print(file=sys.stderr)
    ttft, itl = summary["ttft_ms"], summary["itl_ms"]
    print(f"{summary['completed']}/{summary['requests']} requests completed, "
          f"{summary['rejected']} rejected; TTFT p50 {ttft['p50']} ms p90 {ttft['p90']} ms "
          f"p99 {ttft['p99']} ms; ITL p50 {itl['p50']} ms; cache hit rate "
          f"{summary['cache_hit_rate']}; goodput {summary['goodput_rps']} req/s; "
          f"{summary['worker_seconds']} worker-s; {summary['wall_s']} s wall -> {args.out}")
    return 0
