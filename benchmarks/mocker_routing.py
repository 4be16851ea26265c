"""KV-aware routing vs random over 256 mocker engines, on repeated long prefixes.

    python benchmarks/mocker_routing.py [--workers 4] [--engines 64] [--groups 64]
        [--per-group 8] [--prefix 3072] [--suffix 64] [--output 16] [--concurrency 8,32]
        [--modes random,kv] [--overlap-weights 1,2]

Serves ``graphs.mocker_router`` (``configs/mocker_router.yaml``: cpu-tiny profile at real
speed, 4096-token context) with ``--workers`` processes of ``--engines`` engines, once,
on its own etcd and NATS, and runs the same workload shape per mode; the Router's mode
is switched live through etcd (``/dynamo/settings/Router/mode``). Each mode gets fresh
random prefixes (seeded), so nothing it finds cached comes from another mode. Before
each run the script waits (``--calm-wait``) for the machine's load average to drop to
``--calm-load`` (other engineers share it); the value is recorded per run.

Workload: ``--groups`` groups of ``--per-group`` requests sharing a ``--prefix``-token
prefix, each with its own ``--suffix``; streamed ``/v1/completions`` of ``--output``
tokens, ``--concurrency`` in flight (each level in turn). First every group's first
request (the prefix is computed somewhere), then all the repeats, shuffled (seeded).
Measured per level and mode:

- mean (and p50/p90) TTFT of the repeats, as the client sees it;
- the prefix-cache hit rate summed over all engines (prompt tokens found cached /
  prompt tokens looked up, from their ``/metrics``) against the ideal (every repeat
  hits its whole prefix in full blocks, first requests hit nothing);
- errors; how many engines served requests.

Targets (issue 14): kv mean repeat TTFT <= 0.3x random's; kv hit rate >= 0.9 of ideal;
0 errors. Writes benchmarks/results/mocker_routing.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (  # noqa: E402
    REPO,
    process_tree_cpu,
    publish,
    run_load,
)
from benchmarks._mocker import (  # noqa: E402
    engine_counters,
    exit_on_sigterm,
    instance_records,
    serve_graph,
    wait_for_calm,
)
from dynagraph.runtime.discovery import EtcdDiscovery  # noqa: E402
from tools.model_builder import ensure_model  # noqa: E402

log = logging.getLogger("bench.mocker_routing")

MODEL = "tiny-llama"
BLOCK = 32
TARGET_TTFT_RATIO = 0.3
TARGET_HIT_RATIO = 0.9
COUNTERS = ("dynamo_worker_prefix_cache_queries_total", "dynamo_worker_prefix_cache_hits_total")


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--engines", type=int, default=64)
    p.add_argument("--groups", type=int, default=64)
    p.add_argument("--per-group", type=int, default=8)
    p.add_argument("--prefix", type=int, default=3072)
    p.add_argument("--suffix", type=int, default=64)
    p.add_argument("--output", type=int, default=16)
    p.add_argument("--concurrency", default="8,32",
                   help="comma-separated levels; every mode runs at each")
    p.add_argument("--modes", default="random,kv")
    p.add_argument("--overlap-weights", default="1,2",
                   help="comma-separated Router overlap-weights, each set live (etcd) in turn")
    p.add_argument("--calm-load", type=float, default=3.0,
                   help="before each run, wait for the 1-min load average to drop to this")
    p.add_argument("--calm-wait", type=float, default=120.0,
                   help="longest wait for --calm-load per run, seconds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-arg", action="append", default=[],
                   help="one more dynamo serve override, e.g. "
                        "--serve-arg=--Processor.ServiceArgs.embed-in=Frontend")
    p.add_argument("--name", default="mocker_routing")
    return p.parse_args()


def workload(args: argparse.Namespace, seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """(first requests, repeats shuffled): token-id prompts."""
    rng = random.Random(seed)
    firsts: list[list[int]] = []
    repeats: list[list[int]] = []
    for _ in range(args.groups):
        prefix = [rng.randrange(10, 900) for _ in range(args.prefix)]
        group = [prefix + [rng.randrange(10, 900) for _ in range(args.suffix)]
                 for _ in range(args.per_group)]
        firsts.append(group[0])
        repeats.extend(group[1:])
    rng.shuffle(repeats)
    return firsts, repeats


def ideal_hit_rate(args: argparse.Namespace) -> float:
    hits = args.groups * (args.per_group - 1) * (args.prefix // BLOCK) * BLOCK
    queries = args.groups * args.per_group * (args.prefix + args.suffix)
    return hits / queries


async def _settled(disc: EtcdDiscovery, within: float = 10.0) -> dict[str, dict[str, float]]:
    """Engine counters once two reads 0.3 s apart agree."""
    deadline = time.monotonic() + within
    prev = await engine_counters(disc, "MockerWorker", COUNTERS)
    while time.monotonic() < deadline:
        await asyncio.sleep(0.3)
        cur = await engine_counters(disc, "MockerWorker", COUNTERS)
        if cur == prev:
            return cur
        prev = cur
    return prev


def _bodies(prompts: list[list[int]], output: int) -> list[dict[str, Any]]:
    return [{"model": MODEL, "prompt": p, "max_tokens": output, "temperature": 0,
             "ignore_eos": True, "stream": True} for p in prompts]


async def run_mode(url: str, disc: EtcdDiscovery, args: argparse.Namespace, mode: str,
                   concurrency: int, seed: int, pid: int) -> dict[str, Any]:
    firsts, repeats = workload(args, seed)
    calm_s, load = await asyncio.to_thread(wait_for_calm, args.calm_load, args.calm_wait)
    await disc.put("/dynamo/settings/Router/mode", mode)
    await asyncio.sleep(0.5)  # the Router's watch applies it within milliseconds
    before = await _settled(disc)
    first = await run_load(f"{url}/v1/completions", _bodies(firsts, args.output), concurrency)
    cpu0 = process_tree_cpu(pid)
    client0 = time.process_time()
    repeat = await run_load(f"{url}/v1/completions", _bodies(repeats, args.output),
                            concurrency)
    cpu1 = process_tree_cpu(pid)
    client_ms = (time.process_time() - client0) * 1e3 / len(repeats)
    graph_cores = (sum(cpu1.values()) - sum(cpu0.values())) / repeat["wall_s"]
    per_request: dict[str, float] = {}  # CPU ms per repeat, per component
    for key, t in cpu1.items():
        name = key.rsplit(":", 1)[0]
        per_request[name] = per_request.get(name, 0.0) + (t - cpu0.get(key, 0.0)) * 1e3 / len(
            repeats)
    after = await _settled(disc)
    q, h = (sum(after[w][n] - before.get(w, {}).get(n, 0.0) for w in after) for n in COUNTERS)
    served = sum(1 for w in after if after[w][COUNTERS[0]] > before.get(w, {}).get(COUNTERS[0], 0))
    ideal = ideal_hit_rate(args)
    rate = h / q if q else 0.0
    return {
        "mode": mode, "concurrency": concurrency, "hit_rate": rate, "ideal_hit_rate": ideal,
        "calm_wait_s": calm_s, "loadavg_before": load,
        "repeat_graph_cores": graph_cores,
        "repeat_cpu_ms_per_request": {k: round(v, 2) for k, v in sorted(per_request.items())},
        "repeat_client_cpu_ms_per_request": round(client_ms, 2),
        "hit_rate_vs_ideal": rate / ideal if ideal else 0.0,
        "prompt_tokens": q, "cached_tokens": h, "engines_used": served,
        "first_ttft_ms": first["ttft_ms"], "repeat_ttft_ms": repeat["ttft_ms"],
        "repeat_tpot_ms": repeat["tpot_ms"],
        "errors": first["errors"] + repeat["errors"],
        "first_error": first["first_error"] or repeat["first_error"],
        "wall_s": first["wall_s"] + repeat["wall_s"],
        "requests": first["requests"] + repeat["requests"],
    }


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per overlap-weight and concurrency level (``"w1/c8"``): kv against random."""
    out: dict[str, Any] = {}
    for w, c in sorted({(r["overlap_weight"], r["concurrency"]) for r in runs}):
        by = {r["mode"]: r for r in runs if (r["overlap_weight"], r["concurrency"]) == (w, c)}
        if "kv" not in by or "random" not in by:
            continue
        kv, rnd = by["kv"], by["random"]
        out[f"w{w:g}/c{c}"] = {
            "repeat_ttft_mean_ratio": kv["repeat_ttft_ms"]["mean"] / rnd["repeat_ttft_ms"]["mean"],
            "kv_hit_vs_ideal": kv["hit_rate_vs_ideal"],
            "errors": kv["errors"] + rnd["errors"]}
    return out


