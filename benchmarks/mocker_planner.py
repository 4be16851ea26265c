"""The Planner vs fixed fleets on a bursty trace: SLO attainment and worker-seconds.

    python benchmarks/mocker_planner.py [--trace benchmarks/traces/data/planner_phases.jsonl]
        [--fleets fixed-1,fixed-max,planner] [--max-workers 4] [--ttft-slo-ms 2000]
        [--itl-slo-ms 100] [--speed 1.0] [--adjustment-interval 5]

Serves ``graphs.mocker_planner`` (``configs/mocker_planner.yaml``: engines 10x slower
than the tiny model, ``max-num-seqs`` 8, one engine per process) on its own etcd and
NATS once per fleet, and replays the trace open loop against it with
``benchmarks/trace_replay.py`` (its JSON, .md and plots are kept per fleet):

- ``fixed-1``: one MockerWorker, the Planner observing only (``no-operation``);
- ``fixed-max``: ``--max-workers`` MockerWorkers, the Planner observing only;
- ``planner``: one MockerWorker to start, the Planner scaling it within
  1..``--max-workers`` (the GPU budget), a retired worker draining first, one replica
  per adjustment (Dynamo's rule);
- ``planner-step``: the same with ``max-step-up: 3`` (a scale-up sized by the load).

``--merge`` keeps the fleets of the last results that this run does not run (one table).

While the trace plays, the MockerWorker processes registered in etcd are counted every
0.5 s: worker-seconds is the integral of that count while the replay process runs (its
start-up and a few seconds of waiting for readiness included, alike for every fleet). Writes
benchmarks/results/mocker_planner.json, .md and mocker_planner_workers.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import shlex
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import REPO, RESULTS, machine_info, write_results  # noqa: E402
from benchmarks._mocker import exit_on_sigterm, serve_graph  # noqa: E402
from dynagraph.planner.connector import count_processes  # noqa: E402
from dynagraph.runtime.discovery import EtcdDiscovery  # noqa: E402
from tools.model_builder import ensure_model  # noqa: E402

log = logging.getLogger("mocker_planner")
NAME = "mocker_planner"
TRACE = "benchmarks/traces/data/planner_phases.jsonl"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", default=TRACE)
    p.add_argument("--fleets", default="fixed-1,fixed-max,planner")
    p.add_argument("--max-workers", type=int, default=4)
    p.add_argument("--ttft-slo-ms", type=float, default=2000.0)
    p.add_argument("--itl-slo-ms", type=float, default=100.0)
    p.add_argument("--speed", type=float, default=1.0, help="trace replay speed")
    p.add_argument("--adjustment-interval", type=float, default=5.0)
    p.add_argument("--drain-grace", type=float, default=60.0)
    p.add_argument("--merge", action="store_true")
    return p.parse_args(argv)


def overrides(fleet: str, args: argparse.Namespace, model: Path) -> list[str]:
    n = args.max_workers
    common = [f"--Common.model={model}", f"--drain-grace={args.drain_grace}",
              f"--Planner.adjustment-interval={args.adjustment_interval}",
              f"--Planner.max-decode-replicas={n}", f"--Planner.gpu-budget={n}"]
    if fleet == "planner":
        return [*common, "--MockerWorker.ServiceArgs.workers=1", "--Planner.max-step-up=1"]
    if fleet == "planner-step":
        return [*common, "--MockerWorker.ServiceArgs.workers=1", "--Planner.max-step-up=3"]
    workers = 1 if fleet == "fixed-1" else n
    return [*common, f"--MockerWorker.ServiceArgs.workers={workers}",
            "--Planner.no-operation=true"]


async def count_workers(etcd_url: str, stop: asyncio.Event, out: list[tuple[float, int]]
                        ) -> None:
    disc = EtcdDiscovery(etcd_url)
    await disc.start()
    try:
        while not stop.is_set():
            recs = await disc.get_prefix("/dynamo/instances/MockerWorker/")
            out.append((time.time(), count_processes(recs)))
            try:
                await asyncio.wait_for(stop.wait(), 0.5)
            except TimeoutError:
                pass
    finally:
        await disc.close()


async def planner_decisions(etcd_url: str) -> list[dict[str, Any]]:
    """The Planner's decisions (its ``status`` endpoint), every adjustment interval."""
    from dynagraph.runtime.rpc import RpcClient

    disc = EtcdDiscovery(etcd_url)
    await disc.start()
    rpc = RpcClient()
    try:
        recs = await disc.get_prefix("/dynamo/instances/Planner/")
        for rec in recs.values():
            stream = rpc.call(rec["address"], "status", {})
            try:
                async for item in stream:
                    return list(item["decisions"])
            finally:
                await stream.aclose()
        return []
    finally:
        await rpc.close()
        await disc.close()


async def replay(cmd: list[str], etcd_url: str
                 ) -> tuple[int, list[tuple[float, int]], float, float]:
    """Run the replay; the worker counts meanwhile and when it ran (epoch seconds)."""
    counts: list[tuple[float, int]] = []
    stop = asyncio.Event()
    counter = asyncio.create_task(count_workers(etcd_url, stop, counts))
    t0 = time.time()
    try:
        proc = await asyncio.create_subprocess_exec(*cmd, cwd=REPO)
        code = await proc.wait()
    finally:
        t1 = time.time()
        stop.set()
        await counter
    return code, counts, t0, t1


def worker_seconds(counts: list[tuple[float, int]], t0: float, t1: float) -> float:
    """Integral of the worker count over [t0, t1] (each sample holds until the next)."""
    total = 0.0
    for (ta, n), (tb, _) in zip(counts, [*counts[1:], (t1, 0)], strict=True):
        lo, hi = max(ta, t0), min(tb, t1)
        if hi > lo:
            total += n * (hi - lo)
    return total


