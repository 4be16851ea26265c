"""KV-aware routing against round robin on the shipped agg_router graph (two vLLM workers).

    python benchmarks/routing.py [--workloads repeat,unique] [--rounds 3]
        [--modes round-robin,kv] [--concurrency 4] [--output 16] [--name routing]

Serves ``graphs.agg_router`` with ``configs/agg_router.yaml`` as shipped (only the
Frontend's port and the model's absolute path are set on the command line), once, with
its own etcd, and measures every mode on every workload in each of ``--rounds`` rounds,
modes interleaved (their order rotates from round to round), each on fresh random
prompts (seeded) so that nothing a mode finds cached comes from another. The mode is
switched live through etcd (``/dynamo/settings/Router/mode``); ``kv-blocks`` means
``kv`` with ``cost-model: blocks`` (Dynamo's block count, the Router's old default),
also set live.

Workloads (streamed ``/v1/completions`` of ``--output`` tokens, ignore_eos, at most
``--concurrency`` in flight, sent in the listed order):

``repeat`` (issue 19)
    ``--prefixes`` prompts of ``--min-tokens``..``--max-tokens`` random tokens, each
    sent once, then all again in shuffled order. Measured: mean TTFT of the repeats.
    Target: kv <= 0.5x round robin in every round, 0 errors.
``unique``
    ``--unique`` prompts of the same lengths that share nothing. Measured: TTFT p50 and
    p99. Target: kv within 1.1x of round robin.
``groups`` (issue 5)
    ``--groups`` groups of ``--per-group`` prompts sharing a ``--prefix``-token prefix,
    each with its own ``--suffix``, shuffled. Measured: prefix-cache hit rate against the
    ideal (every request after its group's first hits the whole prefix) and TTFT p50.

For each run: the workers' prefix-cache hit rate (from their ``/metrics``), the Router's
decisions per worker, the 1-minute load average before and after. Writes
``benchmarks/results/<name>.json`` and ``.md``.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (  # noqa: E402
    REPO,
    ManagedProcess,
    StreamResult,
    infra_env,
    percentile,
    publish,
    serve_command,
    stream_request,
)
from dynagraph.runtime.discovery import EtcdDiscovery  # noqa: E402
from dynagraph.runtime.infra import free_port, local_infra  # noqa: E402
from tools.model_builder import ensure_model  # noqa: E402

log = logging.getLogger("bench.routing")

MODEL = "tiny-llama"
BLOCK = 32
TARGET_REPEAT_RATIO = 0.5
TARGET_UNIQUE_RATIO = 1.1
TARGET_HIT_RATIO = 0.9


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload options this benchmark and ``routing_sim.py`` share."""
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--output", type=int, default=16)
    p.add_argument("--prefixes", type=int, default=16)
    p.add_argument("--unique", type=int, default=48)
    p.add_argument("--min-tokens", type=int, default=2600)
    p.add_argument("--max-tokens", type=int, default=3100)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=16)
    p.add_argument("--prefix", type=int, default=1024)
    p.add_argument("--suffix", type=int, default=64)


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default="repeat,unique")
    p.add_argument("--modes", default="round-robin,kv",
                   help="round-robin, random, kv, kv-load, kv-blocks (kv, blocks cost)")
    add_workload_args(p)
    p.add_argument("--overlap-weight", type=float, default=None,
                   help="set the Router's overlap-weight live (etcd) for the run")
    p.add_argument("--worker-blocks", type=int, default=None,
                   help="cap each worker's KV cache (vLLM's num_gpu_blocks_override)")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="extra argument for dynamo serve (repeatable), e.g. "
                        "'--Router.ServiceArgs.env={DYN_LOG_LEVEL: DEBUG}'")
    p.add_argument("--server-log", default=None, help="write the graph's output to this file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--name", default="routing")
    return p.parse_args()


# -- workloads (pure) ----------------------------------------------------------------------

def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 900) for _ in range(n)]


def repeat_workload(a: argparse.Namespace, seed: int) -> tuple[list[list[int]], list[str]]:
    """Each prompt once, then all again shuffled; labels 'first' / 'repeat'."""
    rng = random.Random(seed)
    prompts = [_tokens(rng, rng.randint(a.min_tokens, a.max_tokens)) for _ in range(a.prefixes)]
    again = list(prompts)
    rng.shuffle(again)
    return prompts + again, ["first"] * len(prompts) + ["repeat"] * len(again)