def markdown(result: dict[str, Any]) -> str:
    a = result["args"]
    s = result.get("summary", {})
    lines = [
        f"# KV routing vs random over {a['workers'] * a['engines']} mocker engines",
        "",
        f"`python benchmarks/mocker_routing.py --workers {a['workers']} --engines "
        f"{a['engines']}` (graphs.mocker_router, configs/mocker_router.yaml: cpu-tiny profile "
        "at real speed; Router overlap-weights " + a["overlap_weights"] + " set live in "
        "turn, 1.0 is the config's). Graph ready in "
        f"{result['ready_s']:.2f} s. Shared 2-core machine (load average "
        f"{result['machine']['loadavg_1m']:.1f} at the end): provisional.",
        "",
        f"Workload per mode: {a['groups']} groups x {a['per_group']} requests, "
        f"{a['prefix']}-token shared prefix, {a['suffix']}-token suffix, {a['output']} output "
        f"tokens, concurrency {a['concurrency']}; every group's first request, then the "
        "repeats shuffled. Fresh prefixes per run; mode switched live through etcd. "
        "`graph cores`: CPU the served graph's processes used during the repeats (2 = the "
        "machine).",
        "",
        "| overlap-weight | concurrency | mode | repeat TTFT mean ms | p50 | p90 | "
        "first TTFT mean ms | hit rate | ideal | vs ideal | engines used | graph cores | "
        "load avg before | errors | wall s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
        "| --- |",
    ]
    for r in result["runs"]:
        t = r["repeat_ttft_ms"]
        lines.append(
            f"| {r['overlap_weight']:g} | {r['concurrency']} | {r['mode']} | {t['mean']:.1f} | "
            f"{t['p50']:.1f} | "
            f"{t['p90']:.1f} | {r['first_ttft_ms']['mean']:.1f} | {r['hit_rate']:.3f} | "
            f"{r['ideal_hit_rate']:.3f} | {r['hit_rate_vs_ideal']:.3f} | {r['engines_used']} | "
            f"{r['repeat_graph_cores']:.2f} | {r['loadavg_before']:.1f} | {r['errors']} | "
            f"{r['wall_s']:.1f} |")
    lines += ["", "CPU ms per repeat request, per component (all its processes), during the "
              "repeats:", ""]
    for r in result["runs"]:
        cpu = r.get("repeat_cpu_ms_per_request", {})
        lines.append(f"- w{r['overlap_weight']:g} c{r['concurrency']} {r['mode']}: "
                     + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items())
                     + f" (total {sum(cpu.values()):.2f}); the benchmark's client "
                     + f"{r.get('repeat_client_cpu_ms_per_request', float('nan')):.2f}")
    for key, v in s.items():
        w, c = key.split("/")
        lines += ["", f"Overlap-weight {w[1:]}, concurrency {c[1:]}: kv mean repeat TTFT / random = "
                  f"**{v['repeat_ttft_mean_ratio']:.3f}** (target <= {TARGET_TTFT_RATIO}); kv hit "
                  f"rate / ideal = **{v['kv_hit_vs_ideal']:.3f}** (target >= {TARGET_HIT_RATIO}); "
                  f"errors **{v['errors']}** (target 0)."]
    lines += ["", f"Machine: {json.dumps(result['machine'])}", ""]
    return "\n".join(lines)


