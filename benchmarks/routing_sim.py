"""Routing modes on simulated engines: the Router's pieces and MockerEngines in one process.

    python benchmarks/routing_sim.py [--workers 2] [--profile cpu-tiny] [--speed 1]
        [--workloads repeat,unique] [--modes round-robin,kv,kv-blocks] [--rounds 3]
        [--concurrency 4] [--output 16] [--name routing_sim]

The same workloads as ``benchmarks/routing.py`` (its ``repeat``/``unique``/``groups``
options apply), sent to ``--workers`` ``MockerEngine``\\ s that each take their step
times from a timing profile and run on their own simulated timeline: unlike two vLLM
engines sharing two CPU cores, these workers are independent and equally fast, so this
isolates what the cost model decides. The Router is wired as the component wires it: a
``RouterState`` fed with each engine's KV events and a load sample every 0.1 s, each
request tracked from the decision to its last token. TTFT is measured in wall time
from the decision (so it includes the simulated queueing and prefill, nothing else).
Writes ``benchmarks/results/<name>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import percentile, publish  # noqa: E402
from benchmarks.routing import (  # noqa: E402
    WORKLOADS,
    add_workload_args,
    ideal_hit_rate,
    ttft_summary,
)
from dynagraph.llm.engines.base import SamplingSpec  # noqa: E402
from dynagraph.llm.engines.mocker import MockerEngine, MockerEngineArgs  # noqa: E402
from dynagraph.llm.router import BlockHasher, CostModel, RouterMode, RouterState  # noqa: E402
from dynagraph.llm.router.events import KvEvent, apply_events  # noqa: E402
from dynagraph.llm.router.hashing import seed_from_env  # noqa: E402

log = logging.getLogger("bench.routing_sim")


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--profile", default="cpu-tiny")
    p.add_argument("--speed", type=float, default=1.0)
    p.add_argument("--speeds", default=None,
                   help="per-worker speed factors, comma-separated (heterogeneous workers); "
                        "overrides --workers and --speed")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--workloads", default="repeat,unique")
    p.add_argument("--modes", default="round-robin,kv,kv-blocks")
    add_workload_args(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="routing_sim")
    return p.parse_args()


class SimRouter:
    """The Router component's wiring around ``RouterState``, without the request plane."""

    def __init__(self, engines: dict[int, MockerEngine], block_size: int) -> None:
        self.state = RouterState(random.Random(0))
        self.engines = engines
        self.hasher = BlockHasher(block_size, "sha256", seed_from_env(os.environ))
        self.keys = itertools.count()
        for w in engines:
            self.state.add_worker(w)

    def on_events(self, w: int, events: list[KvEvent]) -> None:
        apply_events(self.state.index, w, events)

    async def follow_loads(self) -> None:
        while True:
            now = time.monotonic()
            for w, e in self.engines.items():
                self.state.set_load(w, e.load(), now)
            await asyncio.sleep(0.1)

    async def request(self, mode: str, tokens: list[int], output: int) -> tuple[float, int]:
        """(TTFT seconds, overlap blocks) of one request routed in ``mode``."""
        t0 = now = time.monotonic()
        hashes = self.hasher.block_hashes(tokens)
        cost = CostModel.BLOCKS if mode == "kv-blocks" else CostModel.TIME
        route_mode = RouterMode.KV if mode == "kv-blocks" else RouterMode(mode)
        d = self.state.decide(route_mode, hashes, prompt_tokens=len(tokens),
                              block_size=self.hasher.block_size, now=now, cost_model=cost)
        w, key = d.worker_id, next(self.keys)
        uncached = max(len(tokens) - d.overlap_blocks * self.hasher.block_size, 1)
        self.state.begin(w, hashes, key=key, uncached_tokens=uncached, now=now)
        ttft = -1.0
        try:
            async for _ in self.engines[w].generate(
                    f"r{key}", tokens, SamplingSpec(max_tokens=output, ignore_eos=True)):
                if ttft < 0:
                    ttft = time.monotonic() - t0
        finally:
            self.state.end(w, hashes, key)
        return ttft, d.overlap_blocks


