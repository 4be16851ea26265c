"""`EtcdDiscovery`: discovery on a real etcd through ``aetcd``.

Lease life cycle: ``start()`` grants one lease whose id becomes the process's
``instance_id``; a thread of its own refreshes it every ``ttl/3`` seconds through etcd's
JSON gateway (:mod:`._lease_keeper` says why not on the event loop; where the gateway is
missing, a task on the loop does it through gRPC). If refreshing fails (etcd restarting)
it retries with backoff; if etcd answers that the lease no longer exists (it expired
while we were cut off), a NEW lease is granted and every lease-bound key
(registrations, ``put(..., lease=True)``) is written again under it. The instance id
never changes. ``close()`` revokes the lease so keys vanish at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aetcd

from dynagraph.errors import DiscoveryError
from dynagraph.runtime.discovery._base import Closer, DiscoveryBase, Sink
from dynagraph.runtime.discovery._endpoints import parse_endpoints
from dynagraph.runtime.discovery._etcd_mirror import (
    BACKOFF_MAX,
    BACKOFF_START,
    ETCD_ERRORS,
    RETRYABLE,
    PrefixMirror,
)
from dynagraph.runtime.discovery._lease_keeper import join_keeper
from dynagraph.runtime.discovery._types import decode, encode, is_undecodable

log = logging.getLogger(__name__)

T = TypeVar("T")
TXN_MAX_OPS = 100

# Reconnect quickly after an etcd restart (gRPC's default backoff grows to minutes).
GRPC_OPTIONS: dict[str, Any] = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 1000,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
}


class EtcdDiscovery(DiscoveryBase):
    """`Discovery` on etcd. ``endpoints``: comma-separated ``[http://]host:port`` list;
    the first one that answers is used. ``op_timeout`` bounds each call, retries included."""

    def __init__(
        self,
        endpoints: str = "http://127.0.0.1:2379",
        *,
        lease_ttl: int = 3,
        op_timeout: float = 5.0,
    ) -> None:
        super().__init__()
        self.endpoints = parse_endpoints(endpoints)
        if lease_ttl < 2:
            raise ValueError(f"lease_ttl must be >= 2 s (etcd's minimum), got {lease_ttl}")
        self.lease_ttl = lease_ttl
        self.op_timeout = op_timeout
        self._client: aetcd.Client | None = None
        self._lease_id: int | None = None
        self._leased: dict[str, bytes] = {}
        self._reput_pending = False
        self._lease_lock = asyncio.Lock()
        self._keepalive_task: asyncio.Task[None] | None = None
        self._leave_keeper: Callable[[float | None], None] | None = None
        self._keeper_events: asyncio.Queue[int | str] = asyncio.Queue()
        self._endpoint_at = 0  # the endpoint connected to
        self._mirrors: set[PrefixMirror] = set()
        self.lease_grants = 0

    @property
    def lease_id(self) -> int | None:
        """The lease currently held (differs from ``instance_id`` after a re-grant)."""
        return self._lease_id

    # -- life cycle ---------------------------------------------------------------

    async def start(self) -> None:
        if self._client is not None:
            return
        self._client = await self._connect()
        try:
            lease = await self._call(lambda c: c.lease(self.lease_ttl), "grant a lease")
        except DiscoveryError:
            await self._client.close()
            self._client = None
            raise
        self.lease_grants += 1
        self._lease_id = lease.id
        if self._instance_id is None:
            self._instance_id = lease.id
        self._start_keeper()
        self._keepalive_task = asyncio.create_task(self._keepalive(), name="etcd-keepalive")
        log.info("etcd discovery started: instance %x, lease ttl %ds", lease.id, self.lease_ttl)

    async def _connect(self) -> aetcd.Client:
        """The first endpoint that answers, trying them in turn (with backoff) for up to
        ``op_timeout``: gRPC gives up on one connection attempt after about a second when
        etcd is busy (256 engines of one graph connecting at once), and one such attempt
        failed a worker's start."""
        deadline = time.monotonic() + self.op_timeout
        backoff = BACKOFF_START
        while True:
            errors = []
            for at, (host, port) in enumerate(self.endpoints):
                client = aetcd.Client(host, port, timeout=self.op_timeout, options=GRPC_OPTIONS)
                try:
                    remaining = max(deadline - time.monotonic(), 0.05)
                    await asyncio.wait_for(client.status(), remaining)
                    self._endpoint_at = at
                    return client
                except ETCD_ERRORS as e:
                    errors.append(f"{host}:{port}: {e!r}")
                    await client.close()
            if time.monotonic() + backoff >= deadline:
                raise DiscoveryError(f"cannot reach etcd ({'; '.join(errors)}); start etcd or "
                                     "set ETCD_ENDPOINTS")
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX)

    async def close(self) -> None:
        leave, self._leave_keeper = self._leave_keeper, None
        if leave is not None:
            await asyncio.to_thread(leave, self.op_timeout)
        task, self._keepalive_task = self._keepalive_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._close_watches()
        for mirror in list(self._mirrors):
            await mirror.close()
        self._mirrors.clear()
        client, self._client = self._client, None
        if client is None:
            return
        if self._lease_id is not None:
            try:
                await asyncio.wait_for(client.revoke_lease(self._lease_id), self.op_timeout)
            except ETCD_ERRORS as e:
                log.warning("could not revoke lease %x (%r); its keys expire in %ds",
                            self._lease_id, e, self.lease_ttl)
            self._lease_id = None
        await client.close()

    # -- calls with retry -----------------------------------------------------------

    def _need_client(self) -> aetcd.Client:
        if self._client is None:
            raise DiscoveryError("EtcdDiscovery is not started (or was closed); call start() first")
        return self._client

    async def _call(self, fn: Callable[[aetcd.Client], Awaitable[T]], what: str) -> T:
        """Run ``fn(client)``, retrying connection errors with backoff up to ``op_timeout``."""
        client = self._need_client()
        deadline = time.monotonic() + self.op_timeout
        backoff = BACKOFF_START
        while True:
            remaining = deadline - time.monotonic()
            try:
                return await asyncio.wait_for(fn(client), max(remaining, 0.05))
            except ETCD_ERRORS as e:
                if _lease_not_found(e) or time.monotonic() + backoff >= deadline:
                    raise DiscoveryError(f"etcd: could not {what}: {e!r}") from e
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX)

    # -- keepalive -----------------------------------------------------------------

    def _start_keeper(self) -> None:
        loop = asyncio.get_running_loop()

        def report(event: int | str) -> None:  # from the keeper's thread
            if self._leave_keeper is not None:
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    loop.call_soon_threadsafe(self._keeper_events.put_nowait, event)

        at = self._endpoint_at
        self._leave_keeper = join_keeper(
            [*self.endpoints[at:], *self.endpoints[:at]], interval=self.lease_ttl / 3,
            timeout=self.op_timeout, lease=lambda: self._lease_id, on_lost=report,
            on_unsupported=report)

    async def _keepalive(self) -> None:
        """Restores what the keeper reports lost (a new lease, the keys put again); where
        etcd has no JSON gateway, refreshes the lease on the loop instead."""
        lost: int | None = None
        backoff = BACKOFF_START
        while True:
            event: int | str | None = None
            if lost is None and not self._reput_pending:
                # (a put that re-granted may leave keys to put again: look every interval)
                with contextlib.suppress(TimeoutError):
                    event = await asyncio.wait_for(self._keeper_events.get(), self.lease_ttl / 3)
            elif not self._keeper_events.empty():  # a restore to retry: news without waiting
                event = self._keeper_events.get_nowait()
            if isinstance(event, str):
                log.warning("etcd's JSON gateway is not available (%s); refreshing the lease "
                            "on the event loop through gRPC", event)
                leave, self._leave_keeper = self._leave_keeper, None
                if leave is not None:
                    leave(0)
                await self._refresh_on_loop()
                return
            if event is not None:
                lost = event
                log.warning("lease %x no longer exists in etcd; granting a new one", lost)
            try:
                if lost is not None:
                    await self._regrant(lost)
                    lost = None
                if self._reput_pending:
                    await self._reput()
            except Exception as e:  # the keepalive must outlive any error; expected ones are quiet
                log.warning("could not restore the lease yet (%r); retrying", e,
                            exc_info=not isinstance(e, RETRYABLE))
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX)
                continue
            backoff = BACKOFF_START

    async def _refresh_on_loop(self) -> None:
        interval = self.lease_ttl / 3
        delay = interval
        backoff = BACKOFF_START
        failing_since: float | None = None
        while True:
            await asyncio.sleep(delay)
            try:
                ttl = await self._refresh()
                if ttl <= 0:
                    log.warning("lease %x no longer exists in etcd; granting a new one",
                                self._lease_id or 0)
                    await self._regrant(self._lease_id)
                if self._reput_pending:
                    await self._reput()
            except Exception as e:  # the keepalive must outlive any error; expected ones are quiet
                if failing_since is None:
                    failing_since = time.monotonic()
                    log.warning("lease keepalive failed (%r); retrying with backoff", e,
                                exc_info=not isinstance(e, RETRYABLE))
                delay = backoff
                backoff = min(backoff * 2, BACKOFF_MAX)
                continue
            if failing_since is not None:
                log.warning("lease keepalive recovered after %.2fs", time.monotonic() - failing_since)
                failing_since = None
            delay, backoff = interval, BACKOFF_START

    async def _refresh(self) -> int:
        client = self._need_client()
        assert self._lease_id is not None
        reply = await asyncio.wait_for(client.refresh_lease(self._lease_id), self.op_timeout)
        if reply is None:
            raise DiscoveryError("lease keepalive stream closed without a reply")
        return int(reply.TTL)

    async def _regrant(self, stale: int | None) -> None:
        """Replace the lost lease ``stale`` (keeping instance_id) and re-put leased keys.

        A no-op if another task already replaced it.
        """
        async with self._lease_lock:
            if self._lease_id != stale:
                return
            client = self._need_client()
            lease = await asyncio.wait_for(client.lease(self.lease_ttl), self.op_timeout)
            self.lease_grants += 1
            old, self._lease_id = self._lease_id, lease.id
            self._reput_pending = True
            log.warning("granted lease %x replacing %x (instance id stays %x)",
                        lease.id, old or 0, self.instance_id)
        await self._reput()

    async def _reput(self) -> None:
        async with self._lease_lock:
            client = self._need_client()
            items = list(self._leased.items())
            # One transaction per chunk so watchers see a process's keys come back together
            # (etcd allows 128 operations per transaction by default).
            for i in range(0, len(items), TXN_MAX_OPS):
                puts = [client.transactions.put(key.encode(), raw, lease=self._lease_id)
                        for key, raw in items[i:i + TXN_MAX_OPS]]
                await asyncio.wait_for(client.transaction(compare=[], success=puts, failure=[]),
                                       self.op_timeout)
            self._reput_pending = False
            if self._leased:
                log.warning("re-registered %d lease-bound keys under lease %x",
                            len(self._leased), self._lease_id or 0)

    # -- key-value -----------------------------------------------------------------

    async def put(self, key: str, value: Any, *, lease: bool = False) -> None:
        self._check_publish(key, value)
        raw = encode(value)
        if not lease:
            self._leased.pop(key, None)
            await self._call(lambda c: c.put(key.encode(), raw), f"put {key}")
            return
        stale = self._lease_id
        try:
            await self._put_leased(key, raw)
        except DiscoveryError as e:
            if not _lease_not_found(e.__cause__):
                raise
            log.warning("lease %x no longer exists in etcd; granting a new one", stale or 0)
            await self._regrant(stale)
            await self._put_leased(key, raw)

    async def _put_leased(self, key: str, raw: bytes) -> None:
        async with self._lease_lock:
            lease_id = self._lease_id
            await self._call(lambda c: c.put(key.encode(), raw, lease=lease_id), f"put {key}")
            self._leased[key] = raw

    async def put_if_absent(self, key: str, value: Any) -> Any:
        self._check_publish(key, value)
        k, raw = key.encode(), encode(value)

        def txn(c: aetcd.Client) -> Awaitable[tuple[bool, Any]]:
            # aetcd is untyped: its transaction() returns Any.
            return c.transaction(  # type: ignore[no-any-return]
                compare=[c.transactions.version(k) == 0],
                success=[c.transactions.put(k, raw)], failure=[])

        created, _ = await self._call(txn, f"create {key}")
        if created:
            self._leased.pop(key, None)
            return value
        got = await self.get(key)
        if got is None:
            raise DiscoveryError(f"etcd: {key} exists but could not be read back")
        return got

    async def get(self, key: str) -> Any | None:
        got = await self._call(lambda c: c.get(key.encode()), f"get {key}")
        if got is None:
            return None
        value = decode(key, bytes(got.value))
        return None if is_undecodable(value) else value

    async def get_prefix(self, prefix: str) -> dict[str, Any]:
        resp = await self._call(lambda c: c.get_prefix(prefix.encode()), f"read prefix {prefix}")
        out: dict[str, Any] = {}
        for kv in resp.kvs:
            key = kv.key.decode()
            value = decode(key, bytes(kv.value))
            if not is_undecodable(value):
                out[key] = value
        return out

    async def delete(self, key: str) -> None:
        self._leased.pop(key, None)
        await self._call(lambda c: c.delete(key.encode()), f"delete {key}")

    async def _subscribe(self, prefix: str, sink: Sink) -> Closer:
        mirror = PrefixMirror(self._need_client(), prefix, sink, timeout=self.op_timeout)
        await mirror.start()
        self._mirrors.add(mirror)

        async def close() -> None:
            self._mirrors.discard(mirror)
            await mirror.close()

        return close


def _lease_not_found(e: BaseException | None) -> bool:
    return e is not None and "lease not found" in str(e)
