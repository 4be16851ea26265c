"""``dynamo simulate`` against the served graph it simulates: one trace slice through both.

    python benchmarks/simulate_fidelity.py [--start-s 0] [--minutes 5] [--speedup 2]
        [--token-scale 16] [--output-scale 16] [--config configs/mocker_router.yaml]
        [--engines 4] [--engine-speed 0.25] [--override=--Router.overlap-weight=2 ...]

Takes ``--minutes`` of the Mooncake conversation trace from ``--start-s`` (trace time) and
runs it (a) through ``dynamo simulate graphs.mocker_router`` in this process and (b)
through ``dynamo serve graphs.mocker_router:Frontend`` (its own etcd and NATS), with the
same config and the same ``--override`` values, arrivals divided by ``--speedup`` in
both. The served run sends every request open loop at its arrival time, as a streamed
``/v1/completions`` request whose prompt is the token ids the simulation uses
(``dynagraph.simulate.served``), ``max_tokens`` its output length, ``ignore_eos``.
Compared (served / simulated): TTFT p50 and p90 (issue 49: within 15%) and the cached
prompt tokens, from each response's usage (within 5%).

Scaling, chosen so that the served graph is not the bottleneck on a 2-core machine: the
config is ``configs/mocker_router.yaml`` (cpu-tiny profile, 4096-token context, 32-token
KV blocks) with ``--engines`` engines at ``--engine-speed``. The trace's requests (12k prompt tokens and 343
output tokens on average, 512-token blocks) are shrunk: ``--token-scale 16`` makes each
512-token trace block one 32-token engine block, so every shared trace prefix is a shared
engine prefix, block for block, and the Router's index sees the trace's sharing as it is;
``--output-scale 16`` divides the outputs, since the served graph's cost is per streamed
token (Frontend and Processor) and the simulated one is not. Requests that still do not
fit the 4096-token context are refused by both (counted in ``rejected``). With
``--speedup`` the slice keeps its arrival pattern, compressed.

What the simulator leaves out is the graph's own time per request (HTTP, Frontend,
Processor, Router, request plane, the stream back) and its CPU contention with the
engines; the simulator prices engine steps only. The shrunk prompts make cpu-tiny's
prefills as short as that overhead, a proportion no real deployment has (a GPU prefills a
12k-token prompt in a large fraction of a second), so the default ``--engine-speed 0.25``
makes every simulated step 4x longer, in both runs, and 4 engines keep them from
saturating at ``--speedup 2``. The table also gives the per-request difference of
served and simulated TTFT, whose median is that overhead.

Writes benchmarks/results/simulate_fidelity.json and .md (``--name``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import REPO, machine_info, publish, run_line  # noqa: E402
from benchmarks._mocker import exit_on_sigterm, serve_graph  # noqa: E402
from dynagraph.simulate.report import percentile  # noqa: E402
from dynagraph.simulate.run import SimulateOptions, load_plan, simulate  # noqa: E402
from dynagraph.simulate.served import (  # noqa: E402
    compare,
    completion_body,
    served_summary,
    shrink,
    window,
    write_trace,
)
from dynagraph.simulate.trace import DEFAULT_TRACE_BLOCK_SIZE, read_trace  # noqa: E402
from tests.support.trace_replay import replay_open_loop  # noqa: E402
from tools.model_builder import ensure_model  # noqa: E402

TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
GRAPH = "graphs.mocker_router"


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", default=str(TRACE))
    p.add_argument("--start-s", type=float, default=0.0, help="slice start, trace seconds")
    p.add_argument("--minutes", type=float, default=5.0, help="slice length, trace minutes")
    p.add_argument("--speedup", type=float, default=2.0, help="arrivals divided by this")
    p.add_argument("--token-scale", type=int, default=16,
                   help="prompt tokens divided by this (must divide 512)")
    p.add_argument("--output-scale", type=float, default=16.0,
                   help="output tokens divided by this (rounded up)")
    p.add_argument("--config", default="configs/mocker_router.yaml")
    p.add_argument("--engines", type=int, default=4,
                   help="MockerWorker.engines-per-process, in both runs")
    p.add_argument("--engine-speed", type=float, default=0.25,
                   help="MockerWorker.speed, in both runs (0.25: steps take 4x the profile's)")
    p.add_argument("--override", action="append", default=[],
                   help="a --Component.key=value for both runs, e.g. "
                        "--override=--Router.overlap-weight=2")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="simulate_fidelity")
    return p.parse_args()


def slice_trace(args: argparse.Namespace, path: Path) -> int:
    """Write the slice, shrunk, to ``path``; returns its trace block size."""
    requests = read_trace(args.trace)
    got = shrink(window(requests, args.start_s, args.minutes * 60.0),
                 token_scale=args.token_scale, output_scale=args.output_scale)
    write_trace(path, got)
    return int(DEFAULT_TRACE_BLOCK_SIZE // args.token_scale)


def run(args: argparse.Namespace) -> dict[str, Any]:
    machine = machine_info()  # the load average before the runs
    model_dir = ensure_model(REPO / "models" / "tiny-llama")
    overrides = [f"--Common.model={model_dir}",
                 f"--MockerWorker.engines-per-process={args.engines}",
                 f"--MockerWorker.speed={args.engine_speed:g}", *args.override]
    with tempfile.TemporaryDirectory(prefix="simulate-fidelity-") as tmp:
        trace = Path(tmp) / "slice.jsonl"
        block = slice_trace(args, trace)
        requests = read_trace(trace, block_size=block, speedup=args.speedup)
        simulated = simulate(SimulateOptions(
            target=GRAPH, config=args.config, trace=str(trace), out=str(Path(tmp) / "sim"),
            overrides=tuple(overrides), speedup=args.speedup, block_size=block,
            seed=args.seed, plots=False))
        sim_ttft = {int(rec["index"]): rec["ttft_ms"] for line in
                    (Path(tmp) / "sim" / "requests.jsonl").read_text().splitlines()
                    if (rec := json.loads(line))["ttft_ms"] is not None}
    plan = load_plan(GRAPH, args.config, tuple(overrides))
    model = "tiny-llama"
    bodies = [completion_body(r, model=model, trace_block_size=block,
                              vocab_size=plan.engine_args.vocab_size) for r in requests]
    with serve_graph(f"{GRAPH}:Frontend", args.config, overrides, ready_timeout=180) as sv:
        time.sleep(2.0)  # the Router's first load reports of every engine
        wall0 = time.perf_counter()
        results = asyncio.run(replay_open_loop(sv.url, requests, bodies))
        wall = time.perf_counter() - wall0
    served = served_summary(results)
    served["wall_s"] = round(wall, 2)
    rows = compare(simulated, served)
    gaps = [1000 * t - sim_ttft[r.index] for r in results
            if (t := r.ttft_s) is not None and r.index in sim_ttft]
    gaps.sort()
    served["ttft_gap_ms"] = {f"p{q}": round(percentile(gaps, q), 3) for q in (10, 50, 90)}
    return {"args": vars(args), "argv": shlex.join(sys.argv[1:]), "overrides": overrides,
            "requests": len(requests), "simulated": simulated, "served": served,
            "comparison": rows, "machine": machine}


def _fmt(v: Any) -> str:
    return f"{v:,.1f}" if isinstance(v, float) else f"{v:,}" if isinstance(v, int) else str(v)


def markdown(result: dict[str, Any]) -> str:
    a = result["args"]
    sim, srv = result["simulated"], result["served"]
    lines = [
        "# dynamo simulate vs the served graph: one Mooncake trace slice",
        "",
        run_line("python benchmarks/simulate_fidelity.py " + result["argv"],
                 result["machine"]) + ".",
        "",
        f"`{GRAPH}` with `{a['config']}` in both runs (overrides: "
        f"`{' '.join(result['overrides'][1:]) or 'none'}`). Slice: {a['minutes']:g} trace "
        f"minutes from {a['start_s']:g} s of `{Path(a['trace']).name}`, "
        f"{result['requests']} requests, arrivals / {a['speedup']:g}, prompts / "
        f"{a['token_scale']} (one 512-token trace block = one {512 // a['token_scale']}-token "
        f"engine block), outputs / {a['output_scale']:g}. Simulated in "
        f"{sim['wall_s']:.1f} s; served in {srv['wall_s']:.1f} s.",
        "",
        "| metric | simulated | served | ratio | target |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in result["comparison"]:
        unit = " ms" if r["metric"].startswith("ttft") else ""
        lines.append(f"| {r['metric']}{unit} | {_fmt(r['simulated'])} | {_fmt(r['served'])} | "
                     f"{r['ratio']:.3f} | within {100 * r['target']:.0f}% "
                     f"({'met' if r['ok'] else 'missed'}) |")
    lines += [
        "",
        "| | simulated | served |",
        "| --- | --- | --- |",
        f"| completed | {sim['completed']} | {srv['completed']} |",
        f"| rejected | {sim['rejected']} | {srv['rejected']} |",
        f"| errors | - | {srv['errors']} |",
        f"| prompt tokens (admitted) | {sim['prompt_tokens']:,} | {srv['prompt_tokens']:,} |",
        f"| cache hit rate | {sim['cache_hit_rate']:.4f} | {srv['cache_hit_rate']:.4f} |",
        f"| TTFT mean / p99 ms | {sim['ttft_ms']['mean']:.1f} / {sim['ttft_ms']['p99']:.1f} | "
        f"{srv['ttft_ms']['mean']:.1f} / {srv['ttft_ms']['p99']:.1f} |",
        f"| client send lateness p50 / max ms | - | {srv['send_late_ms']['p50']:.1f} / "
        f"{srv['send_late_ms']['max']:.1f} |",
        f"| per request, served - simulated TTFT p10 / p50 / p90 ms | - | "
        f"{srv['ttft_gap_ms']['p10']:.1f} / {srv['ttft_gap_ms']['p50']:.1f} / "
        f"{srv['ttft_gap_ms']['p90']:.1f} |",
        "",
    ]
    gap = srv["ttft_gap_ms"]
    lines += [
        "What the simulation leaves out: the graph's own time per request (HTTP, Frontend, "
        "Processor, Router, request plane, the stream back) and its CPU contention with the "
        f"engines; the median per-request difference, {gap['p50']:.1f} ms, is about that. "
        f"Single requests differ much more ({gap['p10']:.0f} to {gap['p90']:.0f} ms, p10 to "
        "p90): the served Router decides on load reports that arrive a little earlier or "
        "later than on the virtual clock, so some requests land on another engine and queue "
        "differently; the distributions and the cache hits, which the policy sets, agree. "
        "Engines at `--engine-speed` keep the graph's overhead small against a step, as a "
        "real GPU's prefill of the unshrunk prompts would.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    exit_on_sigterm()
    args = _args()
    publish(args.name, run(args), markdown)


if __name__ == "__main__":
    main()
