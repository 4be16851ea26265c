"""Clients that a ``depends()`` attribute turns into at run time.

``self.worker.generate(req)`` calls the dependency's ``generate`` endpoint on the next
instance in round-robin order; ``at_random(self.worker.generate, req)`` picks one at
random; ``direct(self.worker.generate, req, id)`` calls exactly that instance. Each
returns an async iterator of the endpoint's declared item type (decoded here, once);
closing it (or cancelling the task consuming it) cancels the remote call. Round robin
and random retry on another live instance when the request could not be delivered, and
prefer an instance running in this very process (``ServiceArgs.embed-in``) when there is
one. The free functions are typed on the endpoint (``Callable[[R], AsyncIterator[T]]``),
so mypy checks the request and the items at every hop.
"""

from __future__ import annotations

import asyncio
import contextlib
import random as _random
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

from dynagraph.aio import aclose
from dynagraph.errors import InstanceUnavailable, InvalidResponse, NoInstancesError
from dynagraph.runtime.round_robin import RoundRobin
from dynagraph.runtime.rpc import NOT_READY, has_local_servers, local_server
from dynagraph.sdk._context import REQUEST_ID_HEADER, current_request_id
from dynagraph.sdk._typed import decoder

C = TypeVar("C")
R = TypeVar("R")
T = TypeVar("T")


class InstanceSource(Protocol):
    """The live instance list of one endpoint (``InstanceWatch`` satisfies it)."""

    def instances(self) -> list[Any]: ...


class Caller(Protocol):
    """The request plane (``RpcClient`` satisfies it)."""

    def call(
        self, address: str, endpoint: str, payload: Any, *, headers: dict[str, str] | None = None
    ) -> AsyncIterator[Any]: ...


class EndpointClient:
    """Calls one endpoint of one component, choosing among its live instances.

    Items are decoded into ``response_type`` (the endpoint's declared item type; None:
    plain values); one that does not fit raises ``InvalidResponse``. Calling the client
    is ``round_robin``.
    """

    def __init__(self, caller: Caller, source: InstanceSource, component: str, endpoint: str,
                 rng: _random.Random | None = None, *, wait_timeout: float = 2.0,
                 response_type: type | None = None) -> None:
        self._caller = caller
        self.wait_timeout = wait_timeout
        self._source = source
        self.component = component
        self.endpoint = endpoint
        self.response_type = response_type
        self._decode = decoder(response_type, f"{component}.{endpoint} answered",
                               _invalid_response)
        self._rr = RoundRobin()
        self._rng = rng or _random.Random()

    def __call__(self, request: Any, *, headers: dict[str, str] | None = None
                 ) -> AsyncGenerator[Any, None]:
        return self.round_robin(request, headers=headers)

    def instances(self) -> list[Any]:
        return self._source.instances()

    def instance_ids(self) -> list[int]:
        return [i.instance_id for i in self._source.instances()]

    def round_robin(self, request: Any, *, headers: dict[str, str] | None = None) -> AsyncGenerator[Any, None]:
        return self._with_retry(request, self._rr.pick, headers)

    def random(self, request: Any, *, headers: dict[str, str] | None = None) -> AsyncGenerator[Any, None]:
        return self._with_retry(request, self._rng.choice, headers)

    async def _await_any(self) -> None:
        """Right after start-up the watch may lag etcd by a few ms: give it a moment."""
        wait_for = getattr(self._source, "wait_for", None)
        if self._source.instances() or wait_for is None or self.wait_timeout <= 0:
            return
        with contextlib.suppress(Exception):
            await wait_for(1, timeout=self.wait_timeout)

    async def _await_new(self, failed: set[int]) -> list[Any]:
        """Every known instance refused: a replacement may be registering right now."""
        deadline = asyncio.get_running_loop().time() + self.wait_timeout
        while asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
            live = [i for i in self._source.instances() if i.instance_id not in failed]
            if live:
                return live
        return []

    async def direct(self, request: Any, instance_id: int, *,
                     headers: dict[str, str] | None = None,
                     merge: Callable[[Any, Any], Any | None] | None = None
                     ) -> AsyncGenerator[Any, None]:
        """The stream of ``instance_id``'s endpoint. ``merge(a, b)``: items that arrived
        while this reader was busy are merged into one where it returns one (None: keep
        them apart), so a reader that falls behind catches up in fewer, larger steps
        (never waiting for more: the first item goes on as it came)."""
        inst = await self._instance(instance_id)
        it = self._caller.call(inst.address, self.endpoint, request, headers=_headers(headers))
        take = getattr(it, "take_ready", None) if merge is not None else None
        decode = self._decode
        try:
            async for item in it:
                if take is not None and merge is not None:
                    while (more := take()) is not NOT_READY:
                        merged = merge(item, more)
                        if merged is None:
                            yield decode(item)
                            merged = more
                        item = merged
                yield decode(item)
        finally:
            await aclose(it)

    async def _instance(self, instance_id: int) -> Any:
        """The live instance ``instance_id``; a just-created watch may lag by a few ms."""
        deadline = asyncio.get_running_loop().time() + self.wait_timeout
        while True:
            for inst in self._source.instances():
                if inst.instance_id == instance_id:
                    return inst
            if asyncio.get_running_loop().time() >= deadline or getattr(
                    self._source, "wait_for", None) is None:
                raise NoInstancesError(
                    f"{self.component}/{self.endpoint}: no live instance {instance_id:x}")
            await asyncio.sleep(0.02)

    async def _with_retry(self, request: Any, pick: Callable[[list[Any]], Any],
                          headers: dict[str, str] | None) -> AsyncGenerator[Any, None]:
        headers = _headers(headers)
        await self._await_any()

        async def next_instance(failed: list[Any]) -> Any | None:
            ids = {i.instance_id for i in failed}
            live = [i for i in self._source.instances() if i.instance_id not in ids]
            if not live and failed:
                live = await self._await_new(ids)
            return pick(nearest(live)) if live else None

        def no_instance(last: Exception | None) -> Exception:
            what = "reachable " if last is not None else ""
            return NoInstancesError(f"no {what}instance of {self.component}/{self.endpoint}")

        stream = failover(
            next_instance,
            lambda inst: self._caller.call(inst.address, self.endpoint, request, headers=headers),
            retry_on=(InstanceUnavailable,), exhausted=no_instance)
        decode = self._decode
        async with contextlib.aclosing(stream):
            async for item in stream:
                yield decode(item)


