"""What the graph's processes share, set up by ``dynamo serve`` before they start.

:class:`GraphInfra` is mixed into ``dynagraph.cli.serve.Supervisor``, which provides its
attributes, and stops what it started (``services``, in reverse order) when the graph
stops. It gives the children:

- etcd and NATS: ``$ETCD_ENDPOINTS`` / ``$NATS_SERVER`` if set, else a local one started
  (and owned) here (``_infra_env``);
- the graph secret tenant identities are signed with (``_graph_secret``);
- a Prometheus ``file_sd`` targets file for the graph (``_start_targets``; never fatal);
- the run spec every child reads: the target, cwd, configs and infra URLs
  (``_write_spec``).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from dynagraph.errors import GraphError
from dynagraph.observability.graph_targets import GraphTargets
from dynagraph.runtime.infra import LocalService, start_etcd, start_nats
from dynagraph.runtime.secret import SECRET_ENV, new_secret
from dynagraph.sdk._config import ComponentConfig
from dynagraph.sdk._graph import Graph
from dynagraph.sdk._service import spec_of

if TYPE_CHECKING:
    from dynagraph.runtime.discovery import Discovery

log = logging.getLogger("dynagraph.serve")


class GraphInfra:
    """The supervisor's part that sets up what its children share
    (``dynagraph.cli.serve.Supervisor`` provides these attributes)."""

    target: str
    graph: Graph
    configs: dict[str, ComponentConfig]
    services: list[LocalService]
    _tmp: tempfile.TemporaryDirectory[str]

    async def _start_targets(self, discovery: Any, env: dict[str, str]) -> GraphTargets | None:
        """Prometheus file_sd targets for this graph (never fatal: logs and goes on)."""
        monitor = next((s.extra["monitor_url"] for s in self.services
                        if "monitor_url" in s.extra), None)
        try:
            return await GraphTargets.start(
                discovery, {spec_of(c).namespace for c in self.graph.nodes}, env, self._tmp.name,
                nats_monitor_url=monitor)
        except Exception as exc:
            log.warning("no Prometheus targets file: %s", exc)
            return None

    async def _graph_secret(self, discovery: Discovery) -> str:
        """``$DYNAGRAPH_GRAPH_SECRET``, else the namespace's secret in etcd (made by the first
        ``dynamo serve`` of the namespace): every serve of one graph, on any host, signs and
        verifies tenant identities with the same key."""
        given = os.environ.get(SECRET_ENV)
        if given:
            return given
        namespace = min(spec_of(c).namespace for c in self.graph.nodes)
        stored = await discovery.put_if_absent(f"/{namespace}/graph-secret", new_secret())
        if not isinstance(stored, str):
            raise GraphError(f"/{namespace}/graph-secret in etcd is not a string")
        return stored

    def _infra_env(self) -> dict[str, str]:
        return {"ETCD_ENDPOINTS": self._service_url("ETCD_ENDPOINTS", start_etcd),
                "NATS_SERVER": self._service_url("NATS_SERVER", start_nats)}

    def _service_url(self, var: str, start: Callable[[], LocalService]) -> str:
        """``$var`` if set, else the URL of a local service started (and owned) here."""
        url = os.environ.get(var)
        if url:
            return url
        svc = start()
        self.services.append(svc)
        log.info("%s not set: started a local %s at %s", var, svc.name, svc.url)
        return svc.url

    def _write_spec(self, env: dict[str, str]) -> str:
        spec = {
            "target": self.target,
            "cwd": os.getcwd(),
            "configs": {n: {"values": c.values, "service_args": c.service_args.model_dump()}
                        for n, c in self.configs.items()},
            **env,
        }
        path = os.path.join(self._tmp.name, "run.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        return path
