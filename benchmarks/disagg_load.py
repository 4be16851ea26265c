"""The disagg_router graph under a steady streaming load, by KV transport.

    python benchmarks/disagg_load.py [--transports shm,nixl] [--rounds 2] [--window 60]

Serves ``graphs.disagg_router`` with ``configs/disagg_router.yaml`` (two decode workers,
one prefill worker), every prompt prefilled remotely (``max-local-prefill-length`` 64;
the prompts are ~170 tokens: ``benchmarks/chaos.py``'s load), ``kv-transport`` set on both
workers to each of ``--transports`` in turn (rounds alternate the order); as in
``benchmarks/disagg_served.py``, a transport may carry settings after ``@``
(``shm@omp-spin-count=null``: a VllmWorker key; ``shm@PrefillWorker.key=value``). After
the graph is ready and ``--warmup`` seconds of load, ``--concurrency`` closed-loop clients
stream ``--max-tokens`` greedy tokens for ``--window`` seconds; reported: requests
completed in the window, errors, etcd leases the graph's processes found expired after
it was ready (``benchmarks/engine_nice_probe.py``'s count; the first one's log line in the
JSON), TTFT and inter-token p50 / p99. Writes
``benchmarks/results/<name>.{json,md}``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _common as bench  # noqa: E402
from benchmarks.chaos import load, short  # noqa: E402
from benchmarks.disagg_served import graph_infra, split_transport  # noqa: E402
from benchmarks.engine_nice_probe import lost_leases  # noqa: E402
from dynagraph.runtime.infra import free_port  # noqa: E402
from tools.model_builder import ensure_model  # noqa: E402


def run(a: argparse.Namespace, transport: str) -> dict[str, Any]:
    model_dir = ensure_model(bench.REPO / "models" / "tiny-llama")
    port = free_port()
    with graph_infra("local") as env:
        cmd = [sys.executable, "-m", "dynagraph.cli.main", "serve",
               "graphs.disagg_router:Frontend", "-f", "configs/disagg_router.yaml",
               f"--Frontend.port={port}", f"--Common.model={model_dir}",
               "--VllmWorker.max-local-prefill-length=64"]
        kind, overrides = split_transport(transport)
        cmd += [f"--VllmWorker.kv-transport={kind}", f"--PrefillWorker.kv-transport={kind}",
                *overrides]
        graph = bench.ManagedProcess(cmd, env, name=f"disagg-load-{transport}")
        try:
            graph.wait_line(lambda s: s.startswith("dynamo serve: graph"), 300)
            ready_at = len(graph.lines)
            got, wall = asyncio.run(measure(f"http://127.0.0.1:{port}", a))
            lost = lost_leases(graph.lines[ready_at:])
        finally:
            graph.stop()
    ok = [r for r in got if r.error is None and not short(r, a.max_tokens)]
    ttft = [r.chunk_times[0] * 1000 for r in ok if r.chunk_times]
    itl = [(y - x) * 1000 for r in ok for x, y in zip(r.chunk_times, r.chunk_times[1:],
                                                        strict=False)]
    errors = [r.error or "truncated" for r in got
              if r.error is not None or short(r, a.max_tokens)]
    return {"transport": transport, "window_s": round(wall, 1), "completed": len(ok),
            "errors": len(errors), "first_error": errors[0] if errors else None,
            "leases_lost": len(lost), "first_lease_lost": lost[0] if lost else None,
            "ttft_p50_ms": round(statistics.median(ttft)) if ttft else None,
            "ttft_p99_ms": round(bench.percentile(ttft, 99)) if ttft else None,
            "itl_p50_ms": round(statistics.median(itl), 1) if itl else None,
            "itl_p99_ms": round(bench.percentile(itl, 99), 1) if itl else None,
            "loadavg_1m": round(os.getloadavg()[0], 2)}


async def measure(url: str, a: argparse.Namespace) -> tuple[list[bench.StreamResult], float]:
    results: list[bench.StreamResult] = []
    stop = asyncio.Event()
    clients = asyncio.create_task(load(url, stop, results, concurrency=a.concurrency,
                                       max_tokens=a.max_tokens))
    await asyncio.sleep(a.warmup)
    first, began = len(results), time.perf_counter()
    await asyncio.sleep(a.window)
    # the window's requests: those that finished in it (the clients finish theirs after)
    got, wall = results[first:], time.perf_counter() - began
    stop.set()
    await asyncio.wait_for(clients, 180)
    return got, wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--transports", default="shm,nixl")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--warmup", type=float, default=20.0)
    ap.add_argument("--window", type=float, default=60.0)
    ap.add_argument("--name", default="disagg_load")
    a = ap.parse_args()
    transports = a.transports.split(",")
    rows = []
    for rnd in range(a.rounds):
        for t in (transports if rnd % 2 == 0 else transports[::-1]):
            row = {"round": rnd + 1, **run(a, t)}
            print(row, flush=True)
            rows.append(row)
    cols = ["round", "transport", "window_s", "completed", "errors", "leases_lost", "ttft_p50_ms",
            "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "loadavg_1m"]
    text = ("# disagg_router under a steady load, by KV transport\n\n"
            f"`python benchmarks/disagg_load.py --transports {a.transports} --rounds "
            f"{a.rounds} --window {a.window:g}`: {a.concurrency} streams x {a.max_tokens} "
            "tokens, every prompt prefilled remotely, requests finished in the window after "
            f"{a.warmup:g} s of load. Shared 2-core VM: three engines on two cores.\n\n"
            + "\n".join(bench.markdown_table(cols, rows)) + "\n")
    bench.write_results(a.name, {"rows": rows, "args": vars(a),
                                 "machine": bench.machine_info()}, text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