async def bench(url: str, etcd_url: str, args: argparse.Namespace, pid: int) -> dict[str, Any]:
    disc = EtcdDiscovery(etcd_url)
    await disc.start()
    try:
        recs = await instance_records(disc, "MockerWorker")
        assert len(recs) == args.workers * args.engines, len(recs)
        warm, _ = workload(argparse.Namespace(**{**vars(args), "groups": 2, "per_group": 1}),
                           seed=999)
        await run_load(f"{url}/v1/completions", _bodies(warm, 2), 2)
        runs = []
        levels = [int(c) for c in str(args.concurrency).split(",")]
        weights = [float(w) for w in str(args.overlap_weights).split(",")]
        plan = [(w, c, m) for w in weights for c in levels for m in args.modes.split(",")]
        for i, (weight, conc, mode) in enumerate(plan):
            await disc.put("/dynamo/settings/Router/overlap-weight", weight)
            log.info("overlap-weight %g, concurrency %d, mode %s ...", weight, conc, mode)
            r = await run_mode(url, disc, args, mode, conc, seed=args.seed + 100 * (i + 1),
                               pid=pid)
            r["overlap_weight"] = weight
            runs.append(r)
            log.info("repeat TTFT mean %.1f ms, hit rate %.3f (ideal %.3f), graph cores %.2f, "
                     "errors %d", r["repeat_ttft_ms"]["mean"], r["hit_rate"],
                     r["ideal_hit_rate"], r["repeat_graph_cores"], r["errors"])
        await disc.delete("/dynamo/settings/Router/mode")
        await disc.delete("/dynamo/settings/Router/overlap-weight")
    finally:
        await disc.close()
    return {"args": vars(args), "runs": runs, "summary": summary(runs)}


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    exit_on_sigterm()
    args = _args()
    model_dir = ensure_model(REPO / "models" / "tiny-llama")
    overrides = [f"--Common.model={model_dir}",
                 f"--MockerWorker.ServiceArgs.workers={args.workers}",
                 f"--MockerWorker.engines-per-process={args.engines}", *args.serve_arg]
    with serve_graph("graphs.mocker_router:Frontend", "configs/mocker_router.yaml",
                     overrides) as g:
        result = asyncio.run(bench(g.url, g.etcd.url, args, g.server.pid))
        result["ready_s"] = g.ready_s
    publish(args.name, result, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
