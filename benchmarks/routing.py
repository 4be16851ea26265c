"""KV-aware routing vs round robin on a shared-prefix workload, two real vLLM workers.

    python benchmarks/routing.py [--groups 8] [--per-group 16] [--prefix 1024]
        [--suffix 64] [--output 8] [--concurrency 8] [--modes round-robin,kv]
        [--worker-blocks N]

Serves ``graphs.agg_router`` (``configs/agg_router.yaml``: two VllmWorkers with KV
events, Router, Processor in ``router-mode: kv``) once, with its own etcd, and runs
the same workload shape once per mode; the mode is switched live through etcd
(``/dynamo/settings/Router/mode``), which the Router obeys. Each mode gets fresh
random prefixes (seeded), so nothing it finds cached comes from an earlier mode.

Workload: ``--groups`` groups of ``--per-group`` requests; a group's requests share a
``--prefix``-token prefix and each has its own ``--suffix``-token suffix; all
requests in shuffled order (seeded) with ``--concurrency`` in flight, streamed
``/v1/completions`` of ``--output`` tokens (ignore_eos).

Measured per mode: prefix-cache hit rate (prompt tokens vLLM found cached / prompt
tokens looked up, summed over both workers, from their ``/metrics``), against the
ideal rate (every request after its group's first hits the whole prefix, in full
blocks; it ignores that a group's requests arriving while its first prefill still runs
compute the prefix again even on the same worker, so under concurrency no mode
reaches it); TTFT p50/p90; errors; each worker's share of the decisions.
``--overlap-weight`` sets the Router's weight live. ``--worker-blocks`` caps each worker's KV cache (vLLM's num_gpu_blocks_override) to
study cache pressure. Targets (issue 5): kv hit rate >= 0.9x ideal, kv TTFT p50 <=
0.5x round robin's, 0 errors. Writes benchmarks/results/routing.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (  # noqa: E402
    REPO,
    ManagedProcess,
    machine_info,
    run_load,
    write_results,
)
from dynagraph.runtime.discovery import EtcdDiscovery  # noqa: E402
from dynagraph.runtime.infra import free_port, local_infra  # noqa: E402
from tools.model_builder import ensure_model  # noqa: E402

log = logging.getLogger("bench.routing")

MODEL = "tiny-llama"
BLOCK = 32
TARGET_HIT_RATIO = 0.9
TARGET_TTFT_RATIO = 0.5


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=16)
    p.add_argument("--prefix", type=int, default=1024)
    p.add_argument("--suffix", type=int, default=64)
    p.add_argument("--output", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--modes", default="round-robin,kv")
    p.add_argument("--worker-blocks", type=int, default=None)
    p.add_argument("--overlap-weight", type=float, default=None,
                   help="set the Router's overlap-weight live (etcd) for the run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="routing")
    return p.parse_args()


def workload(args: argparse.Namespace, seed: int) -> tuple[list[list[int]], list[int]]:
    """Prompts (shuffled) and each prompt's group."""
    rng = random.Random(seed)
    items: list[tuple[list[int], int]] = []
    for g in range(args.groups):
        prefix = [rng.randrange(10, 900) for _ in range(args.prefix)]
        for _ in range(args.per_group):
            items.append((prefix + [rng.randrange(10, 900) for _ in range(args.suffix)], g))
    rng.shuffle(items)
    return [p for p, _ in items], [g for _, g in items]


