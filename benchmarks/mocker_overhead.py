"""Benchmark: what the mocker engine itself costs, many engines in one event loop.

Scenarios, each with ``--engines`` engines (default 64) sharing this process's loop:

* **saturated, batch B** (1, 8, 32): every engine keeps B requests in flight (prompts of
  ``--prompt`` tokens whose first block is new each time, so no prefix hits; ``--output``
  tokens each; a finished request replaced at once) at speed 1e6, so the simulated waits are ~0 and the loop is CPU-bound.
  *Process CPU per step* = this process's CPU time / steps: everything (scheduler,
  block hashing, output delivery, asyncio, the consuming client loops).
  *Engine Python per step* = the engines' own ``stats.python_seconds`` / steps: the
  scheduler step and output delivery alone, on the wall clock (so it includes time
  the OS gave the core to other jobs on a shared machine).
* **idle**: the engines started and idle for ``--seconds``: CPU used.
* **real time, cpu-tiny**: the engines at speed 1 on the shipped profile, each with B
  requests in flight: the share of one core the process needs to keep up, and how
  late steps end against their simulated durations.

CPU times are ``time.process_time()`` (this process only: other jobs on a shared
machine do not count). On a shared machine the real-time scenario also needs the CPU
when its timers fire: ``--boost`` (root, ``tools.cpu_priority``) runs the benchmark ahead
of the other jobs. Run: ``python benchmarks/mocker_overhead.py [--engines 64] [--boost]``.
Writes benchmarks/results/mocker_overhead.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import random
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dynagraph.llm.engines.base import SamplingSpec  # noqa: E402
from dynagraph.llm.engines.mocker import MockerEngine, MockerEngineArgs  # noqa: E402
from tools.cpu_priority import boost  # noqa: E402

log = logging.getLogger("bench.mocker_overhead")
RESULTS = Path(__file__).parent / "results"


def make_engines(n: int, speed: float, blocks: int) -> list[MockerEngine]:
    return [MockerEngine(MockerEngineArgs(speed=speed, num_gpu_blocks=blocks, engine_id=f"e{i}"))
            for i in range(n)]


async def client(engine: MockerEngine, idx: int, stop: asyncio.Event, prompt_len: int,
                 out_len: int, counts: list[int]) -> None:
    rng = random.Random(idx)
    base = [rng.randrange(5, 2048) for _ in range(prompt_len)]
    spec = SamplingSpec(max_tokens=out_len)
    n = 0
    while not stop.is_set():
        n += 1
        prompt = [idx % 2048, n % 2048, *base[2:]]  # unique first block: no prefix hits
        async for out in engine.generate(f"{idx}-{n}", prompt, spec):
            counts[0] += len(out.token_ids)


async def run_load(engines: list[MockerEngine], batch: int, seconds: float, prompt_len: int,
                   out_len: int) -> dict[str, Any]:
    for e in engines:
        await e.start()
    stop = asyncio.Event()
    counts = [0]
    tasks = [asyncio.create_task(client(e, i * 1000 + j, stop, prompt_len, out_len, counts))
             for i, e in enumerate(engines) for j in range(batch)]
    await asyncio.sleep(min(1.0, seconds / 3))  # past the first prefills
    steps0 = sum(e.stats.steps for e in engines)
    py0 = sum(e.stats.python_seconds for e in engines)
    busy0 = sum(e.stats.busy_seconds for e in engines)
    tok0, cpu0, wall0 = counts[0], time.process_time(), time.perf_counter()
    await asyncio.sleep(seconds)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    steps = sum(e.stats.steps for e in engines) - steps0
    py = sum(e.stats.python_seconds for e in engines) - py0
    busy = sum(e.stats.busy_seconds for e in engines) - busy0
    tokens = counts[0] - tok0
    stop.set()
    for e in engines:
        await e.shutdown()
    await asyncio.gather(*tasks, return_exceptions=True)
    return {
        "batch": batch, "steps": steps, "tokens": tokens, "wall_s": round(wall, 3),
        "cpu_s": round(cpu, 3), "cores_used": round(cpu / wall, 3),
        "steps_per_s": round(steps / wall, 1), "tokens_per_s": round(tokens / wall, 1),
        "process_cpu_us_per_step": round(cpu / steps * 1e6, 1) if steps else None,
        "process_cpu_us_per_token": round(cpu / tokens * 1e6, 2) if tokens else None,
        "engine_python_us_per_step": round(py / steps * 1e6, 1) if steps else None,
        "simulated_busy_fraction": round(busy / (wall * len(engines)), 3),
    }


async def idle(engines: list[MockerEngine], seconds: float) -> dict[str, Any]:
    for e in engines:
        await e.start()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.sleep(seconds)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    for e in engines:
        await e.shutdown()
    return {"wall_s": round(wall, 3), "cpu_s": round(cpu, 4), "cores_used": round(cpu / wall, 4)}


def markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        "# Mocker engine overhead", "",
        f"{m['at']}, {m['cpus']} cores, CPython {m['python']}, 1-min load average "
        f"{m['loadavg_1m']:.2f} (a shared machine: CPU times are this process's only; "
        f"priority boost: {result['priority_boost']}). "
        f"Command: `{result['command']}`.", "",
        f"{result['engines']} engines in one process and one event loop; prompts of "
        f"{result['prompt']} tokens, {result['output']} output tokens each; "
        f"{result['blocks']} KV blocks per engine; RSS after creating them: "
        f"{result['rss_mib_engines']:.0f} MiB.", "",
        "## Saturated (speed 1e6: the loop is CPU-bound)", "",
        "| batch per engine | steps/s | tokens/s | process CPU us/step | us/token "
        "| engine Python us/step (wall) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["saturated"]:
        lines.append(f"| {r['batch']} | {r['steps_per_s']:,} | {r['tokens_per_s']:,} | "
                     f"{r['process_cpu_us_per_step']} | {r['process_cpu_us_per_token']} | "
                     f"{r['engine_python_us_per_step']} |")
    i = result["idle"]
    lines += ["", f"## Idle: {i['cores_used']} cores ({i['cpu_s']} CPU s in {i['wall_s']} s)",
              "", "## Real time on cpu-tiny (speed 1)", "",
              "Simulated busy fraction: the profile's step time summed over the engines, over "
              "wall time x engines (1.0: every engine always stepping on schedule; a little "
              "less is the client's turn-around between requests).", "",
              "| batch per engine | cores used | steps/s | tokens/s "
              "| simulated busy fraction per engine |",
              "| --- | --- | --- | --- | --- |"]
    for r in result["realtime"]:
        lines.append(f"| {r['batch']} | {r['cores_used']} | {r['steps_per_s']:,} | "
                     f"{r['tokens_per_s']:,} | {r['simulated_busy_fraction']} |")
    return "\n".join(lines) + "\n"


async def main_async(ns: argparse.Namespace) -> dict[str, Any]:
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    engines = make_engines(ns.engines, 1e6, ns.blocks)
    rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    del engines
    saturated = []
    for batch in (1, 8, 32):
        r = await run_load(make_engines(ns.engines, 1e6, ns.blocks), batch, ns.seconds,
                           ns.prompt, ns.output)
        log.info("saturated %s", r)
        saturated.append(r)
    idle_r = await idle(make_engines(ns.engines, 1.0, ns.blocks), ns.seconds)
    log.info("idle %s", idle_r)
    realtime = []
    for batch in (1, 4):
        r = await run_load(make_engines(ns.engines, 1.0, ns.blocks), batch, ns.seconds,
                           ns.prompt, ns.output)
        log.info("realtime %s", r)
        realtime.append(r)
    return {
        "command": "python benchmarks/mocker_overhead.py " + " ".join(sys.argv[1:]),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "loadavg_1m": os.getloadavg()[0],
                    "at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
        "engines": ns.engines, "prompt": ns.prompt, "output": ns.output, "blocks": ns.blocks,
        "rss_mib_engines": rss, "saturated": saturated, "idle": idle_r, "realtime": realtime,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=16384,
                    help="KV blocks per engine (16384: cpu-tiny's default 1 GiB)")
    ap.add_argument("--boost", action="store_true", help="run ahead of other jobs (root)")
    ap.add_argument("--render", action="store_true", help="only rewrite the .md from the .json")
    ap.add_argument("--out", type=Path, default=RESULTS / "mocker_overhead")
    ns = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    boosted = boost() if ns.boost and not ns.render else "no"
    if ns.render:
        result = json.loads(ns.out.with_suffix(".json").read_text())
    else:
        result = asyncio.run(main_async(ns))
        result["priority_boost"] = boosted
    ns.out.parent.mkdir(parents=True, exist_ok=True)
    ns.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    ns.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
