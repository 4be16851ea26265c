"""One Router vs two Router replicas on the same load, and a Router's restart.

    python benchmarks/router_replicas.py [--workers 2] [--engines 16] [--groups 32]
        [--per-group 4] [--prefix 2048] [--suffix 32] [--output 8] [--concurrency 16]
        [--rounds 2] [--layouts one,two,two-unshared]

Serves ``graphs.mocker_router`` (``configs/mocker_router.yaml``: cpu-tiny profile at real
speed) with ``--workers`` processes of ``--engines`` engines and two Processors, once per
layout and round, layouts interleaved (one, two, two-unshared, one, two, ...) so that the
shared machine's drift falls on all of them alike:

- ``one``: ``--Router.ServiceArgs.workers=1``;
- ``two``: two Router replicas that share their in-flight requests (the default);
- ``two-unshared``: two replicas with ``--Router.share-inflight=false`` (the control:
  each counts only what it routed itself).

Each round, each layout runs the same two workloads (fresh seeded prefixes per round, the
same across layouts of a round), mode ``kv``:

- ``repeat`` (issue 48's measure): ``--groups`` groups of ``--per-group`` requests sharing
  a ``--prefix``-token prefix; every group's first request, then the repeats shuffled,
  ``--concurrency`` in flight. Measured: the repeats' mean TTFT and the engines' prefix
  cache hit rate.
- ``burst``: fresh groups whose requests are sent back to back (a group's later requests
  arrive while its first is still in prefill, through both Routers): what sharing the
  predicted prefixes is for. Measured: mean TTFT of all and the hit rate.

After the last round's ``two`` layout: one Router replica is SIGKILLed while a light load
runs (``dynamo serve`` restarts it after its 1 s backoff); measured are the load's errors,
the restarted Router's own ``index full`` time (from its start hook to every worker's KV
snapshot and its peer's in-flight snapshot applied; it registers its endpoints only
then) and the time from the kill until it is registered again.

Targets (issue 48): ``two`` mean repeat TTFT within 10% of ``one``'s; the restarted
Router routing from a full index within 2 s. Writes benchmarks/results/router_replicas.json
and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import re
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (  # noqa: E402
    REPO,
    load_average,
    process_tree_cpu,
    publish,
    run_load,
)
from benchmarks._mocker import (  # noqa: E402
    engine_counters,
    exit_on_sigterm,
    instance_records,
    serve_graph,
)
from dynagraph.runtime.discovery import EtcdDiscovery  # noqa: E402
from tools.model_builder import ensure_model  # noqa: E402

log = logging.getLogger("bench.router_replicas")

MODEL = "tiny-llama"
TARGET_RATIO = 1.10
TARGET_RESTART_S = 2.0
COUNTERS = ("dynamo_worker_prefix_cache_queries_total", "dynamo_worker_prefix_cache_hits_total")
LAYOUTS: dict[str, list[str]] = {
    "one": ["--Router.ServiceArgs.workers=1"],
    "two": ["--Router.ServiceArgs.workers=2"],
    "two-unshared": ["--Router.ServiceArgs.workers=2", "--Router.share-inflight=false"],
}
INDEX_FULL = re.compile(r"index full: .* in ([0-9.]+) s")


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--engines", type=int, default=16)
    p.add_argument("--processors", type=int, default=2)
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--per-group", type=int, default=4)
    p.add_argument("--prefix", type=int, default=2048)
    p.add_argument("--suffix", type=int, default=32)
    p.add_argument("--output", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--layouts", default="one,two,two-unshared")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="router_replicas")
    return p.parse_args()


def groups(args: argparse.Namespace, seed: int) -> list[list[list[int]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(args.groups):
        prefix = [rng.randrange(10, 900) for _ in range(args.prefix)]
        out.append([prefix + [rng.randrange(10, 900) for _ in range(args.suffix)]
                    for _ in range(args.per_group)])
    return out


def _bodies(prompts: list[list[int]], output: int) -> list[dict[str, Any]]:
    return [{"model": MODEL, "prompt": p, "max_tokens": output, "temperature": 0,
             "ignore_eos": True, "stream": True} for p in prompts]


async def _hits(disc: EtcdDiscovery) -> tuple[float, float]:
    """(prompt tokens looked up, found cached) over every engine, once settled."""
    prev = None
    for _ in range(20):
        c = await engine_counters(disc, "MockerWorker", COUNTERS)
        cur = tuple(sum(v[n] for v in c.values()) for n in COUNTERS)
        if cur == prev:
            break
        prev = cur
        await asyncio.sleep(0.3)
    assert prev is not None
    return prev[0], prev[1]


def _router_cpu_s(pid: int) -> float:
    return sum(t for k, t in process_tree_cpu(pid).items() if k.startswith("Router:"))


async def workloads(url: str, disc: EtcdDiscovery, args: argparse.Namespace,
                    seed: int, pid: int) -> dict[str, Any]:
    endpoint = f"{url}/v1/completions"
    out: dict[str, Any] = {"loadavg_before": load_average()}
    # repeat: firsts, then the repeats shuffled
    gs = groups(args, seed)
    repeats = [p for g in gs for p in g[1:]]
    random.Random(seed + 1).shuffle(repeats)
    await run_load(endpoint, _bodies([g[0] for g in gs], args.output), args.concurrency)
    q0, h0 = await _hits(disc)
    cpu0 = _router_cpu_s(pid)
    r = await run_load(endpoint, _bodies(repeats, args.output), args.concurrency)
    cpu_ms = (_router_cpu_s(pid) - cpu0) * 1e3 / len(repeats)
    q1, h1 = await _hits(disc)
    out["repeat"] = {"ttft_ms": r["ttft_ms"], "errors": r["errors"], "wall_s": r["wall_s"],
                     "router_cpu_ms_per_request": cpu_ms,
                     "hit_rate": (h1 - h0) / (q1 - q0) if q1 > q0 else 0.0,
                     "first_error": r["first_error"]}
    # burst: each group's requests back to back
    gs = groups(args, seed + 50)
    order = list(range(len(gs)))
    random.Random(seed + 2).shuffle(order)
    b = await run_load(endpoint, _bodies([p for i in order for p in gs[i]], args.output),
                       args.concurrency)
    q2, h2 = await _hits(disc)
    out["burst"] = {"ttft_ms": b["ttft_ms"], "errors": b["errors"], "wall_s": b["wall_s"],
                    "hit_rate": (h2 - h1) / (q2 - q1) if q2 > q1 else 0.0,
                    "first_error": b["first_error"]}
    return out


async def _router_pids(disc: EtcdDiscovery) -> dict[str, int]:
    return {k: int(v["pid"]) for k, v in (await instance_records(disc, "Router")).items()}


async def _line_after(server: Any, start: int, text: str) -> str:
    """The first output line from index ``start`` on that contains ``text`` (waits)."""
    seen = start
    while True:
        lines = server.lines
        for line in lines[seen:]:
            if text in line:
                return str(line)
        seen = max(seen, len(lines))
        await asyncio.sleep(0.05)


async def restart(url: str, disc: EtcdDiscovery, server: Any, args: argparse.Namespace,
                  seed: int) -> dict[str, Any]:
    """SIGKILL one Router replica under a light load; time its return."""
    before = await _router_pids(disc)
    seen_lines = len(server.lines)
    victim_id, victim = sorted(before.items())[0]
    gs = groups(argparse.Namespace(**{**vars(args), "groups": 16}), seed)
    bodies = _bodies([p for g in gs for p in g], args.output)
    load = asyncio.create_task(run_load(f"{url}/v1/completions", bodies, 8))
    await asyncio.sleep(1.0)
    t_kill = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    registered_s = None
    while time.monotonic() - t_kill < 30:
        now = await _router_pids(disc)
        fresh = {k for k in now if k not in before}
        if fresh:
            registered_s = time.monotonic() - t_kill
            break
        await asyncio.sleep(0.05)
    async with asyncio.timeout(30):
        line = await _line_after(server, seen_lines, "index full")
    m = INDEX_FULL.search(line)
    got = await load
    return {"killed_pid": victim, "killed_instance": victim_id,
            "kill_to_registered_s": registered_s,
            "index_full_s": float(m.group(1)) if m else None, "index_full_line": line,
            "load_requests": got["requests"], "load_errors": got["errors"],
            "load_first_error": got["first_error"]}


async def run_layout(url: str, etcd_url: str, server: Any, args: argparse.Namespace,
                     seed: int, kill: bool) -> dict[str, Any]:
    disc = EtcdDiscovery(etcd_url)
    await disc.start()
    try:
        recs = await instance_records(disc, "MockerWorker")
        assert len(recs) == args.workers * args.engines, len(recs)
        await disc.put("/dynamo/settings/Router/mode", "kv")
        warm = groups(argparse.Namespace(**{**vars(args), "groups": 4, "per_group": 1}),
                      seed=999)
        await run_load(f"{url}/v1/completions", _bodies([g[0] for g in warm], 2), 4)
        out = await workloads(url, disc, args, seed, server.pid)
        if kill:
            out["restart"] = await restart(url, disc, server, args, seed + 77)
    finally:
        await disc.close()
    return out


def _mean(runs: list[dict[str, Any]], layout: str, phase: str) -> float:
    return statistics.fmean(r[phase]["ttft_ms"]["mean"] for r in runs if r["layout"] == layout)


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    layouts = sorted({r["layout"] for r in runs})
    out: dict[str, Any] = {
        phase: {lay: {"ttft_mean_ms": _mean(runs, lay, phase),
                      "hit_rate": statistics.fmean(r[phase]["hit_rate"] for r in runs
                                                   if r["layout"] == lay)}
                for lay in layouts}
        for phase in ("repeat", "burst")}
    if "one" in layouts:
        for phase in ("repeat", "burst"):
            base = out[phase]["one"]["ttft_mean_ms"]
            for lay in layouts:
                out[phase][lay]["vs_one"] = out[phase][lay]["ttft_mean_ms"] / base
    out["errors"] = sum(r[p]["errors"] for r in runs for p in ("repeat", "burst"))
    rs = [r["restart"] for r in runs if "restart" in r]
    if rs:
        out["restart"] = rs[-1]
    return out


def markdown(result: dict[str, Any]) -> str:
    a, s = result["args"], result["summary"]
    lines = [
        "# One Router vs two Router replicas (graphs.mocker_router)", "",
        f"`python benchmarks/router_replicas.py --workers {a['workers']} --engines "
        f"{a['engines']} --rounds {a['rounds']}`: {a['workers'] * a['engines']} cpu-tiny "
        f"engines at real speed, {a['processors']} Processors, mode kv; each layout served "
        "afresh per round, layouts interleaved. Shared 2-core machine: provisional.", "",
        f"Workloads per layout and round: `repeat`: {a['groups']} groups x {a['per_group']} "
        f"requests, {a['prefix']}-token prefix + {a['suffix']}-token suffix, {a['output']} "
        f"output tokens, concurrency {a['concurrency']}; every group's first request, then the "
        "repeats shuffled (TTFT of the repeats). `burst`: fresh groups, each group's requests "
        "back to back (TTFT of all).", "",
        "| round | layout | repeat TTFT mean ms | p50 | p90 | repeat hit rate | burst TTFT "
        "mean ms | burst hit rate | Router CPU ms per repeat (all replicas) | errors "
        "| load avg before |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["runs"]:
        rp, b = r["repeat"], r["burst"]
        lines.append(
            f"| {r['round']} | {r['layout']} | {rp['ttft_ms']['mean']:.1f} | "
            f"{rp['ttft_ms']['p50']:.1f} | {rp['ttft_ms']['p90']:.1f} | {rp['hit_rate']:.3f} | "
            f"{b['ttft_ms']['mean']:.1f} | {b['hit_rate']:.3f} | "
            f"{rp['router_cpu_ms_per_request']:.2f} | "
            f"{rp['errors'] + b['errors']} | {r['loadavg_before']:.1f} |")
    lines += ["", "Means over rounds:", "",
              "| layout | repeat TTFT mean ms | vs one | repeat hit rate | burst TTFT mean ms "
              "| vs one | burst hit rate |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for lay in s["repeat"]:
        rp, b = s["repeat"][lay], s["burst"][lay]
        lines.append(f"| {lay} | {rp['ttft_mean_ms']:.1f} | {rp.get('vs_one', float('nan')):.3f} "
                     f"| {rp['hit_rate']:.3f} | {b['ttft_mean_ms']:.1f} | "
                     f"{b.get('vs_one', float('nan')):.3f} | {b['hit_rate']:.3f} |")
    if "two" in s["repeat"] and "vs_one" in s["repeat"]["two"]:
        v = s["repeat"]["two"]["vs_one"]
        lines += ["", f"Two Routers / one, mean repeat TTFT: **{v:.3f}** (target <= "
                  f"{TARGET_RATIO}); errors **{s['errors']}**."]
    if "restart" in s:
        rs = s["restart"]
        lines += ["", f"Restart: SIGKILL of one Router replica (pid {rs['killed_pid']}) under a "
                  f"light load ({rs['load_requests']} requests, concurrency 8): "
                  f"**{rs['load_errors']} errors**; the restarted Router's index full "
                  f"**{rs['index_full_s']} s** after its start hook began (target <= "
                  f"{TARGET_RESTART_S} s; it registers its endpoints only then); registered "
                  f"again {rs['kill_to_registered_s']:.2f} s after the kill (dynamo serve's 1 s "
                  "restart backoff and the process's start included).", "",
                  f"    {rs['index_full_line'].strip()}"]
    lines += ["", f"Machine: {result['machine']}", ""]
    return "\n".join(lines)


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    exit_on_sigterm()
    args = _args()
    model_dir = ensure_model(REPO / "models" / "tiny-llama")
    layouts = args.layouts.split(",")
    runs = []
    for rnd in range(args.rounds):
        for lay in layouts:
            overrides = [f"--Common.model={model_dir}",
                         f"--MockerWorker.ServiceArgs.workers={args.workers}",
                         f"--MockerWorker.engines-per-process={args.engines}",
                         f"--Processor.ServiceArgs.workers={args.processors}", *LAYOUTS[lay]]
            kill = lay == "two" and rnd == args.rounds - 1
            log.info("round %d, layout %s ...", rnd, lay)
            with serve_graph("graphs.mocker_router:Frontend", "configs/mocker_router.yaml",
                             overrides) as g:
                r = asyncio.run(run_layout(g.url, g.etcd.url, g.server, args,
                                           args.seed + 1000 * rnd, kill))
            r.update(round=rnd, layout=lay, loadavg_before=r.pop("loadavg_before"))
            log.info("repeat TTFT mean %.1f ms (hit %.3f), burst %.1f ms (hit %.3f)",
                     r["repeat"]["ttft_ms"]["mean"], r["repeat"]["hit_rate"],
                     r["burst"]["ttft_ms"]["mean"], r["burst"]["hit_rate"])
            runs.append(r)
    publish(args.name, {"args": vars(args), "runs": runs, "summary": summary(runs)}, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
