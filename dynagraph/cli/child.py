"""Entry point of one component worker process, started by ``dynamo serve``.

    python -m dynagraph.cli.child --spec RUN.json --component NAME --index I

``RUN.json`` is written by the supervisor: the graph target and every component's
resolved config. The process connects to etcd (``ETCD_ENDPOINTS``), exposes its
Prometheus metrics on a free port (or ``DYNAMO_METRICS_PORT``) of this host's address
(``DYNAMO_HOST``, default 127.0.0.1), binds its request plane there too, runs the component
(``engines-per-process``-style components: several instances, see
``dynagraph.sdk._process``) until SIGTERM/SIGINT, then unregisters (revokes its lease)
and exits 0. With a non-loopback ``DYNAMO_HOST`` it refuses to publish any loopback
address (``dynagraph.runtime.addresses``). ``DYNAMO_SERVE_ID`` (set by ``dynamo serve``)
is published with each instance as ``serve_id``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import gc
import json
import logging
import os
import signal
import sys
from collections.abc import Mapping
from typing import Any

from dynagraph.aio import cancel_and_wait
from dynagraph.cli._logging import exit_now, setup_logging
from dynagraph.cli.serve_part import SERVE_ID_ENV
from dynagraph.errors import ConfigError, InfraError
from dynagraph.observability.task_dump import install_task_dump
from dynagraph.runtime import event_loop
from dynagraph.runtime.addresses import host_from_env, publish_guard
from dynagraph.runtime.discovery import discovery_from_env
from dynagraph.sdk._config import callees_first, instances_per_process
from dynagraph.sdk._graph import resolve_target
from dynagraph.sdk._process import ProcessInstances

log = logging.getLogger("dynagraph.child")


def die_with_parent(parent_pid: int | None) -> None:
    """Ask the kernel for SIGTERM when the supervisor dies; exit if it already has."""
    if parent_pid is None:
        return
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        raise SystemExit(f"supervisor {parent_pid} is gone")


def metrics_bind(environ: Mapping[str, str]) -> tuple[str, int]:
    """Where the metrics server listens: ``DYNAMO_HOST`` (default 127.0.0.1), on a free
    port, or with ``DYNAMO_METRICS_PORT`` set (Kubernetes: a fixed port Prometheus and
    the probes know) on that port. A fixed port means one worker per host."""
    host = host_from_env(environ)
    raw = environ.get("DYNAMO_METRICS_PORT", "").strip()
    if not raw:
        return host, 0
    if not raw.isdigit() or not 1 <= int(raw) <= 65535:
        raise ConfigError(f"{raw!r} is not a TCP port", key="DYNAMO_METRICS_PORT")
    return host, int(raw)


def start_metrics_server() -> str:
    """Serve this process's default Prometheus registry (see `metrics_bind`); returns
    ``host:port``."""
    from prometheus_client import start_http_server

    host, port = metrics_bind(os.environ)
    try:
        server, _thread = start_http_server(port, addr=host)
    except OSError as exc:
        raise InfraError(f"cannot serve metrics on {host}:{port} (DYNAMO_METRICS_PORT): "
                         f"{exc.strerror}; a fixed port takes one worker per host") from exc
    return f"{host}:{server.server_port}"


async def run(spec: dict[str, Any], component: str, index: int) -> int:
    graph = resolve_target(spec["target"])
    host = host_from_env()
    metrics_address = start_metrics_server()
    serve_id = os.environ.get(SERVE_ID_ENV)

    def new_discovery() -> Any:
        discovery = discovery_from_env()
        discovery.publish_check = publish_guard(host)
        return discovery

    def instances_of(name: str, *, embedded: bool = False) -> ProcessInstances:
        node = graph.by_name(name)
        vals = spec["configs"][name]["values"]
        return ProcessInstances(graph, node, vals, count=instances_per_process(node, vals),
                                new_discovery=new_discovery, worker_index=index,
                                nats_url=os.environ.get("NATS_SERVER"),
                                metrics_address=metrics_address, host=host,
                                labels={"serve_id": serve_id} if serve_id else None,
                                embedded=embedded)

    # components embedded in this one (ServiceArgs.embed-in) start first, callees before
    # their callers, so each finds what it calls when it starts; they stop last, after
    # their callers have drained
    guests = [instances_of(n, embedded=True) for n in callees_first(graph, [
        n for n, c in spec["configs"].items() if c["service_args"].get("embed-in") == component])]
    parts = [*guests, instances_of(component)]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    install_task_dump(loop)
    started: list[ProcessInstances] = []
    try:
        for part in parts:
            started.append(part)
            if not await _start_unless_stopped(part, stop):
                log.info("stopped while starting")
                return 0
        log.debug("froze %d start-up objects", freeze_startup_heap())
        cache_vllm_envs()
        await stop.wait()
        log.info("stopping")
    finally:
        for part in reversed(started):
            await part.stop()
    return 0


def cache_vllm_envs() -> None:
    """Where an engine runs in this process, let ``vllm.envs`` read each setting once from
    now on, as vLLM's engine core does once it is up (vLLM reads some per output: about 5%
    of a sampled profile of the one-process agg graph at 64 streams)."""
    envs = sys.modules.get("vllm.envs")
    if envs is not None:
        envs.enable_envs_cache()


def freeze_startup_heap() -> int:
    """Once the process is up, as vLLM's own server does: collect, then freeze what
    survived start-up (modules, the tokenizer, an engine's tables) so the collector's
    oldest-generation passes while serving scan only what serving made. Returns how many
    objects it froze."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def _start_unless_stopped(instances: ProcessInstances, stop: asyncio.Event) -> bool:
    """Start the component; a stop signal during its start hooks (an engine loading)
    cancels the start instead of waiting for it. True if it started."""
    starting = asyncio.create_task(instances.start(), name="component-start")
    stopped = asyncio.create_task(stop.wait(), name="stop-signal")
    await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if starting.done():
        stopped.cancel()
        starting.result()  # a failed start raises here
        return True
    await cancel_and_wait([starting], timeout=10)
    return False


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
        return event_loop.run(lambda: run(spec, args.component, args.index), os.environ)
    except ConfigError as exc:
        log.error("%s[%d] cannot start: %s", args.component, args.index, exc)
        return 1
    except Exception:
        log.exception("%s[%d] failed", args.component, args.index)
        return 1


if __name__ == "__main__":
    exit_now(main())
