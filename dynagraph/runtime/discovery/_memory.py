"""In-memory discovery for unit tests: several `MemoryDiscovery` objects sharing one
`MemoryStore` behave like processes sharing one etcd (leases, revisions, watches),
with no I/O and no timers. A "crash" is simulated with ``MemoryDiscovery.expire()``.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dynagraph.errors import DiscoveryError
from dynagraph.runtime.discovery._base import Closer, DiscoveryBase, Sink
from dynagraph.runtime.discovery._types import decode, encode, is_undecodable

log = logging.getLogger(__name__)


@dataclass
class _Entry:
    raw: bytes
    lease: int
    mod_revision: int


class MemoryStore:
    """A tiny etcd: keys with JSON bytes, leases, a revision counter, prefix subscribers.

    Subscribers are called synchronously inside the mutating call.
    """

    def __init__(self) -> None:
        self._data: dict[str, _Entry] = {}
        self._leases: dict[int, set[str]] = {}
        self._lease_ids = itertools.count(0x694D_0000_0001)
        self.revision = 1
        self._subs: dict[int, tuple[str, Sink]] = {}
        self._sub_ids = itertools.count(1)

    def grant_lease(self) -> int:
        lease = next(self._lease_ids)
        self._leases[lease] = set()
        return lease

    def lease_alive(self, lease: int) -> bool:
        return lease in self._leases

    def revoke_lease(self, lease: int) -> None:
        """Delete the lease and every key bound to it (what etcd does on expiry/revoke)."""
        for key in sorted(self._leases.pop(lease, set())):
            self.delete(key)

    def put(self, key: str, raw: bytes, lease: int = 0) -> None:
        if lease and lease not in self._leases:
            raise DiscoveryError(f"lease {lease:x} not found (expired or revoked)")
        old = self._data.get(key)
        if old is not None and old.lease:
            self._leases.get(old.lease, set()).discard(key)
        self.revision += 1
        self._data[key] = _Entry(raw, lease, self.revision)
        if lease:
            self._leases[lease].add(key)
        self._notify(key, raw)

    def get(self, key: str) -> bytes | None:
        entry = self._data.get(key)
        return entry.raw if entry is not None else None

    def get_prefix(self, prefix: str) -> dict[str, bytes]:
        return {k: e.raw for k, e in sorted(self._data.items()) if k.startswith(prefix)}

    def delete(self, key: str) -> None:
        entry = self._data.pop(key, None)
        if entry is None:
            return
        if entry.lease:
            self._leases.get(entry.lease, set()).discard(key)
        self.revision += 1
        self._notify(key, None)

    def subscribe(self, prefix: str, sink: Sink) -> Callable[[], None]:
        """Deliver current keys under ``prefix``, then every change; returns an unsubscriber."""
        for key, raw in self.get_prefix(prefix).items():
            _deliver(sink, key, raw)
        sub_id = next(self._sub_ids)
        self._subs[sub_id] = (prefix, sink)

        def unsubscribe() -> None:
            self._subs.pop(sub_id, None)

        return unsubscribe

    def _notify(self, key: str, raw: bytes | None) -> None:
        for prefix, sink in list(self._subs.values()):
            if key.startswith(prefix):
                _deliver(sink, key, raw)


def _deliver(sink: Sink, key: str, raw: bytes | None) -> None:
    if raw is None:
        sink(key, None)
        return
    value = decode(key, raw)
    if not is_undecodable(value):
        sink(key, value)


class MemoryDiscovery(DiscoveryBase):
    """`Discovery` over a shared `MemoryStore`; same semantics as `EtcdDiscovery`."""

    def __init__(self, store: MemoryStore | None = None, *, lease_ttl: int = 3) -> None:
        super().__init__()
        self.store = store if store is not None else MemoryStore()
        self.lease_ttl = lease_ttl
        self._lease: int | None = None
        self._unsubs: set[Callable[[], None]] = set()

    @property
    def lease_id(self) -> int | None:
        return self._lease

    async def start(self) -> None:
        if self._lease is not None:
            return
        self._lease = self.store.grant_lease()
        if self._instance_id is None:
            self._instance_id = self._lease

    async def close(self) -> None:
        await self._close_watches()
        for unsub in list(self._unsubs):
            unsub()
        self._unsubs.clear()
        if self._lease is not None:
            self.store.revoke_lease(self._lease)
            self._lease = None

    def expire(self) -> None:
        """Simulate this process dying: its lease expires and its keys vanish."""
        if self._lease is not None:
            self.store.revoke_lease(self._lease)
            self._lease = None

    def _need_lease(self) -> int:
        if self._lease is None:
            raise DiscoveryError("MemoryDiscovery is not started (or was closed/expired)")
        return self._lease

    async def put(self, key: str, value: Any, *, lease: bool = False) -> None:
        self._check_publish(key, value)
        lease_id = self._need_lease()
        self.store.put(key, encode(value), lease_id if lease else 0)

    async def get(self, key: str) -> Any | None:
        self._need_lease()
        raw = self.store.get(key)
        if raw is None:
            return None
        value = decode(key, raw)
        return None if is_undecodable(value) else value

    async def get_prefix(self, prefix: str) -> dict[str, Any]:
        self._need_lease()
        out: dict[str, Any] = {}
        for key, raw in self.store.get_prefix(prefix).items():
            value = decode(key, raw)
            if not is_undecodable(value):
                out[key] = value
        return out

    async def delete(self, key: str) -> None:
        self._need_lease()
        self.store.delete(key)

    async def _subscribe(self, prefix: str, sink: Sink) -> Closer:
        self._need_lease()
        unsub = self.store.subscribe(prefix, sink)
        self._unsubs.add(unsub)

        async def close() -> None:
            self._unsubs.discard(unsub)
            unsub()

        return close
