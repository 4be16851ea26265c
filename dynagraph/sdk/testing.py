"""In-memory dependency clients, for building a real component in a unit test.

``in_memory_client(Router, {"generate": handler}, instance_ids=[1, 2])`` is what
``depends(Router)`` is at run time (a ``ComponentClient`` with typed endpoint clients:
round robin, ``direct``, ``at_random``, failover and item decoding all as served), with
the request plane replaced by plain functions: ``handler(request, instance_id)`` is an
async iterator of items. The request reaches the handler as it would arrive over the wire
(plain msgpack values); a handler may raise ``InstanceUnavailable`` to act as an instance
that cannot be reached. ``instance_ids`` may be a function, asked at every call
(instances that come and go).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from dynagraph.runtime.rpc import wire_copy
from dynagraph.sdk._client import ComponentClient, EndpointClient
from dynagraph.sdk._service import spec_of

Handler = Callable[[Any, int], AsyncIterator[Any]]


@dataclass(frozen=True)
class MemoryInstance:
    instance_id: int
    address: str
    metadata: dict[str, Any] = field(default_factory=dict)


class MemoryEndpoints:
    """The request plane and the instance list of an in-memory component."""

    def __init__(self, handlers: dict[str, Handler],
                 instance_ids: Iterable[int] | Callable[[], Iterable[int]],
                 metadata: dict[int, dict[str, Any]] | None = None) -> None:
        self.handlers = handlers
        self.metadata = metadata or {}
        self.ids = instance_ids if callable(instance_ids) else list(instance_ids)
        self.calls: list[tuple[str, int, Any]] = []
        """Every call made: (endpoint, instance id, request as delivered)."""

    def instances(self) -> list[Any]:
        ids = self.ids() if callable(self.ids) else self.ids
        return [MemoryInstance(i, f"mem:{i}", self.metadata.get(i, {})) for i in ids]

    def call(self, address: str, endpoint: str, payload: Any, *,
             headers: dict[str, str] | None = None) -> AsyncIterator[Any]:
        iid = int(address.removeprefix("mem:"))
        request = wire_copy(payload)
        self.calls.append((endpoint, iid, request))
        return self.handlers[endpoint](request, iid)


def in_memory_client(target: type, handlers: dict[str, Handler], *,
                     instance_ids: Iterable[int] | Callable[[], Iterable[int]] = (1,),
                     metadata: dict[int, dict[str, Any]] | None = None) -> Any:
    """A ``ComponentClient`` of ``target`` (a component class) served by ``handlers``
    (endpoint name -> handler); typed ``Any`` so it can stand for ``depends(target)``.
    Its ``.memory`` is the ``MemoryEndpoints`` (change ``.memory.ids``, read ``.calls``)."""
    spec = spec_of(target)
    memory = MemoryEndpoints(handlers, instance_ids, metadata)
    kinds = {ep.name: ep.response_type for ep in spec.endpoints}
    client = ComponentClient(spec.name, {
        name: EndpointClient(memory, memory, spec.name, name, wait_timeout=0.0,
                             response_type=kinds.get(name))
        for name in handlers}, namespace=spec.namespace)
    client.memory = memory  # type: ignore[attr-defined]
    return client