async def run_one(a: argparse.Namespace, workload: str, mode: str, seed: int
                  ) -> dict[str, Any]:
    speeds = ([float(x) for x in a.speeds.split(",")] if a.speeds
              else [a.speed] * a.workers)
    engines: dict[int, MockerEngine] = {}
    router: SimRouter | None = None

    def sink(w: int) -> Any:
        return lambda events: router.on_events(w, events) if router is not None else None

    for w, speed in enumerate(speeds, start=1):
        args = MockerEngineArgs(profile=a.profile, speed=speed, max_model_len=a.max_model_len,
                                max_num_seqs=16, max_num_batched_tokens=2048)
        engines[w] = MockerEngine(args, on_kv_events=sink(w))
    router = SimRouter(engines, engines[1].block_size)
    for e in engines.values():
        await e.start()
    feeder = asyncio.create_task(router.follow_loads())
    prompts, labels = WORKLOADS[workload](a, seed)
    sem = asyncio.Semaphore(a.concurrency)

    async def one(tokens: list[int]) -> tuple[float, int]:
        async with sem:
            assert router is not None
            return await router.request(mode, tokens, a.output)

    try:
        t0 = time.monotonic()
        results = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.monotonic() - t0
    finally:
        feeder.cancel()
        for e in engines.values():
            await e.shutdown()
    by_label: dict[str, list[float]] = {}
    for (ttft, _), label in zip(results, labels, strict=True):
        kind = label if label in ("first", "repeat", "unique") else "group"
        by_label.setdefault(kind, []).append(ttft * 1000.0)
    q = sum(e.load().prefix_cache_queries for e in engines.values())
    h = sum(e.load().prefix_cache_hits for e in engines.values())
    return {
        "workload": workload, "mode": mode, "seed": seed,
        "ttft_ms": {k: ttft_summary(v) for k, v in by_label.items()},
        "ttft_samples_ms": {k: [round(x, 2) for x in v] for k, v in by_label.items()},
        "hit_rate": h / q if q else 0.0, "ideal_hit_rate": ideal_hit_rate(prompts, labels),
        "busy_s_per_worker": [round(e.stats.busy_seconds, 2) for e in engines.values()],
        "wall_s": wall, "requests": len(results),
    }


def summary(runs: list[dict[str, Any]], modes: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in (m for m in modes if m != "round-robin"):
        s: dict[str, Any] = {}
        for workload, kind, q in (("repeat", "repeat", "mean"), ("unique", "unique", "p50"),
                                  ("unique", "unique", "p99"), ("groups", "group", "p50")):
            ratios = []
            for rnd in sorted({r["round"] for r in runs}):
                got = {r["mode"]: r for r in runs
                       if r["round"] == rnd and r["workload"] == workload}
                if mode in got and "round-robin" in got:
                    ratios.append(round(got[mode]["ttft_ms"][kind][q]
                                        / got["round-robin"]["ttft_ms"][kind][q], 3))
            if ratios:
                s[f"{workload}_{q}_ratio_per_round"] = ratios
        uni = [(r, b) for r in runs for b in runs if r["workload"] == b["workload"] == "unique"
               and r["mode"] == mode and b["mode"] == "round-robin" and r["round"] == b["round"]]
        if uni:
            pm = [x for r, _ in uni for x in r["ttft_samples_ms"]["unique"]]
            pb = [x for _, b in uni for x in b["ttft_samples_ms"]["unique"]]
            s["unique_p50_p99_ratio_pooled"] = [round(percentile(pm, q) / percentile(pb, q), 3)
                                                for q in (50, 99)]
        out[mode] = s
    return out


def markdown(result: dict[str, Any]) -> str:
    a = result["args"]
    lines = [
        "# Routing modes on simulated engines (MockerEngine, in one process)", "",
        f"`{result['command']}`", "",
        f"{len(a['speeds'].split(',')) if a['speeds'] else a['workers']} workers, profile "
        f"`{a['profile']}` at speed {a['speeds'] or a['speed']}, "
        f"concurrency {a['concurrency']}, {a['output']} output tokens, {a['rounds']} rounds "
        "(modes interleaved, fresh engines and prompts per run).", "",
        "| round | workload | mode | TTFT ms mean / p50 / p99 | repeats mean ms | hit rate "
        "(ideal) | busy s per worker |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["runs"]:
        main = next((k for k in ("unique", "group", "first") if k in r["ttft_ms"]), "")
        t = r["ttft_ms"][main]
        rep = r["ttft_ms"].get("repeat")
        lines.append(f"| {r['round']} | {r['workload']} | {r['mode']} | {main}: "
                     f"{t['mean']:.0f} / {t['p50']:.0f} / {t['p99']:.0f} | "
                     + (f"{rep['mean']:.0f}" if rep else "-")
                     + f" | {r['hit_rate']:.3f} ({r['ideal_hit_rate']:.3f}) | "
                     f"{r['busy_s_per_worker']} |")
    lines += ["", "Against round robin:", ""]
    for mode, s in result["summary"].items():
        lines.append(f"- **{mode}**: " + "; ".join(f"{k} {v}" for k, v in s.items()) + ".")
    lines += ["", f"Machine: {json.dumps(result['machine'])}", ""]
    return "\n".join(lines)


async def bench(a: argparse.Namespace) -> dict[str, Any]:
    modes = a.modes.split(",")
    runs = []
    for rnd in range(1, a.rounds + 1):
        order = modes[(rnd - 1) % len(modes):] + modes[:(rnd - 1) % len(modes)]
        for wi, workload in enumerate(a.workloads.split(",")):
            for mode in order:
                seed = a.seed + 10000 * rnd + 100 * wi
                run = await run_one(a, workload, mode, seed)
                run["round"] = rnd
                runs.append(run)
                log.info("round %d %s %s: TTFT %s", rnd, workload, mode,
                         {k: round(v["mean"]) for k, v in run["ttft_ms"].items()})
    return {"args": vars(a), "runs": runs, "summary": summary(runs, modes)}


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    a = _args()
    result = asyncio.run(bench(a))
    result["command"] = "python benchmarks/routing_sim.py " + " ".join(sys.argv[1:])
    publish(a.name, result, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
