"""Disaggregated prefill, per request: queue wait, prefill, KV transfer, first decode step.

    python benchmarks/disagg.py [--requests 6] [--no-write]

Runs the real pieces in one process, without HTTP: a decode engine (NixlConnector
consumer, core 0) and a prefill engine (producer, core 1), each with its own vLLM
engine-core process; a local nats-server with the real ``NatsPrefillQueue``; the
decode side's ``RemotePrefillCoordinator`` and the prefill side's
``PrefillJobHandler`` (the hand-off is an in-process call instead of the request
plane). For fresh 1k- and 4k-token prompts (no prefix-cache hits) it measures:

- remote: TTFT = enqueue -> first token on the decode engine, split into queue wait
  (enqueue -> pulled), prefill (engine, max_tokens=1), hand-off (-> decode worker has
  the KV params), KV transfer (vLLM's ``nixl_xfer_time_seconds`` for the request) and
  first decode step (the rest of the decode engine's time to first token);
- local: TTFT of the same-sized prompt prefilled by the decode engine itself;
- KV bytes moved (``nixl_bytes_transferred``) and the transfer bandwidth, next to the
  raw NIXL READ bandwidth of the same layout (``benchmarks/nixl_raw.py``).

Writes benchmarks/results/disagg.json and .md. Numbers from a shared 2-core VM are
provisional.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# The engines run as served (prepare_nixl: each engine one vLLM engine-core process with
# its model runner inside, see dynagraph.llm.kv.transfer.nixl_side.IN_PROCESS_ENV); run with
# VLLM_ENABLE_V1_MULTIPROCESSING=1 for vLLM's default engine-core + worker processes.

from dynagraph.llm.disagg.coordinator import (  # noqa: E402
    PrefillAck,
    PrefillResult,
    PrefixCacheEstimate,
    RemotePrefillCoordinator,
)
from dynagraph.llm.disagg.policy import DisaggConfig, LiveDisaggSettings  # noqa: E402
from dynagraph.llm.disagg.prefill import PrefillJobHandler, serve_queue  # noqa: E402
from dynagraph.llm.engines.base import SamplingSpec  # noqa: E402
from dynagraph.llm.engines.vllm.args import VllmEngineArgs  # noqa: E402
from dynagraph.llm.engines.vllm.engine import VllmEngine  # noqa: E402
from dynagraph.llm.kv.transfer.nixl_side import prepare_nixl  # noqa: E402
from dynagraph.runtime.infra import start_nats  # noqa: E402
from dynagraph.runtime.queue import NatsPrefillQueue, ReplyTarget  # noqa: E402
from tools.model_builder import ensure_model  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
SIZES = {"1k": 1024, "4k": 4000}
MAX_TOKENS = 4
log = logging.getLogger("bench.disagg")


def engine(model: Path, role: str, core: str) -> VllmEngine:
    kv, _ = prepare_nixl(role, engine_id=f"bench-{role}")  # type: ignore[arg-type]
    eng = VllmEngine(VllmEngineArgs(
        model=str(model), block_size=32, max_model_len=4096, enforce_eager=True,
        kv_cache_space_gib=1, kv_transfer_config=kv, cpu_threads_bind=core, cpu_reserved_cores=0,
    ))
    return eng


def nixl_totals() -> dict[str, float]:
    from prometheus_client import REGISTRY

    out: dict[str, float] = {}
    for name in ("vllm:nixl_xfer_time_seconds", "vllm:nixl_bytes_transferred",
                 "vllm:nixl_post_time_seconds", "vllm:nixl_num_descriptors"):
        out[name] = sum(s.value for m in REGISTRY.collect() for s in m.samples
                        if s.name == f"{name}_sum")
    return out


async def wait_moved(before: dict[str, float], within: float = 5.0) -> dict[str, float]:
    """The NIXL totals once this request's transfer is recorded."""
    end = time.monotonic() + within
    while True:
        now = nixl_totals()
        moved = {k: now[k] - before[k] for k in now}
        if moved["vllm:nixl_bytes_transferred"] > 0 or time.monotonic() > end:
            return moved
        await asyncio.sleep(0.01)


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 900) for _ in range(n)]


