"""Entry point of one component worker process, started by ``dynamo serve``.

    python -m dynagraph.cli.child --spec RUN.json --component NAME --index I

``RUN.json`` is written by the supervisor: the graph target and every component's
resolved config. The process connects to etcd (``ETCD_ENDPOINTS``), exposes its
Prometheus metrics on a free loopback port, runs the component until SIGTERM/SIGINT,
then unregisters (revokes its lease) and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import logging
import os
import signal
import sys
from typing import Any

from dynagraph.cli._logging import setup_logging
from dynagraph.runtime.discovery import discovery_from_env
from dynagraph.sdk._graph import resolve_target
from dynagraph.sdk._runtime import ComponentRuntime

log = logging.getLogger("dynagraph.child")


def die_with_parent(parent_pid: int | None) -> None:
    """Ask the kernel for SIGTERM when the supervisor dies; exit if it already has."""
    if parent_pid is None:
        return
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        raise SystemExit(f"supervisor {parent_pid} is gone")


def start_metrics_server() -> str:
    """Serve this process's default Prometheus registry on a free loopback port."""
    from prometheus_client import start_http_server

    server, _thread = start_http_server(0, addr="127.0.0.1")
    return f"127.0.0.1:{server.server_port}"


async def run(spec: dict[str, Any], component: str, index: int) -> int:
    graph = resolve_target(spec["target"])
    cls = graph.by_name(component)
    values = spec["configs"][component]["values"]
    metrics_address = start_metrics_server()
    discovery = discovery_from_env()
    await discovery.start()
    runtime = ComponentRuntime(graph, cls, values, discovery=discovery, worker_index=index,
                               nats_url=os.environ.get("NATS_SERVER"),
                               metrics_address=metrics_address)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await runtime.start()
        await stop.wait()
        log.info("stopping")
    finally:
        try:
            await runtime.stop()
        finally:
            await discovery.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dynagraph.cli.child")
    parser.add_argument("--spec", required=True)
    parser.add_argument("--component", required=True)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--parent-pid", type=int, default=None)
    args = parser.parse_args(argv)
    die_with_parent(args.parent_pid)
    setup_logging()
    with open(args.spec) as f:
        spec = json.load(f)
    sys.path.insert(0, spec.get("cwd", os.getcwd()))
    try:
        return asyncio.run(run(spec, args.component, args.index))
    except Exception:
        log.exception("%s[%d] failed", args.component, args.index)
        return 1


if __name__ == "__main__":
    code = main()
    # Everything is stopped and unregistered by now: skip interpreter finalization,
    # whose last garbage collection over vLLM/torch objects took 3+ s (measured).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
