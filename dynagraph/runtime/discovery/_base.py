"""Behaviour shared by the backends: instance watches and prefix iterators.

A backend implements ``_subscribe(prefix, sink)``: deliver every current key under
``prefix`` to ``sink(key, value)`` before returning, then every later put
(``sink(key, value)``) and delete (``sink(key, None)``) until the returned closer is
awaited. Everything else here is built on that one primitive.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from dynagraph.errors import DiscoveryError
from dynagraph.runtime.discovery._types import InstanceInfo, endpoint_prefix, instance_key
from dynagraph.runtime.discovery._watch import InstanceWatch

Sink = Callable[[str, Any | None], None]
Closer = Callable[[], Awaitable[None]]


class DiscoveryBase:
    """Registration bookkeeping, instance watches and ``watch_prefix`` over ``_subscribe``."""

    def __init__(self) -> None:
        self._instance_id: int | None = None
        self._watches: set[InstanceWatch] = set()
        self._prefix_queues: set[asyncio.Queue[tuple[str, Any | None] | None]] = set()
        self.publish_check: Callable[[str, Any], None] | None = None
        """Called with every key and value before ``put`` writes it; raises to refuse
        (e.g. ``dynagraph.runtime.addresses.PublishGuard``)."""

    @property
    def instance_id(self) -> int:
        if self._instance_id is None:
            raise DiscoveryError(f"{type(self).__name__}.start() was not called; no instance id yet")
        return self._instance_id

    async def _subscribe(self, prefix: str, sink: Sink) -> Closer:
        raise NotImplementedError

    async def put(self, key: str, value: Any, *, lease: bool = False) -> None:
        raise NotImplementedError

    def _check_publish(self, key: str, value: Any) -> None:
        if self.publish_check is not None:
            self.publish_check(key, value)

    async def get(self, key: str) -> Any | None:
        raise NotImplementedError

    async def put_if_absent(self, key: str, value: Any) -> Any:
        # Atomic where the store runs in this process (no await between the two steps
        # that could interleave another writer); EtcdDiscovery uses a transaction.
        existing = await self.get(key)
        if existing is not None:
            return existing
        await self.put(key, value)
        return value

    async def register(self, namespace: str, component: str, endpoint: str, address: str,
                       metadata: dict[str, Any] | None = None) -> InstanceInfo:
        info = InstanceInfo(
            namespace=namespace,
            component=component,
            endpoint=endpoint,
            instance_id=self.instance_id,
            address=address,
            metadata=dict(metadata or {}),
        )
        key = instance_key(namespace, component, endpoint, info.instance_id)
        await self.put(key, info.to_json(), lease=True)
        return info

    async def watch_instances(self, namespace: str, component: str, endpoint: str) -> InstanceWatch:
        prefix = endpoint_prefix(namespace, component, endpoint)
        watch = InstanceWatch(namespace, component, endpoint)
        closer = await self._subscribe(prefix, watch.apply)
        self._watches.add(watch)

        async def close() -> None:
            self._watches.discard(watch)
            await closer()

        watch.set_closer(close)
        return watch

    async def watch_prefix(self, prefix: str) -> AsyncGenerator[tuple[str, Any | None], None]:
        # None in the queue means "this Discovery was closed": the iterator ends.
        queue: asyncio.Queue[tuple[str, Any | None] | None] = asyncio.Queue()
        closer = await self._subscribe(prefix, lambda k, v: queue.put_nowait((k, v)))
        self._prefix_queues.add(queue)
        try:
            while (item := await queue.get()) is not None:
                yield item
        finally:
            self._prefix_queues.discard(queue)
            await closer()

    async def _close_watches(self) -> None:
        """Close every instance watch and end every ``watch_prefix`` iterator."""
        for watch in list(self._watches):
            with contextlib.suppress(DiscoveryError):
                await watch.close()
        self._watches.clear()
        for queue in self._prefix_queues:
            queue.put_nowait(None)

    async def __aenter__(self) -> DiscoveryBase:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError
