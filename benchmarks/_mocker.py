"""Helpers shared by the mocker benchmarks: serve a mocker graph, read per-engine metrics.

``serve_graph`` runs ``dynamo serve`` (as users run it) on its own etcd and NATS and
yields a :class:`Served` (the process, its URL, how long it took to be ready);
``engine_counters`` sums a worker metric per engine (``worker`` label) over every
process of a component, since one mocker process exports the samples of many engines.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from benchmarks._common import READY_BANNER, ManagedProcess
from dynagraph.runtime.discovery import EtcdDiscovery
from dynagraph.runtime.infra import LocalService, free_port, local_infra


@dataclass
class Served:
    server: ManagedProcess
    url: str
    etcd: LocalService
    nats: LocalService
    ready_s: float
    """What the ready banner says (the supervisor's own clock, from its start)."""
    spawn_to_ready_s: float
    """From spawning ``dynamo serve`` to reading its banner (imports included)."""


@contextlib.contextmanager
def serve_graph(target: str, config: str, overrides: list[str], *,
                ready_timeout: float = 300.0, env: dict[str, str] | None = None
                ) -> Iterator[Served]:
    """``dynamo serve TARGET -f CONFIG OVERRIDES`` on a free Frontend port (``env``:
    the environment, default this process's)."""
    port = free_port()
    with local_infra(etcd=True, nats=True) as infra:
        env = {**(os.environ if env is None else env), "ETCD_ENDPOINTS": infra["etcd"].url,
               "NATS_SERVER": infra["nats"].url, "PYTHONUNBUFFERED": "1"}
        cmd = [sys.executable, "-m", "dynagraph.cli.main", "serve", target, "-f", config,
               f"--Frontend.port={port}", f"--ready-timeout={ready_timeout}", *overrides]
        t0 = time.monotonic()
        server = ManagedProcess(cmd, env, name=target)
        try:
            line, at = server.wait_line(lambda s: "dynamo serve: graph " in s, ready_timeout)
            m = READY_BANNER.search(line)
            yield Served(server, f"http://127.0.0.1:{port}", infra["etcd"], infra["nats"],
                         float(m.group(1)) if m else float("nan"), at - t0)
        finally:
            server.stop()


async def _get(url: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.get(
            url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
        return await resp.text()


async def instance_records(disc: EtcdDiscovery, component: str) -> dict[str, dict[str, Any]]:
    got = await disc.get_prefix(f"/dynamo/instances/{component}/")
    return {k.rsplit("/", 1)[1]: v for k, v in got.items()}


async def engine_counters(disc: EtcdDiscovery, component: str,
                          names: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """Per engine (hex instance id): the value of each metric in ``names``."""
    recs = await instance_records(disc, component)
    out: dict[str, dict[str, float]] = {w: dict.fromkeys(names, 0.0) for w in recs}
    for address in sorted({r["metrics"] for r in recs.values()}):
        text = await _get(f"http://{address}/metrics")
        for name in names:
            for m in re.finditer(rf'^{name}\{{[^}}]*worker="([0-9a-f]+)"[^}}]*\}} (\S+)$',
                                 text, re.M):
                if m.group(1) in out:
                    out[m.group(1)][name] += float(m.group(2))
    return out


def wait_for_calm(max_load: float, max_wait: float) -> tuple[float, float]:
    """Wait until the 1-minute load average is at most ``max_load`` (others share this
    machine), at most ``max_wait`` seconds. Returns (seconds waited, load average)."""
    from benchmarks._common import load_average

    t0 = time.monotonic()
    while load_average() > max_load and time.monotonic() - t0 < max_wait:
        time.sleep(2.0)
    return time.monotonic() - t0, load_average()


def exit_on_sigterm() -> None:
    """Turn SIGTERM into ``SystemExit`` so ``finally`` blocks stop the graphs and the
    etcd/NATS this benchmark started (the default SIGTERM would orphan them)."""
    import signal

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)
