"""Chaos under load: a steady streaming load on a served graph while faults happen.

    python benchmarks/chaos.py --graph agg_router            # ~90 s
    python benchmarks/chaos.py --graph disagg_router

The graph runs as users run it (``dynamo serve graphs.<graph>:Frontend -f
configs/<graph>.yaml``) against an etcd and a NATS this script owns (so it can restart
them). ``--concurrency`` closed-loop clients stream greedy completions of
``--max-tokens`` tokens (``ignore_eos``: every answer has a known length) for the whole
run; one fault at a time: the next comes ``--period`` seconds after the last and only once
every worker is registered again (a killed worker is restarted by dynamo serve; its
engine start is part of the window):

    kill-decode    SIGKILL a VllmWorker (dynamo serve restarts it)
    kill-prefill   SIGKILL a PrefillWorker (disagg graphs)
    stop-decode    SIGSTOP a VllmWorker for --stop-seconds, then SIGCONT
    restart-etcd   stop etcd and start it again (same data)
    restart-nats   stop nats-server and start it again (same JetStream store)

Per fault window (from the fault to the next one): requests started / completed /
failed (an error status or error event) / truncated (ended without a finish reason or
``[DONE]``, or short of max_tokens), migrations (the Processor's
``dynamo_processor_migrations_total``) and p99 TTFT/ITL of the requests that started
in it. Goal: 0 failed, 0 truncated. Results: ``benchmarks/results/chaos_<graph>.{json,md}``
(or ``--name``).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import random
import re
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _common as bench  # noqa: E402
from dynagraph.errors import DiscoveryError  # noqa: E402
from dynagraph.runtime.discovery import EtcdDiscovery, endpoint_prefix  # noqa: E402
from dynagraph.runtime.infra import LocalService, start_etcd, start_nats  # noqa: E402
from dynagraph.runtime.procfs import pid_alive  # noqa: E402
from tools.model_builder import ensure_model  # noqa: E402

log = logging.getLogger("bench.chaos")

MODEL = "tiny-llama"
FAULTS = ("kill-decode", "kill-prefill", "stop-decode", "restart-etcd", "restart-nats")


@dataclass
class Window:
    fault: str
    start: float
    end: float = 0.0
    migrations: float = 0.0
    note: str = ""
    recovery_s: float = 0.0
    results: list[bench.StreamResult] = field(default_factory=list)


def pids_of(graph: bench.ManagedProcess, component: str) -> list[int]:
    """PIDs of ``component``'s processes from the ready banner (``Component[i] pid=N``) and
    the supervisor's start lines (``Component[i]  started, pid N``: restarts, scale-ups)."""
    found: dict[str, int] = {}
    for line in graph.lines:
        m = re.search(rf"\b{component}\[(\d+)\] pid=(\d+)", line) or re.search(
            rf"\b{component}\[(\d+)\]\s+started, pid (\d+)", line)
        if m:
            found[m.group(1)] = int(m.group(2))
    return [p for p in found.values() if pid_alive(p)]


def migrations(graph: bench.ManagedProcess) -> float:
    import urllib.request

    total = 0.0
    for m in re.finditer(r"Processor\[\d+\] pid=\d+ rpc=\S+ metrics=(\S+)", "\n".join(graph.lines)):
        try:
            with urllib.request.urlopen(f"http://{m.group(1)}/metrics", timeout=5) as r:  # noqa: S310
                text = r.read().decode()
        except OSError:
            continue
        for line in text.splitlines():
            if line.startswith("dynamo_processor_migrations_total"):
                total += float(line.split()[-1])
    return total


async def instances(etcd_url: str, component: str) -> int:
    """How many instances of ``component``'s generate endpoint are registered in etcd."""
    disc = EtcdDiscovery(etcd_url)
    await disc.start()
    try:
        endpoint = "status" if component == "PrefillWorker" else "generate"
        return len(await disc.get_prefix(endpoint_prefix("dynamo", component, endpoint)))
    finally:
        await disc.close()


async def recovered(etcd_url: str, want: dict[str, int], within: float) -> float:
    """Wait until every component has its instances back; the seconds it took."""
    t0 = time.perf_counter()
    while True:
        try:
            counts = {c: await instances(etcd_url, c) for c in want}
        except DiscoveryError as exc:  # etcd itself may be coming back
            counts = {c: 0 for c in want}
            log.info("waiting for etcd: %s", exc)
        if all(counts[c] >= n for c, n in want.items()):
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > within:
            raise TimeoutError(f"instances {counts}, want {want}, after {within:.0f}s")
        await asyncio.sleep(1.0)