def ideal_hit_rate(args: argparse.Namespace) -> float:
    hits = args.groups * (args.per_group - 1) * (args.prefix // BLOCK) * BLOCK
    queries = args.groups * args.per_group * (args.prefix + args.suffix)
    return hits / queries


async def _get(url: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.get(
            url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
        return await resp.text()


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


async def worker_counters(disc: EtcdDiscovery) -> dict[int, dict[str, float]]:
    """Per worker: prefix-cache queries and hits (tokens), from its /metrics."""
    out: dict[int, dict[str, float]] = {}
    for key, rec in (await disc.get_prefix("/dynamo/instances/VllmWorker/")).items():
        text = await _get(f"http://{rec['metrics']}/metrics")
        out[int(key.rsplit("/", 1)[1], 16)] = {
            "queries": _metric(text, "dynamo_worker_prefix_cache_queries_total"),
            "hits": _metric(text, "dynamo_worker_prefix_cache_hits_total"),
        }
    return out


async def router_decisions(disc: EtcdDiscovery) -> dict[str, float]:
    recs = await disc.get_prefix("/dynamo/instances/Router/")
    rec = next(iter(recs.values()))
    text = await _get(f"http://{rec['metrics']}/metrics")
    out: dict[str, float] = {}
    for m in re.finditer(r'^dynamo_router_decisions_total\{mode="([^"]+)",worker="([^"]+)"\} (\S+)$',
                         text, re.M):
        out[f"{m.group(1)}:{m.group(2)}"] = float(m.group(3))
    return out


async def set_mode(disc: EtcdDiscovery, mode: str) -> None:
    await disc.put("/dynamo/settings/Router/mode", mode)
    await asyncio.sleep(0.5)  # the Router's watch applies it within milliseconds


async def settle(disc: EtcdDiscovery, within: float = 10.0) -> dict[int, dict[str, float]]:
    """Counters once two reads 0.3 s apart agree (the engines' last stats arrived)."""
    deadline = time.monotonic() + within
    prev = await worker_counters(disc)
    while time.monotonic() < deadline:
        await asyncio.sleep(0.3)
        cur = await worker_counters(disc)
        if cur == prev:
            return cur
        prev = cur
    return prev


async def run_mode(url: str, disc: EtcdDiscovery, args: argparse.Namespace, mode: str,
                   seed: int) -> dict[str, Any]:
    prompts, groups = workload(args, seed)
    await set_mode(disc, mode)
    before = await settle(disc)
    bodies = [{"model": MODEL, "prompt": p, "max_tokens": args.output, "temperature": 0,
               "ignore_eos": True, "stream": True} for p in prompts]
    stats = await run_load(f"{url}/v1/completions", bodies, args.concurrency)
    after = await settle(disc)
    q = sum(after[w]["queries"] - before.get(w, {}).get("queries", 0) for w in after)
    h = sum(after[w]["hits"] - before.get(w, {}).get("hits", 0) for w in after)
    per_worker = {f"{w:x}": {k: after[w][k] - before.get(w, {}).get(k, 0) for k in after[w]}
                  for w in after}
    ideal = ideal_hit_rate(args)
    rate = h / q if q else 0.0
    return {
        "mode": mode,
        "hit_rate": rate,
        "ideal_hit_rate": ideal,
        "hit_rate_vs_ideal": rate / ideal if ideal else 0.0,
        "prompt_tokens": q,
        "cached_tokens": h,
        "per_worker": per_worker,
        "ttft_ms": stats["ttft_ms"],
        "errors": stats["errors"],
        "first_error": stats["first_error"],
        "wall_s": stats["wall_s"],
        "requests": stats["requests"],
    }


def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """kv against round robin; medians over repeated runs of a mode."""
    def med(mode: str, get: Any) -> float | None:
        vals = [get(r) for r in runs if r["mode"] == mode]
        return statistics.median(vals) if vals else None

    kv_hit = med("kv", lambda r: r["hit_rate_vs_ideal"])
    kv_ttft = med("kv", lambda r: r["ttft_ms"]["p50"])
    rr_ttft = med("round-robin", lambda r: r["ttft_ms"]["p50"])
    if kv_hit is None or kv_ttft is None or not rr_ttft:
        return {}
    return {"kv_hit_vs_ideal": kv_hit, "ttft_p50_ratio": kv_ttft / rr_ttft,
            "errors": sum(r["errors"] for r in runs)}


def markdown(result: dict[str, Any]) -> str:
    a = result["args"]
    lines = [
        "# KV-aware routing vs round robin (provisional: shared 2-core machine)",
        "",
        f"Workload: {a['groups']} groups x {a['per_group']} requests, {a['prefix']}-token "
        f"shared prefix, {a['suffix']}-token suffix, {a['output']} output tokens, "
        f"concurrency {a['concurrency']}, shuffled; two vLLM workers (tiny model, block 32"
        + (f", {a['worker_blocks']} KV blocks each" if a["worker_blocks"] else ", 1 GiB KV")
        + "). Mode switched live through etcd"
        + (f"; Router overlap-weight {a['overlap_weight']}." if a["overlap_weight"] is not None
           else "; Router overlap-weight 1.0 (default)."),
        "",
        "| mode | hit rate | ideal | vs ideal | TTFT p50 ms | TTFT p90 ms | errors | wall s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["runs"]:
        lines.append(
            f"| {r['mode']} | {r['hit_rate']:.3f} | {r['ideal_hit_rate']:.3f} | "
            f"{r['hit_rate_vs_ideal']:.3f} | {r['ttft_ms']['p50']:.0f} | "
            f"{r['ttft_ms']['p90']:.0f} | {r['errors']} | {r['wall_s']:.1f} |")
    s = result.get("summary", {})
    if s:
        lines += ["", f"Medians over runs: kv hit rate / ideal = {s['kv_hit_vs_ideal']:.3f} (target >= "
                  f"{TARGET_HIT_RATIO}); kv TTFT p50 / round-robin = {s['ttft_p50_ratio']:.3f} "
                  f"(target <= {TARGET_TTFT_RATIO}); errors {s['errors']} (target 0)."]
    lines += ["", f"Machine: {json.dumps(result['machine'])}", ""]
    return "\n".join(lines)


async def bench(url: str, etcd_url: str, args: argparse.Namespace) -> dict[str, Any]:
    disc = EtcdDiscovery(etcd_url)
    await disc.start()
    try:
        deadline = time.monotonic() + 60
        while len(await worker_counters(disc)) < 2:
            if time.monotonic() > deadline:
                raise TimeoutError("two VllmWorkers did not register")
            await asyncio.sleep(0.2)
        warm, _ = workload(argparse.Namespace(**{**vars(args), "groups": 2, "per_group": 2}),
                           seed=999)
        await run_load(f"{url}/v1/completions",
                       [{"model": MODEL, "prompt": p, "max_tokens": 2, "stream": True}
                        for p in warm], 2)
        if args.overlap_weight is not None:
            await disc.put("/dynamo/settings/Router/overlap-weight", args.overlap_weight)
        runs = []
        for i, mode in enumerate(args.modes.split(",")):
            log.info("mode %s ...", mode)
            runs.append(await run_mode(url, disc, args, mode, seed=args.seed + 100 * (i + 1)))
            log.info("mode %s: hit rate %.3f (ideal %.3f), TTFT p50 %.0f ms, errors %d", mode,
                     runs[-1]["hit_rate"], runs[-1]["ideal_hit_rate"],
                     runs[-1]["ttft_ms"]["p50"], runs[-1]["errors"])
        decisions = await router_decisions(disc)
        await disc.delete("/dynamo/settings/Router/mode")
        await disc.delete("/dynamo/settings/Router/overlap-weight")
    finally:
        await disc.close()
    result: dict[str, Any] = {"args": vars(args), "runs": runs, "router_decisions": decisions}
    result["summary"] = summary(runs)
    return result


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = _args()
    model_dir = ensure_model(REPO / "models" / "tiny-llama")
    port = free_port()
    with local_infra(etcd=True, nats=True) as infra:
        env = {**os.environ, "ETCD_ENDPOINTS": infra["etcd"].url,
               "NATS_SERVER": infra["nats"].url, "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "dynagraph.cli.main", "serve", "graphs.agg_router:Frontend",
               "-f", "configs/agg_router.yaml", f"--Frontend.port={port}",
               f"--Common.model={model_dir}", "--Common.max-model-len=2048",
               "--VllmWorker.max-num-seqs=16"]
        if args.worker_blocks:
            cmd.append("--VllmWorker.extra-engine-args={num_gpu_blocks_override: "
                       f"{args.worker_blocks}}}")
        server = ManagedProcess(cmd, env, name="agg_router")
        try:
            server.wait_line(lambda s: "dynamo serve: graph " in s, 300)
            result = asyncio.run(bench(f"http://127.0.0.1:{port}", infra["etcd"].url, args))
        finally:
            server.stop()
    result["machine"] = machine_info()
    jpath, mpath = write_results(args.name, result, markdown(result))
    print(markdown(result))
    print(f"wrote {jpath} and {mpath}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
