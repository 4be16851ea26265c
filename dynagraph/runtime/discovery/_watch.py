"""`InstanceWatch`: a live, sorted list of one endpoint's instances.

Backend-neutral: a backend feeds it ``(key, value)`` puts and ``(key, None)`` deletes
through ``apply()`` (its initial snapshot first) and hands it a ``closer`` that
cancels the underlying watch.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from dynagraph.errors import NoInstancesError
from dynagraph.runtime.discovery._types import InstanceInfo, parse_instance

log = logging.getLogger(__name__)

Subscriber = Callable[[list[InstanceInfo]], None]


class InstanceWatch:
    """Live instance list of ``namespace/component/endpoint``.

    ``instances()`` is always the current view; ``subscribe()`` callbacks run (in the
    event loop, synchronously) after every change with the new list.
    """

    def __init__(self, namespace: str, component: str, endpoint: str) -> None:
        self.namespace = namespace
        self.component = component
        self.endpoint = endpoint
        self._by_key: dict[str, InstanceInfo] = {}
        self._sorted: list[InstanceInfo] = []
        self._subscribers: list[Subscriber] = []
        self._changed = asyncio.Event()
        self._closer: Callable[[], Awaitable[None]] | None = None
        self._closed = False

    @property
    def name(self) -> str:
        return f"{self.namespace}/{self.component}/{self.endpoint}"

    def set_closer(self, closer: Callable[[], Awaitable[None]]) -> None:
        self._closer = closer

    def apply(self, key: str, value: Any | None) -> None:
        """Apply one put (value) or delete (None); notify subscribers if the list changed."""
        if value is None:
            changed = self._by_key.pop(key, None) is not None
        else:
            info = parse_instance(self.namespace, self.component, self.endpoint, key, value)
            if info is None:
                changed = self._by_key.pop(key, None) is not None
            else:
                changed = self._by_key.get(key) != info
                self._by_key[key] = info
        if changed:
            self._sorted = sorted(self._by_key.values(), key=lambda i: i.instance_id)
            self._changed.set()
            for callback in list(self._subscribers):
                try:
                    callback(list(self._sorted))
                except Exception:  # a subscriber's bug must not kill the watch
                    log.exception("instance watch subscriber failed for %s", self.name)

    def instances(self) -> list[InstanceInfo]:
        """The current live instances, sorted by instance_id."""
        return list(self._sorted)

    def subscribe(self, callback: Subscriber) -> None:
        """Call ``callback(instances)`` after every change (not for the current state)."""
        self._subscribers.append(callback)

    def unsubscribe(self, callback: Subscriber) -> None:
        if callback in self._subscribers:
            self._subscribers.remove(callback)

    async def wait_for(
        self, count: int = 1, timeout: float = 10.0  # noqa: ASYNC109 - part of the contract
    ) -> list[InstanceInfo]:
        """Wait until at least ``count`` instances are live; return them.

        Raises NoInstancesError if none appeared within ``timeout``, TimeoutError if
        some but fewer than ``count`` did.
        """
        deadline = time.monotonic() + timeout
        while len(self._sorted) < count:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._closed:
                self._raise_missing(count, timeout)
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                self._raise_missing(count, timeout)
        return list(self._sorted)

    def _raise_missing(self, count: int, timeout: float) -> None:
        have = len(self._sorted)
        state = " (watch closed)" if self._closed else ""
        if have == 0:
            raise NoInstancesError(
                f"no live instance of {self.name} after {timeout:g}s{state}; "
                f"is the component running and registered in the same etcd?"
            )
        raise TimeoutError(
            f"only {have} of {count} instances of {self.name} live after {timeout:g}s{state}: "
            f"{', '.join(f'{i.instance_id:x}@{i.address}' for i in self._sorted)}"
        )

    async def close(self) -> None:
        """Stop watching; the list stays as last seen. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._changed.set()
        closer, self._closer = self._closer, None
        if closer is not None:
            await closer()

    def __repr__(self) -> str:
        return f"InstanceWatch({self.name}, {len(self._sorted)} instances)"
