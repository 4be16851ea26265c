"""What ``dynamo serve`` runs so Prometheus can find every process of its graph.

- a ``file_sd`` target file (``FileSdWriter``) listing every component process's
  metrics address, kept current from discovery, plus etcd (``job="etcd"``, its
  ``/metrics`` on the client URL) and the NATS exporter (``job="nats"``);
- a NATS exporter (``nats_exporter``) on a free loopback port when the NATS
  monitoring URL is known: the nats-server ``dynamo serve`` started itself, or
  ``NATS_MONITOR_URL``.

The file is ``$DYNAMO_PROMETHEUS_SD`` if set (e.g. ``deploy/targets/dynagraph.json`` for
the compose stack), else ``prometheus_targets.json`` in the graph's temporary state
directory (printed after the ready banner). Point Prometheus at it with
``scripts/prometheus.sh FILE`` or a ``file_sd_configs`` entry.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import urlparse

from dynagraph.observability import nats_exporter
from dynagraph.observability.file_sd import FileSdWriter, PrefixWatcher, TargetGroup, static_target

log = logging.getLogger(__name__)

ENV_PATH = "DYNAMO_PROMETHEUS_SD"
ENV_NATS_MONITOR = "NATS_MONITOR_URL"
DEFAULT_NAME = "prometheus_targets.json"


def etcd_targets(endpoints: str) -> list[TargetGroup]:
    """One ``job="etcd"`` target per ``ETCD_ENDPOINTS`` entry (host:port)."""
    out = []
    for ep in filter(None, (e.strip() for e in endpoints.split(","))):
        u = urlparse(ep if "://" in ep else f"http://{ep}")
        if u.hostname and u.port:
            out.append(static_target(f"{u.hostname}:{u.port}", "etcd"))
    return out


class GraphTargets:
    """The target file and the NATS exporter of one running graph."""

    def __init__(self, writer: FileSdWriter, exporter: Any | None) -> None:
        self.writer = writer
        self.exporter = exporter

    @property
    def path(self) -> str:
        return self.writer.path

    @classmethod
    async def start(cls, discovery: PrefixWatcher, namespaces: Iterable[str],
                    env: Mapping[str, str], state_dir: str,
                    nats_monitor_url: str | None = None) -> GraphTargets:
        path = os.environ.get(ENV_PATH) or os.path.join(state_dir, DEFAULT_NAME)
        static = etcd_targets(env.get("ETCD_ENDPOINTS", ""))
        exporter = None
        monitor = nats_monitor_url or os.environ.get(ENV_NATS_MONITOR)
        if monitor:
            exporter, address = nats_exporter.serve(monitor)
            static.append(static_target(address, "nats"))
        writer = FileSdWriter(discovery, namespaces, path, static)
        try:
            await writer.start()
        except BaseException:
            _stop_server(exporter)
            raise
        log.info("Prometheus file_sd targets: %s", path)
        return cls(writer, exporter)

    async def close(self) -> None:
        try:
            await self.writer.close()
        finally:
            _stop_server(self.exporter)
            self.exporter = None


def _stop_server(server: Any | None) -> None:
    if server is not None:
        with contextlib.suppress(Exception):
            server.shutdown()
            server.server_close()