def run_fleet(fleet: str, args: argparse.Namespace, model: Path) -> dict[str, Any]:
    out = RESULTS / f"{NAME}_{fleet}"
    with serve_graph("graphs.mocker_planner:Frontend", "configs/mocker_planner.yaml",
                     overrides(fleet, args, model), ready_timeout=300) as served:
        cmd = [sys.executable, "benchmarks/trace_replay.py", "--url", served.url,
               "--model", "tiny-llama", "--trace", args.trace, "--speed", str(args.speed),
               "--ttft-slo-ms", str(args.ttft_slo_ms), "--itl-slo-ms", str(args.itl_slo_ms),
               "--window-s", "10", "--title", f"{NAME} {fleet}", "--out", str(out)]
        log.info("%s: ready in %.1fs; replaying", fleet, served.ready_s)
        code, counts, t0, t1 = asyncio.run(replay(cmd, served.etcd.url))
        decisions = asyncio.run(planner_decisions(served.etcd.url))
        scaling = [ln for ln in served.server.lines if "scaling MockerWorker" in ln
                   or "retired" in ln or "did not drain" in ln]
    data = json.loads(out.with_name(out.name + ".json").read_text())
    ws = worker_seconds(counts, t0, t1)
    s = data["summary"]
    return {
        "fleet": fleet, "replay_exit_code": code, "requests": s["requests"],
        "errors": s["errors"], "slo_attainment": s["slo_attainment"],
        "goodput_rps": s["goodput_rps"], "throughput_rps": s["throughput_rps"],
        "ttft_ms": s["ttft_ms"], "mean_itl_ms": s["mean_itl_ms"],
        "worker_seconds": round(ws, 1), "replay_s": round(t1 - t0, 1),
        "mean_workers": round(ws / (t1 - t0), 3) if t1 > t0 else None,
        "max_workers": max((n for _, n in counts), default=0),
        "worker_timeline": [(round(t - t0, 2), n) for t, n in counts],
        "planner_decisions": [{**d, "t": round(d["t"] - t0, 2)} for d in decisions],
        "serve_scaling_lines": scaling,
        "replay_results": str(out.relative_to(REPO)) + ".json",
    }


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 3.5))
    for r in runs:
        xs = [t for t, _ in r["worker_timeline"]]
        ys = [n for _, n in r["worker_timeline"]]
        ax.step(xs, ys, where="post",
                label=f"{r['fleet']} (SLO {r['slo_attainment']:.0%}, "
                      f"{r['worker_seconds']:.0f} worker-s)")
    ax.set_xlabel("seconds into the replay")
    ax.set_ylabel("MockerWorker processes")
    ax.legend(loc="upper left", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(command: str, args: argparse.Namespace, runs: list[dict[str, Any]],
             machine: dict[str, Any]) -> str:
    lines = [f"# {NAME}", "", "```bash", command, "```", "",
             f"Trace `{args.trace}` at speed {args.speed}; SLO: TTFT <= {args.ttft_slo_ms:.0f} ms "
             f"and mean ITL <= {args.itl_slo_ms:.0f} ms. Machine: `{json.dumps(machine)}`",
             "", "| fleet | requests | errors | SLO attainment | goodput req/s | TTFT p50 / p90 "
             "ms | mean ITL p50 / p90 ms | worker-s | mean / max workers |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in runs:
        t, i = r["ttft_ms"], r["mean_itl_ms"]
        lines.append(
            f"| {r['fleet']} | {r['requests']} | {r['errors']} | {r['slo_attainment']:.3f} | "
            f"{r['goodput_rps']:.2f} | {t['p50']:.0f} / {t['p90']:.0f} | "
            f"{i['p50']:.0f} / {i['p90']:.0f} | {r['worker_seconds']:.0f} | "
            f"{r['mean_workers']:.2f} / {r['max_workers']} |")
    earlier: dict[str, list[str]] = {}
    for r in runs:
        if r.get("command"):
            earlier.setdefault(r["command"], []).append(r["fleet"])
    for cmd, fleets in earlier.items():
        lines += ["", f"{', '.join(fleets)}: from an earlier run (`--merge`) of `{cmd}`"]
    lines += ["", f"![workers]({NAME}_workers.png)", ""]
    for r in runs:
        if r["serve_scaling_lines"]:
            lines += [f"`{r['fleet']}` scaling (dynamo serve's log):", "", "```"]
            lines += [ln.strip() for ln in r["serve_scaling_lines"]] + ["```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    exit_on_sigterm()
    args = parse_args(argv)
    command = "python benchmarks/mocker_planner.py " + shlex.join(
        sys.argv[1:] if argv is None else argv)
    model = ensure_model()
    runs = [run_fleet(f, args, model) for f in args.fleets.split(",")]
    previous = RESULTS / f"{NAME}.json"
    if args.merge and previous.exists():
        ran = {r["fleet"] for r in runs}
        old = json.loads(previous.read_text())
        kept = [r for r in old["runs"] if r["fleet"] not in ran]
        for r in kept:
            r.setdefault("command", old["command"])
        runs = kept + runs
    plot(runs, RESULTS / f"{NAME}_workers.png")
    data = {"command": command, "machine": machine_info(), "options": vars(args), "runs": runs}
    jpath, mpath = write_results(NAME, data, markdown(command, args, runs, data["machine"]))
    print(mpath.read_text())
    return 0 if all(r["errors"] == 0 for r in runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
