"""Clients that a ``depends()`` attribute turns into at run time.

``self.worker.generate(req)`` calls the dependency's ``generate`` endpoint on the next
instance in round-robin order; ``.random(req)`` picks one at random; ``.direct(req, id)``
calls exactly that instance. Each returns an async iterator of responses; closing it
(or cancelling the task consuming it) cancels the remote call. ``generate`` and
``random`` retry on another live instance when the request could not be delivered.
"""

from __future__ import annotations

import asyncio
import contextlib
import random as _random
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from dynagraph.errors import InstanceUnavailable, NoInstancesError
from dynagraph.sdk._context import REQUEST_ID_HEADER, current_request_id


class InstanceSource(Protocol):
    """The live instance list of one endpoint (``InstanceWatch`` satisfies it)."""

    def instances(self) -> list[Any]: ...


class Caller(Protocol):
    """The request plane (``RpcClient`` satisfies it)."""

    def call(
        self, address: str, endpoint: str, payload: Any, *, headers: dict[str, str] | None = None
    ) -> AsyncIterator[Any]: ...


class EndpointClient:
    """Calls one endpoint of one component, choosing among its live instances."""

    def __init__(self, caller: Caller, source: InstanceSource, component: str, endpoint: str,
                 rng: _random.Random | None = None, *, wait_timeout: float = 2.0) -> None:
        self._caller = caller
        self.wait_timeout = wait_timeout
        self._source = source
        self.component = component
        self.endpoint = endpoint
        self._rr = 0
        self._rng = rng or _random.Random()

    def instances(self) -> list[Any]:
        return self._source.instances()

    def instance_ids(self) -> list[int]:
        return [i.instance_id for i in self._source.instances()]

    def round_robin(self, request: Any, *, headers: dict[str, str] | None = None) -> AsyncIterator[Any]:
        def pick(live: list[Any]) -> Any:
            self._rr += 1
            return live[self._rr % len(live)]

        return self._with_retry(request, pick, headers)

    def random(self, request: Any, *, headers: dict[str, str] | None = None) -> AsyncIterator[Any]:
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
                     headers: dict[str, str] | None = None) -> AsyncIterator[Any]:
        for inst in self._source.instances():
            if inst.instance_id == instance_id:
                break
        else:
            raise NoInstancesError(
                f"{self.component}/{self.endpoint}: no live instance {instance_id:x}"
            )
        it = self._caller.call(inst.address, self.endpoint, request, headers=_headers(headers))
        try:
            async for item in it:
                yield item
        finally:
            await _aclose(it)

    async def _with_retry(self, request: Any, pick: Callable[[list[Any]], Any],
                          headers: dict[str, str] | None) -> AsyncIterator[Any]:
        failed: set[int] = set()
        headers = _headers(headers)
        await self._await_any()
        while True:
            live = [i for i in self._source.instances() if i.instance_id not in failed]
            if not live and failed:
                live = await self._await_new(failed)
            if not live:
                what = "reachable " if failed else ""
                raise NoInstancesError(f"no {what}instance of {self.component}/{self.endpoint}")
            inst = pick(live)
            it = self._caller.call(inst.address, self.endpoint, request, headers=headers)
            try:
                try:
                    first = await it.__anext__()
                except StopAsyncIteration:
                    return
                except InstanceUnavailable:
                    failed.add(inst.instance_id)
                    continue
                yield first
                async for item in it:
                    yield item
                return
            finally:
                await _aclose(it)


class ComponentClient:
    """The handle a ``depends(Target)`` attribute becomes: one EndpointClient per endpoint."""

    def __init__(self, component: str, endpoints: dict[str, EndpointClient]) -> None:
        self.component = component
        self._endpoints = endpoints

    def endpoint(self, name: str) -> EndpointClient:
        try:
            return self._endpoints[name]
        except KeyError:
            raise AttributeError(f"{self.component} has no endpoint {name!r}") from None

    def instance_ids(self, endpoint: str = "generate") -> list[int]:
        return self.endpoint(endpoint).instance_ids()

    def generate(self, request: Any, **kw: Any) -> AsyncIterator[Any]:
        return self.endpoint("generate").round_robin(request, **kw)

    def random(self, request: Any, *, endpoint: str = "generate", **kw: Any) -> AsyncIterator[Any]:
        return self.endpoint(endpoint).random(request, **kw)

    def direct(self, request: Any, instance_id: int, *, endpoint: str = "generate",
               **kw: Any) -> AsyncIterator[Any]:
        return self.endpoint(endpoint).direct(request, instance_id, **kw)

    def __getattr__(self, name: str) -> Callable[..., AsyncIterator[Any]]:
        if name.startswith("_"):
            raise AttributeError(name)
        return self.endpoint(name).round_robin


async def _aclose(it: AsyncIterator[Any]) -> None:
    aclose = getattr(it, "aclose", None)
    if aclose is not None:
        await aclose()


def _headers(headers: dict[str, str] | None) -> dict[str, str] | None:
    """Forward the current request id unless the caller set headers itself."""
    if headers is not None:
        return headers
    rid = current_request_id()
    return {REQUEST_ID_HEADER: rid} if rid else None