async def failover(
    next_target: Callable[[list[C]], Awaitable[C | None]],
    open_stream: Callable[[C], AsyncIterator[Any]],
    *,
    retry_on: tuple[type[Exception], ...],
    exhausted: Callable[[Exception | None], Exception],
    on_retry: Callable[[C, Exception], None] | None = None,
) -> AsyncGenerator[Any, None]:
    """Stream from the first target that produces its first item.

    ``next_target(failed)`` names the next target to try (None: no more). A target whose
    stream fails with ``retry_on`` *before its first item* is closed, added to
    ``failed`` and the next one is tried: nothing reached the caller yet, so retrying is
    safe. A failure after the first item is raised as is. When no target is left,
    ``exhausted(last_failure)`` is raised.
    """
    failed: list[C] = []
    last: Exception | None = None
    while (target := await next_target(failed)) is not None:
        stream = open_stream(target)
        try:
            try:
                first = await anext(stream)
            except StopAsyncIteration:
                return
            except retry_on as exc:
                failed.append(target)
                last = exc
                if on_retry is not None:
                    on_retry(target, exc)
                continue
            yield first
            async for item in stream:
                yield item
            return
        finally:
            await aclose(stream)
    raise exhausted(last)


class ComponentClient:
    """The object a ``depends(Target)`` attribute is at run time: its attributes are the
    endpoints' clients (``client.generate`` is the ``EndpointClient`` of ``generate``).

    ``namespace`` / ``component`` name the component it reaches, which is the one the
    graph links (a stand-in for ``Target`` is reached under its own name).
    """

    def __init__(self, component: str, endpoints: dict[str, EndpointClient], *,
                 namespace: str = "dynamo") -> None:
        self.namespace = namespace
        self.component = component
        self._endpoints = endpoints

    def endpoint(self, name: str) -> EndpointClient:
        try:
            return self._endpoints[name]
        except KeyError:
            raise AttributeError(f"{self.component} has no endpoint {name!r}") from None

    def __getattr__(self, name: str) -> EndpointClient:
        if name.startswith("_"):
            raise AttributeError(name)
        return self.endpoint(name)


