"""Host KV pool (``kv-offload-gib``): second-round TTFT of prefixes the engine had to evict.

    python benchmarks/kv_offload.py [--prefixes 8] [--prefix-tokens 1500] [--blocks 160]
        [--settings off,1,1:int8,0.012,0.012:int8] [--rounds 2]

Serves ``graphs.agg`` (``configs/agg.yaml``: one real vLLM worker on the tiny model) as
users run it, with the engine's cache cut to ``--blocks`` blocks of 32 tokens
(``num-gpu-blocks-override``), once per setting: ``off`` (no pool), ``GIB`` (a pool of
that size, ``kv-offload-gib``) or ``GIB:CODEC`` (that pool storing blocks compressed,
``kv-compression``; a pool too small for every prefix shows what compression buys), each
optionally ``@NAME``: with a tier under the pool, ``kv-offload-dir`` = ``--tier-root``/NAME
(kept for the whole run, so a later setting with the same NAME is a fresh graph that finds
what an earlier one left there: ``off,1@t,1@t`` shows a restarted worker loading from it),
and ``@NAME/GIB`` also limits that tier to GIB (``kv-offload-dir-gib``: the oldest written
blocks are deleted).
Sends ``--prefixes`` distinct prompts of ``--prefix-tokens`` random token ids one after
the other, ``--rounds`` times (streamed ``/v1/completions``, 4 output tokens): the
prefixes together are larger than the engine's cache, so by the time a prefix comes
back the engine has evicted it. Reported per setting and round: mean / p50 / max TTFT,
errors, and the worker's ``dynamo_worker_kv_pool_*`` counters (hits, bytes, evictions)
read from its own ``/metrics``. The goal: mean TTFT of the second round with the pool
<= 0.6x of the same without. Writes benchmarks/results/kv_offload.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import (  # noqa: E402
    REPO,
    ManagedProcess,
    load_average,
    markdown_table,
    publish,
    stream_request,
    summarize,
)
from dynagraph.runtime.infra import free_port, local_infra  # noqa: E402
from tests.support.metrics import scrape, total  # noqa: E402
from tools.model_builder import ensure_model  # noqa: E402

log = logging.getLogger("kv_offload")

POOL_SERIES = ("hit_tokens", "query_tokens", "loaded_bytes", "stored_bytes", "evictions",
               "load_seconds")


def pool_metrics(address: str) -> dict[str, float]:
    text = scrape(address)
    out = {k: total(text, f"dynamo_worker_kv_pool_{k}_total") for k in POOL_SERIES}
    out["prefix_cache_hit_tokens"] = total(text, "dynamo_worker_prefix_cache_hits_total")
    out["tier_hit_tokens"] = total(text, "dynamo_worker_kv_tier_hit_tokens_total")
    out["tier_trimmed_blocks"] = total(text, "dynamo_worker_kv_tier_trimmed_blocks_total")
    out["tier_bytes"] = total(text, "dynamo_worker_kv_tier_bytes")
    return out


async def one_round(url: str, prompts: list[list[int]], rnd: int) -> dict[str, Any]:
    import aiohttp

    ttfts: list[float] = []
    errors: list[str] = []
    async with aiohttp.ClientSession() as session:
        for i, prompt in enumerate(prompts):
            body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": 4,
                    "temperature": 0, "ignore_eos": True, "stream": True}
            r = await stream_request(session, f"{url}/v1/completions", body, 300.0)
            if r.error or not r.chunk_times:
                errors.append(f"round {rnd} prefix {i}: {r.error or 'no text'}")
            else:
                ttfts.append(r.chunk_times[0])
    s = summarize([t * 1000 for t in ttfts]) if ttfts else {}
    return {"round": rnd, "ttft_ms": s, "ttfts_ms": [round(t * 1000, 1) for t in ttfts],
            "errors": errors}


def run_setting(setting: str, args: argparse.Namespace, infra: dict[str, Any],
                model_dir: Path, prompts: list[list[int]], tier_root: Path) -> dict[str, Any]:
    pool, _, tier = setting.partition("@")
    tier, _, tier_limit = tier.partition("/")
    gib, _, codec = pool.partition(":")
    pool_gib = 0.0 if gib == "off" else float(gib)
    port = free_port()
    env = {**os.environ, "ETCD_ENDPOINTS": infra["etcd"].url, "NATS_SERVER": infra["nats"].url,
           "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "dynagraph.cli.main", "serve", "graphs.agg:Frontend",
           "-f", "configs/agg.yaml", f"--Frontend.port={port}", f"--Common.model={model_dir}",
           f"--VllmWorker.num-gpu-blocks-override={args.blocks}",
           f"--VllmWorker.kv-offload-gib={pool_gib}", "--ready-timeout=420",
           # vLLM reserves one more core for its scheduler when any KV connector is set,
           # which changes the engine's OpenMP threads: the same reservation in every
           # setting keeps the computing engine the same (1 core of 2 here)
           f"--VllmWorker.cpu-reserved-cores={args.reserved_cores}"]
    if codec:
        cmd.append(f"--VllmWorker.kv-compression={codec}")
    if tier:
        cmd.append(f"--VllmWorker.kv-offload-dir={tier_root / tier}")
    if tier_limit:
        cmd.append(f"--VllmWorker.kv-offload-dir-gib={tier_limit}")
    server = ManagedProcess(cmd, env, name=f"agg-pool-{setting}")
    try:
        banner, _ = server.wait_line(lambda s: "VllmWorker[0] pid=" in s, 420)
        m = re.search(r"metrics=(\S+)", banner)
        if m is None:
            raise RuntimeError(f"no metrics address in {banner!r}")
        server.wait_line(lambda s: "dynamo serve: graph " in s, 420)
        url = f"http://127.0.0.1:{port}"
        rounds = []
        load0 = load_average()
        for rnd in range(1, args.rounds + 1):
            if rnd > 1:
                time.sleep(args.pause)
            before = pool_metrics(m.group(1))
            out = asyncio.run(one_round(url, prompts, rnd))
            time.sleep(0.5)  # the last step's stats reach the worker's metrics after it
            after = pool_metrics(m.group(1))
            out["worker"] = {k: after[k] - before[k] for k in after}
            for k in ("tier_bytes", "tier_trimmed_blocks"):  # at the trimmer's last pass
                out["worker"][k] = after[k]
            log.info("setting %s round %d: %s", setting, rnd, out)
            rounds.append(out)
        return {"setting": setting, "pool_gib": pool_gib, "codec": codec or "none",
                "tier": tier or None,
                "rounds": rounds, "load_average_before": load0,
                "load_average_after": load_average(), "command": " ".join(cmd[1:])}
    finally:
        server.stop()


def markdown(result: dict[str, Any]) -> str:
    a = result["args"]
    runs = result["runs"]
    pause = f" --pause {a['pause']:g}" if a.get("pause") else ""
    lines = [
        "# Host KV pool: TTFT of prefixes that came back after the engine evicted them",
        "",
        f"`python benchmarks/kv_offload.py --prefixes {a['prefixes']} --prefix-tokens "
        f"{a['prefix_tokens']} --blocks {a['blocks']} --settings {a['settings']} --rounds "
        f"{a['rounds']}{pause}` at {result['when']}, {result['machine']['cpus']} CPUs, Python "
        f"{result['machine']['python']}.",
        "",
        f"`graphs.agg` served with `dynamo serve` (one vLLM worker, tiny model), the engine's "
        f"cache cut to {a['blocks']} blocks of 32 tokens ({a['blocks'] * 32} tokens); "
        f"{a['prefixes']} prompts of {a['prefix_tokens']} random token ids "
        f"({a['prefixes'] * a['prefix_tokens']} tokens together) sent one after the other, "
        f"{a['rounds']} rounds, 4 output tokens each. Pool counters: the worker's "
        "`dynamo_worker_kv_pool_*` metrics over the round.",
        "",
    ]
    rows = []
    for run in runs:
        for r in run["rounds"]:
            w = r["worker"]
            t = r["ttft_ms"]
            rows.append({
                "setting": run.get("label", run["setting"]), "round": r["round"],
                "TTFT mean / p50 / max (ms)": (f"{t.get('mean', float('nan')):.1f} / "
                                               f"{t.get('p50', float('nan')):.1f} / "
                                               f"{t.get('max', float('nan')):.1f}"),
                "errors": len(r["errors"]),
                "pool hit tokens (from the tier)": (f"{int(w['hit_tokens'])} "
                                                    f"({int(w.get('tier_hit_tokens', 0))})"),
                "engine cache hit tokens": int(w["prefix_cache_hit_tokens"]),
                "loaded MiB (s)": f"{w['loaded_bytes'] / 2**20:.1f} ({w['load_seconds']:.3f})",
                "stored MiB": f"{w['stored_bytes'] / 2**20:.1f}",
                "pool evictions": int(w["evictions"]),
                "tier MiB (blocks trimmed since start) at the last trim": (
                    f"{w.get('tier_bytes', 0) / 2**20:.1f} "
                    f"({int(w.get('tier_trimmed_blocks', 0))})"),
            })
    lines += markdown_table(list(rows[0]), rows)
    last = {run.get("label", run["setting"]): run["rounds"][-1]["ttft_ms"].get("mean")
            for run in runs}
    off = last.get("off")
    if off:
        lines += ["", "Last round, mean TTFT against `off` (goal <= 0.6x with a pool): "
                  + ", ".join(f"`{k}` **{v / off:.2f}x**" for k, v in last.items()
                              if k != "off" and v) + "."]
    first = [(run.get("label", run["setting"]), run["rounds"][0]["ttft_ms"].get("mean"))
             for run in runs]
    off_first = dict(first).get("off")
    if off_first and any(run.get("tier") for run in runs):
        lines += ["", "First round, mean TTFT against `off` (a setting that follows another "
                  "with the same tier starts with it filled): " + ", ".join(
                      f"`{k}` **{v / off_first:.2f}x**" for k, v in first if k != "off" and v)
                  + "."]
    lines += ["", "Load average before / after each setting: " + ", ".join(
        f"`{r['setting']}` {r['load_average_before']:.1f} / {r['load_average_after']:.1f}"
        for r in runs), ""]
    return "\n".join(lines) + "\n"


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prefixes", type=int, default=8)
    p.add_argument("--prefix-tokens", type=int, default=1500)
    p.add_argument("--blocks", type=int, default=160)
    p.add_argument("--settings", default="off,1,1:int8,0.012,0.012:int8",
                   help="comma-separated: off | GIB | GIB:CODEC, each optionally @TIER "
                        "or @TIER/LIMIT_GIB")
    p.add_argument("--tier-root", default="/dev/shm",
                   help="where the @TIER directories go (a tmpfs: a RAM tier; a disk: a "
                        "disk tier); removed at the end")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--pause", type=float, default=0.0,
                   help="seconds between rounds (a tier limit is enforced every 5 s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reserved-cores", type=int, default=1,
                   help="VllmWorker.cpu-reserved-cores in every setting")
    p.add_argument("--name", default="kv_offload")
    args = p.parse_args()
    model_dir = ensure_model(REPO / "models" / "tiny-llama")
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, 2000) for _ in range(args.prefix_tokens)]
               for _ in range(args.prefixes)]
    runs: list[dict[str, Any]] = []
    with local_infra(etcd=True, nats=True) as infra, tempfile.TemporaryDirectory(
            prefix="kv-offload-bench-", dir=args.tier_root) as tiers:
        for setting in args.settings.split(","):
            run = run_setting(setting, args, infra, model_dir, prompts, Path(tiers))
            if any(r["setting"] == setting for r in runs):
                run["label"] = f"{setting} (a fresh graph)"
            runs.append(run)
    publish(args.name, {"args": vars(args), "runs": runs,
                        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, markdown)
    errors = sum(len(r["errors"]) for run in runs for r in run["rounds"])
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