def unique_workload(a: argparse.Namespace, seed: int) -> tuple[list[list[int]], list[str]]:
    rng = random.Random(seed)
    prompts = [_tokens(rng, rng.randint(a.min_tokens, a.max_tokens)) for _ in range(a.unique)]
    return prompts, ["unique"] * len(prompts)


def groups_workload(a: argparse.Namespace, seed: int) -> tuple[list[list[int]], list[str]]:
    rng = random.Random(seed)
    items: list[tuple[list[int], str]] = []
    for g in range(a.groups):
        prefix = _tokens(rng, a.prefix)
        items += [(prefix + _tokens(rng, a.suffix), f"group{g}") for _ in range(a.per_group)]
    rng.shuffle(items)
    return [p for p, _ in items], [g for _, g in items]


WORKLOADS: dict[str, Callable[[argparse.Namespace, int], tuple[list[list[int]], list[str]]]] = {
    "repeat": repeat_workload, "unique": unique_workload, "groups": groups_workload,
}


def ideal_hit_rate(prompts: list[list[int]], labels: list[str]) -> float:
    """Prompt tokens a perfect router finds cached over all prompt tokens: a repeat finds
    its whole prompt but the last token (vLLM always computes it), a group's request after
    the group's first finds the shared prefix; in full blocks."""
    hits = 0
    first_of: dict[str, list[int]] = {}
    for p, label in zip(prompts, labels, strict=True):
        if label == "repeat":
            hits += (len(p) - 1) // BLOCK * BLOCK
        elif label.startswith("group"):
            if label in first_of:
                f = first_of[label]
                common = next((i for i, (x, y) in enumerate(zip(f, p, strict=False))
                               if x != y), len(p))
                hits += common // BLOCK * BLOCK
            else:
                first_of[label] = p
    total = sum(len(p) for p in prompts)
    return hits / total if total else 0.0


# -- measuring -----------------------------------------------------------------------------