async def fault(name: str, graph: bench.ManagedProcess, etcd: LocalService, nats: LocalService,
                stop_seconds: float) -> str:
    if name in ("kill-decode", "stop-decode", "kill-prefill"):
        comp = "PrefillWorker" if name == "kill-prefill" else "VllmWorker"
        pids = pids_of(graph, comp)
        if not pids:
            return f"no {comp} process to hit"
        victim = random.choice(pids)
        if name == "stop-decode":
            os.kill(victim, signal.SIGSTOP)
            await asyncio.sleep(stop_seconds)
            os.kill(victim, signal.SIGCONT)
            return f"SIGSTOP {comp} pid {victim} for {stop_seconds:.0f}s"
        os.kill(victim, signal.SIGKILL)
        return f"SIGKILL {comp} pid {victim}"
    svc = etcd if name == "restart-etcd" else nats
    await asyncio.to_thread(svc.restart)
    return f"restarted {svc.name}"


def prompt(rng: random.Random, i: int) -> str:
    shared = ["You are a careful assistant. " * 20, "Summarize the following notes. " * 24]
    words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "omega"]) for _ in range(40))
    return f"{shared[i % 2]}Request {i}: {words}"


async def load(url: str, stop: asyncio.Event, results: list[bench.StreamResult], *,
               concurrency: int, max_tokens: int) -> None:
    import aiohttp

    rng = random.Random(0)
    counter = iter(range(10**9))

    async def client(session: Any) -> None:
        while not stop.is_set():
            i = next(counter)
            body = {"model": MODEL, "prompt": prompt(rng, i), "max_tokens": max_tokens,
                    "temperature": 0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            res = await bench.stream_request(session, f"{url}/v1/completions", body, 120.0)
            results.append(res)
            if res.error is not None:
                await asyncio.sleep(0.2)  # a refused request: back off a little

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))


def short(r: bench.StreamResult, max_tokens: int) -> bool:
    """Ended without an error event, yet cut off: no finish reason/[DONE], or too few tokens."""
    return r.error is None and (r.truncated or r.completion_tokens < max_tokens)