async def first_token(eng: VllmEngine, rid: str, ids: list[int],
                      kv: dict[str, Any] | None) -> tuple[float, list[int]]:
    t0 = time.perf_counter()
    ttft = 0.0
    toks: list[int] = []
    async for out in eng.generate(rid, ids, SamplingSpec(max_tokens=MAX_TOKENS, temperature=0),
                                  kv_transfer_params=kv):
        if not toks and out.token_ids:
            ttft = time.perf_counter() - t0
        toks.extend(out.token_ids)
    return ttft, toks


async def bench(requests: int) -> dict[str, Any]:
    model = ensure_model(REPO / "models" / "tiny-llama")
    nats = start_nats()
    prefill = engine(model, "kv_producer", "1")  # sets the side-channel env: start it now
    await prefill.start()
    decode = engine(model, "kv_consumer", "0")
    pq = NatsPrefillQueue(nats.url, "bench", ack_wait=30)
    dq = NatsPrefillQueue(nats.url, "bench", ack_wait=30)
    rows: list[dict[str, Any]] = []
    server: asyncio.Task[None] | None = None
    try:
        await decode.start()
        await pq.connect()
        await dq.connect()
        settings = LiveDisaggSettings(DisaggConfig(remote_prefill=True, max_local_prefill_length=512,
                                                   max_prefill_queue_size=100,
                                                   remote_prefill_timeout=30), namespace="bench")
        coord = RemotePrefillCoordinator(
            settings=settings, queue=dq, prefix=PrefixCacheEstimate(32, 1),
            reply_to=ReplyTarget(component="VllmWorker", endpoint="prefill_done", instance_id=1),
        )
        handed: dict[str, float] = {}

        async def reply(target: ReplyTarget, result: PrefillResult) -> PrefillAck:
            handed[result.request_id] = time.time()
            return PrefillAck(accepted=coord.deliver(result))


        server = asyncio.create_task(serve_queue(pq, PrefillJobHandler(prefill, reply), concurrency=1,
                                                 pull_timeout=0.5))
        rng = random.Random(7)
        for label, n in SIZES.items():
            for i in range(requests + 1):  # the first of each size is a warm-up
                rows.extend(await one_pair(coord, decode, handed, f"{label}-{i}", label,
                                           prompt(rng, n), prompt(rng, n), warmup=i == 0))
    finally:
        if server is not None:
            server.cancel()
            await asyncio.gather(server, return_exceptions=True)
        await pq.close()
        await dq.close()
        await decode.shutdown()
        await prefill.shutdown()
        nats.stop()
    return {"rows": rows}


async def one_pair(coord: RemotePrefillCoordinator, decode: VllmEngine, handed: dict[str, float],
                   rid: str, label: str, ids: list[int], local_ids: list[int],
                   warmup: bool) -> list[dict[str, Any]]:
    """One remote request, then one local request of the same size (fresh prompts)."""
    before = nixl_totals()
    t0 = time.time()
    plan = await coord.plan(rid, ids)
    if not plan.remote or plan.result is None:
        raise RuntimeError(f"{rid} was not prefilled remotely: {plan}")
    have_kv = time.time()
    decode_ttft, _ = await first_token(decode, rid, ids, plan.kv_transfer_params)
    moved = await wait_moved(before)
    xfer, nbytes = moved["vllm:nixl_xfer_time_seconds"], moved["vllm:nixl_bytes_transferred"]
    r = plan.result
    remote = {
        "prompt": label, "tokens": len(ids), "mode": "remote", "warmup": warmup,
        "queue_wait_ms": r.queue_wait_s * 1e3, "prefill_ms": r.prefill_s * 1e3,
        "handoff_ms": (have_kv - t0 - r.queue_wait_s - r.prefill_s) * 1e3,
        "kv_transfer_ms": xfer * 1e3, "first_decode_step_ms": (decode_ttft - xfer) * 1e3,
        "ttft_ms": (have_kv - t0 + decode_ttft) * 1e3, "kv_bytes": nbytes,
        "gib_per_s": nbytes / xfer / 2**30 if xfer > 0 else 0.0,
        "post_ms": moved["vllm:nixl_post_time_seconds"] * 1e3,
        "descriptors": moved["vllm:nixl_num_descriptors"],
    }
    local_ttft, _ = await first_token(decode, f"{rid}-local", local_ids, None)
    local = {"prompt": label, "tokens": len(ids), "mode": "local", "warmup": warmup,
             "ttft_ms": local_ttft * 1e3}
    log.info("%s | local ttft %.1f ms", {k: round(v, 2) if isinstance(v, float) else v
                                         for k, v in remote.items()}, local["ttft_ms"])
    return [remote, local]


