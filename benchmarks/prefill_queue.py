"""Prefill-queue micro-benchmark on a local nats-server with JetStream (file storage).

    python benchmarks/prefill_queue.py [--jobs 2000] [--tokens 512] [--concurrency 32]

Starts its own nats-server (127.0.0.1, free ports, temp dir; stopped at the end) and
measures ``NatsPrefillQueue``:

  (a) enqueue, one at a time (each waits for the JetStream PubAck): jobs/s, p50/p99;
  (b) enqueue with ``--concurrency`` in flight: jobs/s;
  (c) pull + ack (ack waits for the server's confirmation), one worker: jobs/s;
  (d) the same with two workers (two connections) sharing the consumer: jobs/s;
  (e) round trip: enqueue on one connection until a waiting worker on another
      connection holds the job: p50/p99;
  (f) ``stats()`` (consumer info, what an uncached ``depth()`` costs): p50.

Prints a table and writes benchmarks/results/prefill_queue.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import statistics
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dynagraph.runtime.infra import start_nats  # noqa: E402
from dynagraph.runtime.queue import (  # noqa: E402
    NatsPrefillQueue,
    RemotePrefillJob,
    ReplyTarget,
    encode_job,
)

log = logging.getLogger("bench.prefill_queue")
RESULTS = Path(__file__).resolve().parent / "results"
REPLY = ReplyTarget(component="VllmWorker", endpoint="prefill_done", instance_id=1)


def _job(tokens: int) -> RemotePrefillJob:
    return RemotePrefillJob.create(
        request_id=uuid.uuid4().hex, prompt_token_ids=list(range(tokens)), reply_to=REPLY,
        timeout=600, engine_params={"kv_transfer_params": {"do_remote_decode": True}},
    )


def _pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p * len(s)))]


async def _drain(q: NatsPrefillQueue, stop_after_idle: float = 0.5) -> int:
    n = 0
    while (item := await q.pull(stop_after_idle)) is not None:
        await item.ack()
        n += 1
    return n


async def run(url: str, jobs: int, tokens: int, concurrency: int) -> dict[str, Any]:
    ns = f"bench{uuid.uuid4().hex[:8]}"
    prod, w1, w2 = (NatsPrefillQueue(url, ns, ack_wait=30, max_age=600) for _ in range(3))
    await asyncio.gather(prod.connect(), w1.connect(), w2.connect())
    out: dict[str, Any] = {"job_bytes": len(encode_job(_job(tokens)))}
    try:
        # (a) sequential enqueue
        lat = []
        t0 = time.perf_counter()
        for _ in range(jobs):
            t = time.perf_counter()
            await prod.enqueue(_job(tokens))
            lat.append(time.perf_counter() - t)
        dt = time.perf_counter() - t0
        out["enqueue_seq_per_s"] = jobs / dt
        out["enqueue_p50_ms"] = statistics.median(lat) * 1e3
        out["enqueue_p99_ms"] = _pct(lat, 0.99) * 1e3

        # (c) pull + ack, one worker
        t0 = time.perf_counter()
        n = 0
        while n < jobs and (item := await w1.pull(2)) is not None:
            await item.ack()
            n += 1
        out["pull_ack_1worker_per_s"] = n / (time.perf_counter() - t0)
        assert n == jobs, f"pulled {n} of {jobs}"

        # (b) concurrent enqueue
        sem = asyncio.Semaphore(concurrency)

        async def one() -> None:
            async with sem:
                await prod.enqueue(_job(tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(one() for _ in range(jobs)))
        out["enqueue_concurrent_per_s"] = jobs / (time.perf_counter() - t0)

        # (d) pull + ack, two workers sharing the consumer
        t0 = time.perf_counter()
        a, b = await asyncio.gather(_drain(w1), _drain(w2))
        out["pull_ack_2workers_per_s"] = (a + b) / (time.perf_counter() - t0 - 0.5)
        assert a + b == jobs, f"two workers pulled {a}+{b} of {jobs}"

        # (e) round trip: a worker already waiting in pull()
        rtt = []
        for _ in range(min(jobs, 500)):
            waiter = asyncio.create_task(w1.pull(5))
            await asyncio.sleep(0.002)  # let the fetch request reach the server
            t = time.perf_counter()
            await prod.enqueue(_job(tokens))
            item = await waiter
            rtt.append(time.perf_counter() - t)
            assert item is not None
            await item.ack()
        out["round_trip_p50_ms"] = statistics.median(rtt) * 1e3
        out["round_trip_p99_ms"] = _pct(rtt, 0.99) * 1e3

        # (f) stats / uncached depth
        lat = []
        for _ in range(300):
            t = time.perf_counter()
            await prod.stats()
            lat.append(time.perf_counter() - t)
        out["stats_p50_ms"] = statistics.median(lat) * 1e3
    finally:
        await prod.destroy()
        await asyncio.gather(prod.close(), w1.close(), w2.close())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=2000)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=32)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    svc = start_nats()
    try:
        res = asyncio.run(run(svc.url, args.jobs, args.tokens, args.concurrency))
    finally:
        svc.stop()

    meta = {
        "when": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_1min": round(os.getloadavg()[0], 2),
        "jobs": args.jobs, "tokens": args.tokens, "concurrency": args.concurrency,
        "provisional": True,
    }
    rows = [
        ("enqueue, sequential (awaits PubAck)", f"{res['enqueue_seq_per_s']:,.0f} jobs/s",
         f"p50 {res['enqueue_p50_ms']:.2f} ms, p99 {res['enqueue_p99_ms']:.2f} ms"),
        (f"enqueue, {args.concurrency} in flight", f"{res['enqueue_concurrent_per_s']:,.0f} jobs/s", ""),
        ("pull + ack (ack_sync), 1 worker", f"{res['pull_ack_1worker_per_s']:,.0f} jobs/s", ""),
        ("pull + ack (ack_sync), 2 workers", f"{res['pull_ack_2workers_per_s']:,.0f} jobs/s", ""),
        ("round trip enqueue -> waiting worker holds job", f"p50 {res['round_trip_p50_ms']:.2f} ms",
         f"p99 {res['round_trip_p99_ms']:.2f} ms"),
        ("stats() / uncached depth()", f"p50 {res['stats_p50_ms']:.2f} ms", ""),
    ]
    md = [
        "# Prefill queue benchmark (NATS JetStream)",
        "",
        f"`python benchmarks/prefill_queue.py --jobs {args.jobs} --tokens {args.tokens} "
        f"--concurrency {args.concurrency}` at {meta['when']}, Python {meta['python']}, "
        f"{meta['cpus']} CPUs, 1-min load average {meta['load_1min']} "
        "(provisional: 2-core machine shared with other jobs).",
        f"Local nats-server (file storage), one process, separate connections for producer and "
        f"workers; job = {args.tokens} prompt tokens, {res['job_bytes']} bytes of msgpack.",
        "",
        "| what | rate / latency | detail |",
        "| --- | --- | --- |",
        *[f"| {a} | {b} | {c} |" for a, b, c in rows],
        "",
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "prefill_queue.json").write_text(json.dumps({"meta": meta, "results": res}, indent=2) + "\n")
    (RESULTS / "prefill_queue.md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()
