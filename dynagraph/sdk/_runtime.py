"""Runs one instance of one component inside the current process.

Order on start: dependency clients (watches warm) -> construction
(``cls(config, runtime=..., **dependency_clients)``) ->
``@async_on_start`` hooks -> request-plane server -> endpoint registration -> instance
record. So "registered" means "ready to serve". Order on stop: registrations withdrawn
(callers stop choosing this instance) -> server stops accepting, cancels subscriptions
and drains requests in flight (grace) -> ``@async_on_shutdown`` hooks -> clients closed
-> lease revoked, which removes every other key of this process at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from dynagraph.errors import DiscoveryError, InvalidRequest
from dynagraph.runtime import progress
from dynagraph.runtime.discovery import instance_key
from dynagraph.runtime.rpc import RequestContext, RpcClient, RpcServer
from dynagraph.sdk._client import ClientFactory, ComponentClient
from dynagraph.sdk._config import build_config
from dynagraph.sdk._context import (
    RuntimeContext,
    process_key,
    reset_request_id,
    set_request_id,
    starting_key,
)
from dynagraph.sdk._graph import Graph
from dynagraph.sdk._service import EndpointSpec, spec_of
from dynagraph.sdk._typed import decoder

log = logging.getLogger(__name__)

DRAIN_GRACE_ENV = "DYNAMO_DRAIN_GRACE_S"
"""Seconds a stopping instance lets its requests in flight finish (``dynamo serve
--drain-grace``; an explicit ``drain_grace`` wins)."""
DRAIN_GRACE_S = 1.0
"""The default: a graph with streams running stops in ~1-1.5 s (``benchmarks/teardown.py``;
the issue's bar is 2 s). Streams cut on a retired worker of a running graph migrate."""


class ComponentRuntime:
    """Owns the pieces one component instance needs; use ``start()`` / ``stop()``."""

    def __init__(self, graph: Graph, cls: type, values: dict[str, Any], *, discovery: Any,
                 worker_index: int = 0, nats_url: str | None = None,
                 metrics_address: str | None = None, drain_grace: float | None = None,
                 report_ready: bool = True, host: str = "127.0.0.1",
                 labels: dict[str, Any] | None = None, local_calls: bool = False) -> None:
        """``report_ready=False``: do not tell ``dynamo serve`` this instance is ready (a
        ``ProcessInstances`` of several tells it once, for all). ``local_calls``: callers in
        this process reach its endpoints without the socket (an embedded component)."""
        self.report_ready = report_ready
        self.local_calls = local_calls
        self.graph = graph
        self.cls = cls
        self.spec = spec_of(cls)
        self.values = values
        self.discovery = discovery
        self.worker_index = worker_index
        self.nats_url = nats_url
        self.metrics_address = metrics_address
        self.drain_grace = (drain_grace if drain_grace is not None
                            else float(os.environ.get(DRAIN_GRACE_ENV, DRAIN_GRACE_S)))
        self.host = host
        """Where the request-plane server binds; its published address (``--host``)."""
        self.labels = dict(labels or {})
        """Published with the instance (``dynamo serve`` tells its own instances apart)."""
        self.rpc_client = RpcClient()
        self.clients = ClientFactory(self.rpc_client, discovery)
        self.server: RpcServer | None = None
        self.instance: Any = None

    async def start(self) -> Any:
        """Build the component and publish it; returns the component instance."""
        label = f"{self.spec.name}[{self.worker_index}]"
        ident = {"pid": os.getpid(), "host": socket.gethostname(),
                 "worker_index": self.worker_index, "started_at": _process_start_time(),
                 **self.labels}
        starting = starting_key(self.spec.namespace, self.spec.name, self.discovery.instance_id)
        await self.discovery.put(starting, ident, lease=True)
        deps = {attr: await self._client_for(target) if target is not None else None
                for attr, target in self.graph.edges(self.cls).items()}
        runtime = RuntimeContext(
            namespace=self.spec.namespace, component=self.spec.name,
            worker_index=self.worker_index, instance_id=self.discovery.instance_id,
            discovery=self.discovery, nats_url=self.nats_url,
            metrics_address=self.metrics_address, clients=self.clients,
        )
        if self.spec.config_param is not None:
            obj = self.cls(build_config(self.cls, self.values), runtime=runtime, **deps)
        else:
            obj = self.cls(runtime=runtime, **deps)
        self.instance = obj
        for hook in self.spec.on_start:
            await getattr(obj, hook)()
        server = RpcServer(host=self.host, local_calls=self.local_calls)
        for ep in self.spec.endpoints:
            server.add_endpoint(ep.name, _handler(obj, ep, self.spec.name), drain=ep.drain)
        await server.start()
        self.server = server
        meta = {**ident, "metrics": self.metrics_address, "ready_at": time.time(),
                **runtime.metadata}
        for ep in self.spec.endpoints:
            await self.discovery.register(self.spec.namespace, self.spec.name, ep.name,
                                          server.address, meta)
        await self.discovery.put(
            process_key(self.spec.namespace, self.spec.name, self.discovery.instance_id),
            {"address": server.address, "endpoints": [e.name for e in self.spec.endpoints], **meta},
            lease=True,
        )
        await self.discovery.delete(starting)
        if self.report_ready:
            progress.report("ready", f"instance {self.discovery.instance_id:x} at {server.address}",
                            label=label, address=server.address,
                            url=runtime.metadata.get("url"))
        return obj

    async def stop(self) -> None:
        """Withdraw from discovery, drain, run shutdown hooks, close clients; the caller
        closes discovery (revoking the lease)."""
        if self.server is not None:
            await self._withdraw()
            await self.server.stop(grace=self.drain_grace)
        if self.instance is not None:
            for hook in self.spec.on_shutdown:
                try:
                    await asyncio.wait_for(getattr(self.instance, hook)(), timeout=10)
                except Exception:
                    log.exception("shutdown hook %s.%s failed", self.spec.name, hook)
        await self.clients.close()
        await self.rpc_client.close()

    async def _withdraw(self) -> None:
        """Delete this instance's registrations first, so callers stop choosing it while
        its requests in flight drain (bounded: a slow etcd must not hold up a stop)."""
        ns, name, iid = self.spec.namespace, self.spec.name, self.discovery.instance_id
        keys = [instance_key(ns, name, ep.name, iid) for ep in self.spec.endpoints]
        try:
            async with asyncio.timeout(1.0):
                for key in [*keys, process_key(ns, name, iid)]:
                    await self.discovery.delete(key)
        except (TimeoutError, DiscoveryError) as exc:
            log.warning("could not withdraw from discovery before draining: %s", exc)

    async def _client_for(self, target: type) -> ComponentClient:
        tspec = spec_of(target)
        return await self.clients.component(
            tspec.namespace, tspec.name, {ep.name: ep.response_type for ep in tspec.endpoints})


def _process_start_time() -> float:
    """When this process started (seconds since the epoch): the instance's uptime origin."""
    import psutil

    return float(psutil.Process().create_time())


def _invalid_request(message: str, param: str | None) -> Exception:
    return InvalidRequest(message, param=param)


def _handler(obj: Any, ep: EndpointSpec, component: str
             ) -> Callable[[Any, RequestContext], AsyncIterator[Any]]:
    method = getattr(obj, ep.method_name)
    decode = decoder(ep.request_type, f"{component}.{ep.name}", _invalid_request)

    async def handle(payload: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        token = set_request_id(ctx.request_id)
        try:
            request = decode(payload)
            async for item in method(request):
                yield item
        finally:
            reset_request_id(token)

    return handle