async def _get(url: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.get(
            url, timeout=aiohttp.ClientTimeout(total=5)) as resp:
        return await resp.text()


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


async def worker_counters(disc: EtcdDiscovery) -> dict[int, dict[str, float]]:
    """Per worker: prefix-cache queries and hits (tokens), and the tokens its host KV pool
    supplied (``pool_hits``; of them from the shared tier: ``tier_hits``), from its
    /metrics."""
    out: dict[int, dict[str, float]] = {}
    for key, rec in (await disc.get_prefix("/dynamo/instances/VllmWorker/")).items():
        text = await _get(f"http://{rec['metrics']}/metrics")
        out[int(key.rsplit("/", 1)[1], 16)] = {
            "queries": _metric(text, "dynamo_worker_prefix_cache_queries_total"),
            "hits": _metric(text, "dynamo_worker_prefix_cache_hits_total"),
            "pool_hits": _metric(text, "dynamo_worker_kv_pool_hit_tokens_total"),
            "tier_hits": _metric(text, "dynamo_worker_kv_tier_hit_tokens_total"),
        }
    return out


async def router_metrics(disc: EtcdDiscovery) -> dict[str, float]:
    """Decisions per mode:worker and the learned prefill speed per worker."""
    recs = await disc.get_prefix("/dynamo/instances/Router/")
    rec = next(iter(recs.values()))
    text = await _get(f"http://{rec['metrics']}/metrics")
    out: dict[str, float] = {}
    for m in re.finditer(r'^dynamo_router_decisions_total\{mode="([^"]+)",worker="([^"]+)"\} '
                         r"(\S+)$", text, re.M):
        out[f"{m.group(1)}:{m.group(2)}"] = float(m.group(3))
    for m in re.finditer(r'^dynamo_router_worker_prefill_tokens_per_second\{worker="([^"]+)"\} '
                         r"(\S+)$", text, re.M):
        out[f"prefill_tokens_per_s:{m.group(1)}"] = float(m.group(2))
    return out


async def set_mode(disc: EtcdDiscovery, mode: str) -> None:
    if mode == "kv-blocks":
        await disc.put("/dynamo/settings/Router/cost-model", "blocks")
        mode = "kv"
    else:
        await disc.delete("/dynamo/settings/Router/cost-model")
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


async def send_all(url: str, bodies: list[dict[str, Any]], concurrency: int,
                   request_timeout: float = 120.0) -> tuple[list[StreamResult], float]:
    """Send in order with at most ``concurrency`` in flight; results in the same order."""
    import aiohttp

    sem = asyncio.Semaphore(concurrency)

    async def one(session: Any, body: dict[str, Any]) -> StreamResult:
        async with sem:
            return await stream_request(session, url, body, request_timeout)

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.perf_counter()
        results = await asyncio.wait_for(asyncio.gather(*(one(session, b) for b in bodies)), 900)
        return list(results), time.perf_counter() - t0


def ttft_summary(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "mean": statistics.fmean(values) if values else float("nan"),
            "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99), "max": max(values, default=float("nan"))}


async def run_one(url: str, disc: EtcdDiscovery, a: argparse.Namespace, workload: str,
                  mode: str, seed: int) -> dict[str, Any]:
    prompts, labels = WORKLOADS[workload](a, seed)
    await set_mode(disc, mode)
    before = await settle(disc)
    decisions_before = await router_metrics(disc)
    load_before = os.getloadavg()[0]
    bodies = [{"model": MODEL, "prompt": p, "max_tokens": a.output, "temperature": 0,
               "ignore_eos": True, "stream": True} for p in prompts]
    results, wall = await send_all(f"{url}/v1/completions", bodies, a.concurrency)
    load_after = os.getloadavg()[0]
    after = await settle(disc)
    decisions_after = await router_metrics(disc)
    q = sum(after[w]["queries"] - before.get(w, {}).get("queries", 0) for w in after)
    h = sum(after[w]["hits"] - before.get(w, {}).get("hits", 0) for w in after)
    pool, tier = (sum(after[w][k] - before.get(w, {}).get(k, 0) for w in after)
                  for k in ("pool_hits", "tier_hits"))
    by_label: dict[str, list[float]] = {}
    for r, label in zip(results, labels, strict=True):
        if r.error is None and r.chunk_times:
            kind = label if label in ("first", "repeat", "unique") else "group"
            by_label.setdefault(kind, []).append(r.chunk_times[0] * 1000.0)
    ideal = ideal_hit_rate(prompts, labels)
    errors = [r.error or "truncated" for r in results if r.error or not r.chunk_times]
    return {
        "workload": workload, "mode": mode, "seed": seed,
        "ttft_ms": {k: ttft_summary(v) for k, v in by_label.items()},
        "ttft_samples_ms": {k: [round(x, 2) for x in v] for k, v in by_label.items()},
        "hit_rate": h / q if q else 0.0, "ideal_hit_rate": ideal,
        "pool_hit_rate": pool / q if q else 0.0, "tier_hit_rate": tier / q if q else 0.0,
        "errors": len(errors), "first_error": errors[0] if errors else None,
        "wall_s": wall, "requests": len(results),
        "decisions": {k: decisions_after.get(k, 0) - decisions_before.get(k, 0)
                      for k in decisions_after if not k.startswith("prefill_tokens_per_s")},
        "learned_prefill_tokens_per_s": {k.split(":", 1)[1]: round(v)
                                         for k, v in decisions_after.items()
                                         if k.startswith("prefill_tokens_per_s")},
        "loadavg_1m": [round(load_before, 2), round(load_after, 2)],
    }


# -- summary (pure) ------------------------------------------------------------------------

def _pairs(runs: list[dict[str, Any]], workload: str, mode: str, base: str
           ) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(mode run, base run) per round."""
    out = []
    for rnd in sorted({r["round"] for r in runs}):
        got = {r["mode"]: r for r in runs if r["round"] == rnd and r["workload"] == workload}
        if mode in got and base in got:
            out.append((got[mode], got[base]))
    return out


def summary(runs: list[dict[str, Any]], modes: list[str]) -> dict[str, Any]:
    """Per KV mode against round robin: per-round ratios and pooled ratios."""
    out: dict[str, Any] = {}
    base = "round-robin"
    for mode in (m for m in modes if m != base):
        s: dict[str, Any] = {}
        rep = _pairs(runs, "repeat", mode, base)
        if rep:
            ratios = [m["ttft_ms"]["repeat"]["mean"] / b["ttft_ms"]["repeat"]["mean"]
                      for m, b in rep]
            s["repeat_mean_ttft_ratio_per_round"] = [round(x, 3) for x in ratios]
            s["repeat_target_met_every_round"] = all(x <= TARGET_REPEAT_RATIO for x in ratios)
        uni = _pairs(runs, "unique", mode, base)
        if uni:
            for q in ("p50", "p99", "mean"):
                s[f"unique_{q}_ratio_per_round"] = [
                    round(m["ttft_ms"]["unique"][q] / b["ttft_ms"]["unique"][q], 3)
                    for m, b in uni]
            pooled_m = [x for m, _ in uni for x in m["ttft_samples_ms"]["unique"]]
            pooled_b = [x for _, b in uni for x in b["ttft_samples_ms"]["unique"]]
            for pct in (50, 99):
                s[f"unique_p{pct}_ratio_pooled"] = round(
                    percentile(pooled_m, pct) / percentile(pooled_b, pct), 3)
            s["unique_target_met_pooled"] = all(
                s[f"unique_p{pct}_ratio_pooled"] <= TARGET_UNIQUE_RATIO for pct in (50, 99))
        grp = _pairs(runs, "groups", mode, base)
        if grp:
            s["groups_hit_vs_ideal"] = [round(m["hit_rate"] / m["ideal_hit_rate"], 3)
                                        for m, _ in grp]
            s["groups_p50_ratio_per_round"] = [
                round(m["ttft_ms"]["group"]["p50"] / b["ttft_ms"]["group"]["p50"], 3)
                for m, b in grp]
        s["errors"] = sum(r["errors"] for r in runs if r["mode"] in (mode, base))
        out[mode] = s
    return out


def markdown(result: dict[str, Any]) -> str:
    a = result["args"]
    lines = [
        "# KV-aware routing vs round robin (shared 2-core machine)",
        "",
        f"`{result['command']}`",
        "",
        "Shipped `configs/agg_router.yaml` (two vLLM workers, tiny model, block 32, 1 GiB KV"
        + (f", {a['worker_blocks']} KV blocks each" if a["worker_blocks"] else "")
        + f"); {a['rounds']} rounds, modes interleaved (order rotating), fresh prompts per run; "
        f"concurrency {a['concurrency']}, {a['output']} output tokens"
        + (f"; overlap-weight {a['overlap_weight']} (live)" if a["overlap_weight"] is not None
           else "") + ".",
        "Workloads: "
        + "; ".join({
            "repeat": f"repeat = {a['prefixes']} prompts of {a['min_tokens']}-{a['max_tokens']} "
                      "tokens, each once, then again shuffled",
            "unique": f"unique = {a['unique']} prompts of {a['min_tokens']}-{a['max_tokens']} "
                      "tokens sharing nothing",
            "groups": f"groups = {a['groups']} x {a['per_group']} prompts, {a['prefix']}-token "
                      f"shared prefix + {a['suffix']}, shuffled",
        }[w] for w in a["workloads"].split(",")) + ".",
        "",
        "| round | workload | mode | TTFT ms (mean / p50 / p99) | repeats mean ms | hit rate "
        "(ideal) | from host pool (of it tier) | decisions per worker | errors | load avg | "
        "wall s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["runs"]:
        main = next((k for k in ("unique", "group", "first") if k in r["ttft_ms"]), None)
        t = r["ttft_ms"].get(main) if main else None
        rep = r["ttft_ms"].get("repeat")
        per_worker = "/".join(str(int(v)) for v in r["decisions"].values() if v) or "-"
        lines.append(
            f"| {r['round']} | {r['workload']} | {r['mode']} | "
            + (f"{main}: {t['mean']:.0f} / {t['p50']:.0f} / {t['p99']:.0f}" if t else "-")
            + (f" | {rep['mean']:.0f}" if rep else " | -")
        )
        lines[-1] += (f" | {r['hit_rate']:.3f} ({r['ideal_hit_rate']:.3f}) | "
                      f"{r.get('pool_hit_rate', 0):.3f} ({r.get('tier_hit_rate', 0):.3f}) | "
                      f"{per_worker} | "
                      f"{r['errors']} | {r['loadavg_1m'][0]:.1f}-{r['loadavg_1m'][1]:.1f} | "
                      f"{r['wall_s']:.1f} |")
    lines += ["", "Against round robin:", ""]
    for mode, s in result["summary"].items():
        parts = []
        if "repeat_mean_ttft_ratio_per_round" in s:
            parts.append(f"repeat mean TTFT ratio per round {s['repeat_mean_ttft_ratio_per_round']}"
                         f" (target <= {TARGET_REPEAT_RATIO} each: "
                         f"{'met' if s['repeat_target_met_every_round'] else 'missed'})")
        if "unique_p50_ratio_pooled" in s:
            parts.append(f"unique TTFT p50 / p99 ratio pooled over rounds "
                         f"{s['unique_p50_ratio_pooled']} / {s['unique_p99_ratio_pooled']} "
                         f"(target <= {TARGET_UNIQUE_RATIO}: "
                         f"{'met' if s['unique_target_met_pooled'] else 'missed'}), per round "
                         f"p50 {s['unique_p50_ratio_per_round']}, p99 "
                         f"{s['unique_p99_ratio_per_round']}")
        if "groups_hit_vs_ideal" in s:
            parts.append(f"groups hit rate / ideal {s['groups_hit_vs_ideal']}, TTFT p50 ratio "
                         f"{s['groups_p50_ratio_per_round']}")
        parts.append(f"errors {s['errors']}")
        lines.append(f"- **{mode}**: " + "; ".join(parts) + ".")
    lines += ["", f"Machine: {json.dumps(result['machine'])}", ""]
    return "\n".join(lines)


# -- driver --------------------------------------------------------------------------------

async def bench(url: str, etcd_url: str, a: argparse.Namespace) -> dict[str, Any]:
    disc = EtcdDiscovery(etcd_url)
    await disc.start()
    modes = a.modes.split(",")
    runs: list[dict[str, Any]] = []
    try:
        deadline = time.monotonic() + 60
        while len(await worker_counters(disc)) < 2:
            if time.monotonic() > deadline:
                raise TimeoutError("two VllmWorkers did not register")
            await asyncio.sleep(0.2)
        rng = random.Random(999)
        warm = [{"model": MODEL, "prompt": _tokens(rng, 600), "max_tokens": 4, "stream": True}
                for _ in range(8)]
        await send_all(f"{url}/v1/completions", warm, 2)
        if a.overlap_weight is not None:
            await disc.put("/dynamo/settings/Router/overlap-weight", a.overlap_weight)
        for rnd in range(1, a.rounds + 1):
            order = modes[(rnd - 1) % len(modes):] + modes[:(rnd - 1) % len(modes)]
            for wi, workload in enumerate(a.workloads.split(",")):
                for mode in order:
                    seed = a.seed + 10000 * rnd + 100 * wi + modes.index(mode)
                    log.info("round %d %s %s ...", rnd, workload, mode)
                    run = await run_one(url, disc, a, workload, mode, seed)
                    run["round"] = rnd
                    runs.append(run)
                    log.info("round %d %s %s: TTFT %s, hit rate %.3f, errors %d, load %s", rnd,
                             workload, mode,
                             {k: round(v["mean"]) for k, v in run["ttft_ms"].items()},
                             run["hit_rate"], run["errors"], run["loadavg_1m"])
    finally:
        for key in ("mode", "cost-model", "overlap-weight"):
            await disc.delete(f"/dynamo/settings/Router/{key}")
        await disc.close()
    return {"args": vars(a), "runs": runs, "summary": summary(runs, modes)}


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    a = _args()
    model_dir = ensure_model(REPO / "models" / "tiny-llama")
    port = free_port()
    with local_infra(etcd=True, nats=True) as infra:
        env = infra_env(infra)
        cmd = serve_command("agg_router", "agg_router", port, model_dir, "--ready-timeout=420")
        if a.worker_blocks:
            cmd.append("--VllmWorker.extra-engine-args={num_gpu_blocks_override: "
                       f"{a.worker_blocks}}}")
        cmd += a.serve_arg
        server = ManagedProcess(cmd, env, name="agg_router")
        try:
            server.wait_line(lambda s: "dynamo serve: graph " in s, 450)
            result = asyncio.run(bench(f"http://127.0.0.1:{port}", infra["etcd"].url, a))
        finally:
            server.stop()
            if a.server_log:
                Path(a.server_log).write_text("\n".join(server.lines) + "\n")
    result["command"] = "python benchmarks/routing.py " + " ".join(sys.argv[1:])
    publish(a.name, result, markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