def endpoint_client(ep: object) -> EndpointClient:
    """The client behind ``self.dep.NAME`` (a ``depends()`` attribute's endpoint)."""
    if isinstance(ep, EndpointClient):
        return ep
    raise TypeError(f"{ep!r} is not an endpoint of a depends() client (self.dep.endpoint)")


def at_random(ep: Callable[[R], AsyncIterator[T]], request: R, *,
              headers: dict[str, str] | None = None) -> AsyncGenerator[T, None]:
    """``ep(request)`` on a live instance picked at random."""
    return endpoint_client(ep).random(request, headers=headers)


def direct(ep: Callable[[R], AsyncIterator[T]], request: R, instance_id: int, *,
           headers: dict[str, str] | None = None,
           merge: Callable[[Any, Any], Any | None] | None = None) -> AsyncGenerator[T, None]:
    """``ep(request)`` on exactly ``instance_id`` (``EndpointClient.direct``; ``merge``
    joins wire items that piled up, before they are decoded)."""
    return endpoint_client(ep).direct(request, instance_id, headers=headers, merge=merge)


def instance_ids(ep: Callable[..., Any]) -> list[int]:
    """The ids of ``ep``'s live instances."""
    return endpoint_client(ep).instance_ids()


def instances(ep: Callable[..., Any]) -> list[Any]:
    """``ep``'s live instances (discovery records: ``instance_id``, ``address``,
    ``metadata``)."""
    return endpoint_client(ep).instances()


async def wait_for_instances(ep: Callable[..., Any]) -> None:
    """Wait (the client's ``wait_timeout`` at most) until ``ep`` has a live instance: right
    after start-up the instance watch may lag discovery by a few ms."""
    await endpoint_client(ep)._await_any()


def _invalid_response(message: str, field: str | None) -> Exception:
    return InvalidResponse(message)


def nearest(instances: list[Any]) -> list[Any]:
    """The instances in this very process, if any (an embedded component: reached without
    the socket); else all of them."""
    if not has_local_servers():
        return instances
    here = [i for i in instances if local_server(i.address) is not None]
    return here or instances


def _headers(headers: dict[str, str] | None) -> dict[str, str] | None:
    """Forward the current request id unless the caller set headers itself."""
    if headers is not None:
        return headers
    rid = current_request_id()
    return {REQUEST_ID_HEADER: rid} if rid else None


class ClientFactory:
    """Builds endpoint clients from discovery and owns their instance watches.

    One per component process (``ComponentRuntime``); ``close()`` ends every watch.
    """

    def __init__(self, caller: Caller, discovery: Any) -> None:
        self._caller = caller
        self._discovery = discovery
        self._clients: dict[tuple[str, str, str, type | None], EndpointClient] = {}
        self._sources: dict[tuple[str, str, str], Any] = {}
        self._watches: list[Any] = []

    async def endpoint(self, namespace: str, component: str, endpoint: str, *,
                       response_type: type | None = None) -> EndpointClient:
        """A client of that endpoint whose items are decoded into ``response_type``."""
        key = (namespace, component, endpoint, response_type)
        client = self._clients.get(key)
        if client is None:
            watch = self._sources.get(key[:3])
            if watch is None:
                watch = await self._discovery.watch_instances(namespace, component, endpoint)
                self._watches.append(watch)
                self._sources[key[:3]] = watch
            client = self._clients[key] = EndpointClient(self._caller, watch, component,
                                                         endpoint, response_type=response_type)
        return client

    async def component(self, namespace: str, component: str,
                        endpoints: dict[str, type | None]) -> ComponentClient:
        """A client of each endpoint (name -> its declared item type)."""
        return ComponentClient(component, {
            name: await self.endpoint(namespace, component, name, response_type=kind)
            for name, kind in endpoints.items()}, namespace=namespace)

    async def close(self) -> None:
        watches, self._watches = self._watches, []
        self._clients.clear()
        self._sources.clear()
        for watch in watches:
            await watch.close()