def window_stats(w: Window, max_tokens: int) -> dict[str, Any]:
    done = w.results
    ok = [r for r in done if r.error is None and not short(r, max_tokens)]
    ttft = [r.chunk_times[0] * 1000 for r in ok if r.chunk_times]
    itl = [(b - a) * 1000 for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:],
                                                        strict=False)]
    return {
        "fault": w.fault, "what": w.note, "seconds": round(w.end - w.start, 1),
        "whole_again_after_s": round(w.recovery_s, 1),
        "sent": len(done), "completed": len(ok),
        "failed": sum(r.error is not None for r in done),
        "truncated": sum(short(r, max_tokens) for r in done),
        "migrated": w.migrations,
        "ttft_p99_ms": round(bench.percentile(ttft, 99), 1) if ttft else None,
        "itl_p99_ms": round(bench.percentile(itl, 99), 1) if itl else None,
        "first_error": next((r.error for r in done if r.error), None),
        "failed_started_at_s": [round(r.start - w.start, 2) for r in done if r.error],
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = ensure_model(Path("models/tiny-llama"))
    etcd, nats = start_etcd(), start_nats()
    env = {**os.environ, "ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats.url,
           "PYTHONUNBUFFERED": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    graph = bench.ManagedProcess(
        [sys.executable, "-m", "dynagraph.cli.main", "serve", f"graphs.{args.graph}:Frontend",
         "-f", f"configs/{args.graph}.yaml", "--Frontend.port=0", f"--Common.model={model_dir}",
         *args.serve_arg], env, name=args.graph)
    windows: list[Window] = []
    results: list[bench.StreamResult] = []
    try:
        graph.wait_line(lambda s: s.startswith("dynamo serve: graph "), 300)
        url = re.search(r"url=(http://\S+)", "\n".join(graph.lines)).group(1)  # type: ignore[union-attr]
        stop = asyncio.Event()
        loader = asyncio.create_task(load(url, stop, results, concurrency=args.concurrency,
                                          max_tokens=args.max_tokens))
        t0 = time.perf_counter()
        await asyncio.sleep(args.warmup)
        windows.append(Window("none (steady)", t0, time.perf_counter()))
        faults = [f for f in args.faults.split(",") if f]
        comps = ["VllmWorker", *(["PrefillWorker"] if args.graph.startswith("disagg") else [])]
        healthy = {c: await instances(etcd.url, c) for c in comps}
        for name in faults:
            w = Window(name, time.perf_counter(), migrations=migrations(graph))
            w.note = await fault(name, graph, etcd, nats, args.stop_seconds)
            log.info("fault %s: %s", name, w.note)
            await asyncio.sleep(max(args.period - (time.perf_counter() - w.start), 0))
            # One fault at a time: the next comes only once the graph is whole again.
            w.recovery_s = await recovered(etcd.url, healthy, args.recovery_timeout)
            w.end = time.perf_counter()
            w.migrations = migrations(graph) - w.migrations
            windows.append(w)
        stop.set()
        await asyncio.wait_for(loader, 180)
    finally:
        graph.stop(timeout=30)
        if args.server_log is not None:
            args.server_log.write_text("\n".join(graph.lines) + "\n")
        nats.stop()
        etcd.stop()
    for r in results:
        start = r.start  # perf_counter, as the windows
        for w in windows:
            if w.start <= start < w.end:
                w.results.append(r)
                break
    rows = [window_stats(w, args.max_tokens) for w in windows]
    total = {"sent": len(results), "failed": sum(r.error is not None for r in results),
             "truncated": sum(short(r, args.max_tokens) for r in results)}
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    return {"graph": args.graph, "args": settings, "machine": bench.machine_info(),
            "total": total, "windows": rows}


def markdown(data: dict[str, Any]) -> str:
    a = data["args"]
    lines = [f"# Chaos under load: {data['graph']}", "",
             f"`python benchmarks/chaos.py --graph {data['graph']}"
             + "".join(f" --serve-arg={x}" for x in a.get("serve_arg") or [])
             + (f" --name {a['name']}" if a.get("name") else "")
             + f"` (faults {a['faults']}; {a['concurrency']} streams "
             f"x {a['max_tokens']} tokens, a fault every {a['period']}s)", "",
             f"Total: {data['total']['sent']} requests, {data['total']['failed']} failed, "
             f"{data['total']['truncated']} truncated.", "",
             "| fault | what | window s | whole again after s | sent | completed | failed "
             "| truncated | migrated | TTFT p99 ms | ITL p99 ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in data["windows"]:
        lines.append(f"| {r['fault']} | {r['what']} | {r['seconds']} | "
                     f"{r.get('whole_again_after_s', '')} | {r['sent']} | {r['completed']} | "
                     f"{r['failed']} | {r['truncated']} | {r['migrated']:.0f} | "
                     f"{r['ttft_p99_ms']} | {r['itl_p99_ms']} |")
    errors = [r["first_error"] for r in data["windows"] if r["first_error"]]
    if errors:
        lines += ["", "First errors:", *[f"- {e}" for e in errors]]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--graph", default="agg_router")
    p.add_argument("--faults", default=None, help=f"comma-separated, from {FAULTS}")
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--warmup", type=float, default=10.0)
    p.add_argument("--period", type=float, default=15.0)
    p.add_argument("--stop-seconds", type=float, default=10.0)
    p.add_argument("--recovery-timeout", type=float, default=420.0,
                   help="seconds to wait for the graph to be whole again after a fault")
    p.add_argument("--server-log", type=Path, default=None,
                   help="write the graph's output (dynamo serve) to this file")
    p.add_argument("--name", default=None, help="results name (default chaos_<graph>)")
    p.add_argument("--serve-arg", action="append", default=[],
                   help="one more argument for dynamo serve (repeatable)")
    args = p.parse_args()
    if args.faults is None:
        disagg = args.graph.startswith("disagg")
        args.faults = ",".join(f for f in FAULTS if disagg or f != "kill-prefill")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("dynagraph").setLevel(logging.WARNING)  # our polls' connect lines
    data = asyncio.run(run(args))
    md = markdown(data)
    bench.write_results(args.name or f"chaos_{args.graph}", data, md)
    print(md)


if __name__ == "__main__":
    main()