def summarize(rows: list[dict[str, Any]], raw: dict[str, float],
              scattered: dict[str, float]) -> list[dict[str, Any]]:
    out = []
    for label in SIZES:
        rem = [r for r in rows if r["prompt"] == label and r["mode"] == "remote" and not r["warmup"]]
        loc = [r for r in rows if r["prompt"] == label and r["mode"] == "local" and not r["warmup"]]
        med = {k: statistics.median(r[k] for r in rem) for k in
               ("queue_wait_ms", "prefill_ms", "handoff_ms", "kv_transfer_ms",
                "first_decode_step_ms", "ttft_ms", "kv_bytes", "gib_per_s")}
        out.append({"prompt": label, "requests": len(rem), **{k: round(v, 3) for k, v in med.items()},
                    "local_ttft_ms": round(statistics.median(r["ttft_ms"] for r in loc), 3),
                    "raw_nixl_gib_per_s": raw.get(label),
                    "ratio_to_raw": round(med["gib_per_s"] / raw[label], 3) if raw.get(label) else None,
                    "raw_scattered_gib_per_s": scattered.get(label),
                    "xfer_ms_min": round(min(r["kv_transfer_ms"] for r in rem), 3)})
    return out


def raw_nixl(layout: str = "kv-blocks") -> dict[str, float]:
    """Raw READ bandwidth per prompt size from benchmarks/results/nixl_raw.json, if any."""
    path = RESULTS / "nixl_raw.json"
    if not path.exists():
        return {}
    rows = json.loads(path.read_text())["rows"]
    return {r["prompt"]: r["gib_per_s"] for r in rows if r["layout"] == layout}


def write(summary: list[dict[str, Any]], rows: list[dict[str, Any]], args: Any) -> str:
    cols = ["prompt", "requests", "queue_wait_ms", "prefill_ms", "handoff_ms", "kv_transfer_ms",
            "first_decode_step_ms", "ttft_ms", "local_ttft_ms", "kv_bytes", "gib_per_s",
            "raw_nixl_gib_per_s", "ratio_to_raw", "raw_scattered_gib_per_s", "xfer_ms_min"]
    table = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    table += ["| " + " | ".join(str(s[c]) for c in cols) + " |" for s in summary]
    text = "\n".join(table)
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        meta = {"requests_per_size": args.requests, "max_tokens": MAX_TOKENS,
                "note": "medians, warm-up excluded; shared 2-core VM: provisional"}
        (RESULTS / "disagg.json").write_text(
            json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1) + "\n")
        (RESULTS / "disagg.md").write_text(
            "# Disaggregated prefill: per-request breakdown (medians)\n\n"
            f"`python benchmarks/disagg.py --requests {args.requests}`: tiny Llama, block 32, "
            "decode engine on core 0, prefill engine on core 1, real NATS queue, NIXL over UCX "
            "(NIXL progress thread with a poll delay, `nixl_connector`). TTFT is measured at the engines (no HTTP). "
            "Raw NIXL: `benchmarks/nixl_raw.py`, kv-blocks layout of the same size. "
            "Provisional: shared 2-core VM.\n\n" + text + "\n")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    rows = asyncio.run(bench(args.requests))["rows"]
    print(write(summarize(rows, raw_nixl(), raw_nixl("kv-scattered")), rows, args))


if __name__ == "__main__":
    main()
