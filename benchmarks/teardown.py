"""How fast a served vLLM graph stops, and what it leaves behind.

    python benchmarks/teardown.py                     # agg, agg_router, disagg_router
    python benchmarks/teardown.py --graphs agg --rounds 3
    python benchmarks/teardown.py --drain-grace 0.5   # streams get 0.5 s to finish

Each round: ``dynamo serve graphs.<graph>:Frontend -f configs/<graph>.yaml`` against an
etcd and a NATS this script owns, a few requests (so engines, KV events and NIXL have
worked), optionally ``--busy`` streams still running, then SIGTERM to ``dynamo serve``
and the time until it exits. Then, leftovers: processes it had started still alive,
keys left in etcd under ``/dynamo/`` (leases not revoked), TCP listeners on the NIXL
side-channel ports the graph published. Target: <= 2 s, nothing left. With streams
running, ``dynamo serve`` first gives them ``--drain-grace`` to finish (3 s by default).
Results: ``benchmarks/results/teardown.{json,md}`` (``teardown_drain_<S>`` with a grace).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import ManagedProcess, machine_info, percentile, write_results  # noqa: E402
from dynagraph.runtime.infra import start_etcd, start_nats  # noqa: E402
from tools.model_builder import ensure_model  # noqa: E402

MODEL = "tiny-llama"


KEPT_KEYS = {"/dynamo/graph-secret"}
"""Kept on purpose between runs: every serve of the namespace shares the graph secret."""


def etcd_keys(url: str, prefix: str = "/dynamo/") -> list[str]:
    """Keys a stopped graph left behind (lease-bound records not revoked)."""
    out = subprocess.run(["etcdctl", f"--endpoints={url}", "get", "--prefix", "--keys-only",
                          prefix], env={**os.environ, "ETCDCTL_API": "3"}, capture_output=True,
                         text=True, timeout=10, check=True)
    return [k for k in out.stdout.split() if k and k not in KEPT_KEYS]


def descendants(pid: int) -> dict[int, str]:
    """Every process below ``pid`` (component processes, vLLM engine cores, ...)."""
    import psutil

    out = {}
    for child in psutil.Process(pid).children(recursive=True):
        try:
            out[child.pid] = " ".join(child.cmdline())[:120]
        except psutil.Error:
            continue
    return out


def still_alive(procs: dict[int, str]) -> list[str]:
    import psutil

    left = []
    for pid, cmd in procs.items():
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(f"{pid} {cmd}")
        except psutil.NoSuchProcess:
            continue
    return left


def listening_ports() -> set[int]:
    ports = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        parts = line.split()
        if parts[3] == "0A":  # LISTEN
            ports.add(int(parts[1].split(":")[1], 16))
    return ports


async def drive(url: str, n: int, busy: int) -> list[asyncio.Task[Any]]:
    import httpx

    async with httpx.AsyncClient(timeout=120) as http:
        for i in range(n):
            prompt = f"Request {i}: " + "tell me about the sea. " * (10 + 60 * (i % 2))
            r = await http.post(f"{url}/v1/completions", json={
                "model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0})
            r.raise_for_status()

    async def endless(i: int) -> None:
        async with httpx.AsyncClient(timeout=120) as http:
            async with http.stream("POST", f"{url}/v1/completions", json={
                    "model": MODEL, "prompt": f"Busy {i}", "max_tokens": 900, "stream": True,
                    "ignore_eos": True}) as resp:
                async for _ in resp.aiter_lines():
                    pass

    tasks = [asyncio.create_task(endless(i)) for i in range(busy)]
    await asyncio.sleep(1.0 if busy else 0)
    return tasks


def one_round(graph: str, model_dir: Path, busy: int,
              drain_grace: float | None = None) -> dict[str, Any]:
    etcd, nats = start_etcd(), start_nats()
    env = {**os.environ, "ETCD_ENDPOINTS": etcd.url, "NATS_SERVER": nats.url,
           "PYTHONUNBUFFERED": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    proc = ManagedProcess([sys.executable, "-m", "dynagraph.cli.main", "serve",
                           f"graphs.{graph}:Frontend", "-f", f"configs/{graph}.yaml",
                           "--Frontend.port=0", f"--Common.model={model_dir}",
                           *([f"--drain-grace={drain_grace:g}"] if drain_grace is not None else [])],
                          env, name=graph)
    try:
        proc.wait_line(lambda s: s.startswith("dynamo serve: graph "), 300)
        url = re.search(r"url=(http://\S+)", "\n".join(proc.lines)).group(1)  # type: ignore[union-attr]
        nixl_ports = [int(json.loads(v)["port"]) for v in _etcd_values(etcd.url, "/dynamo/nixl/")]
        loop = asyncio.new_event_loop()
        tasks = loop.run_until_complete(drive(url, 4, busy))
        procs = descendants(proc.pid)
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        proc.proc.wait(timeout=60)
        took = time.monotonic() - t0
        loop.run_until_complete(_cancelled(tasks))
        loop.close()
        left = still_alive(procs)
        keys = etcd_keys(etcd.url)
        listeners = sorted(set(nixl_ports) & listening_ports())
        return {"graph": graph, "busy_streams": busy, "drain_grace_s": drain_grace,
                "stop_s": round(took, 2),
                "exit_code": proc.proc.returncode, "processes_left": left, "etcd_keys_left": keys,
                "nixl_listeners_left": listeners}
    finally:
        proc.stop(timeout=10)
        nats.stop()
        etcd.stop()


async def _cancelled(tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel the streams still running (inside their loop: gather needs it running)."""
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _etcd_values(url: str, prefix: str) -> list[str]:
    out = subprocess.run(["etcdctl", f"--endpoints={url}", "get", "--prefix",
                          "--print-value-only", prefix], env={**os.environ, "ETCDCTL_API": "3"},
                         capture_output=True, text=True, timeout=10, check=True)
    return [line for line in out.stdout.splitlines() if line.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--graphs", default="agg,agg_router,disagg_router")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--busy", type=int, default=2, help="streams still running at SIGTERM "
                   "(every other round; 0 in the others)")
    p.add_argument("--drain-grace", type=float, default=None, metavar="S",
                   help="dynamo serve's --drain-grace (default: its own, 3 s)")
    args = p.parse_args()
    model_dir = ensure_model(Path("models/tiny-llama"))
    rows = []
    for graph in args.graphs.split(","):
        for r in range(args.rounds):
            row = one_round(graph, model_dir, args.busy if r % 2 else 0, args.drain_grace)
            print(json.dumps(row), flush=True)
            rows.append(row)
    grace = f" --drain-grace {args.drain_grace:g}" if args.drain_grace is not None else ""
    md = ["# Stopping a served vLLM graph", "",
          f"`python benchmarks/teardown.py --graphs {args.graphs} --rounds {args.rounds}{grace}`",
          "",
          "| graph | streams running | stop s | exit | processes left | etcd keys left "
          "| NIXL listeners left |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        md.append(f"| {row['graph']} | {row['busy_streams']} | {row['stop_s']} | "
                  f"{row['exit_code']} | {len(row['processes_left'])} | "
                  f"{len(row['etcd_keys_left'])} | {len(row['nixl_listeners_left'])} |")
    stops = [row["stop_s"] for row in rows]
    md += ["", f"Stop time: median {percentile(stops, 50):.2f} s, max {max(stops):.2f} s "
           "(target <= 2 s, nothing left)."]
    name = "teardown" if args.drain_grace is None else f"teardown_drain_{args.drain_grace:g}"
    write_results(name, {"machine": machine_info(), "rounds": rows}, "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
