"""Runs one instance of one component inside the current process.

Order on start: dependency clients (watches warm) -> construction
(``cls(config, runtime=..., **dependency_clients)``) ->
``@async_on_start`` hooks -> request-plane server -> endpoint registration -> instance
record. So "registered" means "ready to serve". Order on stop: server stops accepting
and drains (grace) -> ``@async_on_shutdown`` hooks -> clients closed -> lease revoked,
which removes every key of this process at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from pydantic import BaseModel, ValidationError

from dynagraph.errors import InvalidRequest
from dynagraph.runtime.rpc import RequestContext, RpcClient, RpcServer
from dynagraph.sdk._client import ClientFactory, ComponentClient
from dynagraph.sdk._config import build_config
from dynagraph.sdk._context import (
    RuntimeContext,
    process_key,
    reset_request_id,
    set_request_id,
)
from dynagraph.sdk._graph import Graph
from dynagraph.sdk._service import EndpointSpec, spec_of

log = logging.getLogger(__name__)


class ComponentRuntime:
    """Owns the pieces one component instance needs; use ``start()`` / ``stop()``."""

    def __init__(self, graph: Graph, cls: type, values: dict[str, Any], *, discovery: Any,
                 worker_index: int = 0, nats_url: str | None = None,
                 metrics_address: str | None = None, drain_grace: float = 3.0) -> None:
        self.graph = graph
        self.cls = cls
        self.spec = spec_of(cls)
        self.values = values
        self.discovery = discovery
        self.worker_index = worker_index
        self.nats_url = nats_url
        self.metrics_address = metrics_address
        self.drain_grace = drain_grace
        self.rpc_client = RpcClient()
        self.clients = ClientFactory(self.rpc_client, discovery)
        self.server: RpcServer | None = None
        self.instance: Any = None

    async def start(self) -> Any:
        """Build the component and publish it; returns the component instance."""
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
        server = RpcServer()
        for ep in self.spec.endpoints:
            server.add_endpoint(ep.name, _handler(obj, ep, self.spec.name))
        await server.start()
        self.server = server
        meta = {"pid": os.getpid(), "worker_index": self.worker_index,
                "metrics": self.metrics_address, **runtime.metadata}
        for ep in self.spec.endpoints:
            await self.discovery.register(self.spec.namespace, self.spec.name, ep.name,
                                          server.address, meta)
        await self.discovery.put(
            process_key(self.spec.namespace, self.spec.name, self.discovery.instance_id),
            {"address": server.address, "endpoints": [e.name for e in self.spec.endpoints], **meta},
            lease=True,
        )
        log.info("%s[%d] ready: instance %x at %s", self.spec.name, self.worker_index,
                 self.discovery.instance_id, server.address)
        return obj

    async def stop(self) -> None:
        """Drain, run shutdown hooks, close clients; the caller closes discovery."""
        if self.server is not None:
            await self.server.stop(grace=self.drain_grace)
        if self.instance is not None:
            for hook in self.spec.on_shutdown:
                try:
                    await asyncio.wait_for(getattr(self.instance, hook)(), timeout=10)
                except Exception:
                    log.exception("shutdown hook %s.%s failed", self.spec.name, hook)
        await self.clients.close()
        await self.rpc_client.close()

    async def _client_for(self, target: type) -> ComponentClient:
        tspec = spec_of(target)
        return await self.clients.component(tspec.namespace, tspec.name,
                                            [ep.name for ep in tspec.endpoints])


def _decoder(request_type: type | None, where: str) -> Callable[[Any], Any]:
    """payload -> typed request; failures become InvalidRequest naming the field."""
    if request_type is None:
        return lambda payload: payload
    if issubclass(request_type, BaseModel):
        model: type[BaseModel] = request_type

        def from_pydantic(payload: Any) -> Any:
            try:
                return model.model_validate(payload)
            except ValidationError as exc:
                err = exc.errors()[0]
                loc = ".".join(str(p) for p in err["loc"])
                raise InvalidRequest(f"{where}: {loc}: {err['msg']}", param=loc or None) from None

        return from_pydantic

    def from_struct(payload: Any) -> Any:
        try:
            return msgspec.convert(payload, request_type)
        except msgspec.ValidationError as exc:
            raise InvalidRequest(f"{where}: {exc}") from None

    return from_struct


def _handler(obj: Any, ep: EndpointSpec, component: str
             ) -> Callable[[Any, RequestContext], AsyncIterator[Any]]:
    method = getattr(obj, ep.method_name)
    decode = _decoder(ep.request_type, f"{component}.{ep.name}")

    async def handle(payload: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        token = set_request_id(ctx.request_id)
        try:
            request = decode(payload)
            async for item in method(request):
                yield item
        finally:
            reset_request_id(token)

    return handle
