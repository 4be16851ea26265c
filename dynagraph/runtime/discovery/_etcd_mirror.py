"""`PrefixMirror`: a live copy of every key under an etcd prefix that survives restarts.

An initial ``get_prefix`` fills the mirror and records the store revision; a watch
from revision + 1 then streams every change. When the watch fails (etcd restarting,
connection lost) it is re-opened from the last seen revision + 1 with backoff, so no
change is lost; if that revision was compacted meanwhile, a fresh ``get_prefix`` is
diffed against the mirror and the differences are delivered instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import aetcd
import aetcd.exceptions
import aetcd.rtypes
import grpc

from dynagraph.errors import DiscoveryError
from dynagraph.runtime.discovery._types import decode, is_undecodable

log = logging.getLogger(__name__)

# What a lost / restarting etcd looks like through aetcd.
ETCD_ERRORS: tuple[type[BaseException], ...] = (
    aetcd.exceptions.ClientError,
    grpc.aio.AioRpcError,
    TimeoutError,
    OSError,
)
RETRYABLE: tuple[type[BaseException], ...] = (*ETCD_ERRORS, DiscoveryError)

BACKOFF_START = 0.05
BACKOFF_MAX = 1.0

Sink = Any  # Callable[[str, Any | None], None]; kept loose to avoid an import cycle


class PrefixMirror:
    """Mirror ``prefix`` from ``client`` and feed every change to ``sink(key, value|None)``."""

    def __init__(self, client: aetcd.Client, prefix: str, sink: Sink, *, timeout: float) -> None:
        self._client = client
        self.prefix = prefix
        self._prefix_b = prefix.encode()
        self._sink = sink
        self._timeout = timeout
        self._raw: dict[str, bytes] = {}
        self.revision = 0
        self._task: asyncio.Task[None] | None = None
        self._watch: aetcd.rtypes.Watch | None = None
        self.rewatches = 0
        self.resyncs = 0

    async def start(self) -> None:
        """Deliver the current keys, then start following changes. Raises DiscoveryError."""
        try:
            await self._resync()
        except ETCD_ERRORS as e:
            raise DiscoveryError(f"cannot read prefix {self.prefix!r} from etcd: {e!r}") from e
        self._task = asyncio.create_task(self._run(), name=f"etcd-watch {self.prefix}")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._cancel_watch()

    async def _cancel_watch(self) -> None:
        watch, self._watch = self._watch, None
        if watch is not None:
            with contextlib.suppress(*ETCD_ERRORS):
                await asyncio.wait_for(watch.cancel(), self._timeout)

    async def _resync(self) -> None:
        """Read the prefix afresh; deliver the difference from the mirror."""
        resp = await asyncio.wait_for(self._client.get_prefix(self._prefix_b), self._timeout)
        fresh = {kv.key.decode(): bytes(kv.value) for kv in resp.kvs}
        for key in [k for k in self._raw if k not in fresh]:
            self._apply(key, None)
        for key, raw in fresh.items():
            if self._raw.get(key) != raw:
                self._apply(key, raw)
        self.revision = max(self.revision, resp.header.revision)

    def _apply(self, key: str, raw: bytes | None) -> None:
        if raw is None:
            if self._raw.pop(key, None) is None:
                return
            self._sink(key, None)
            return
        self._raw[key] = raw
        value = decode(key, raw)
        if not is_undecodable(value):
            self._sink(key, value)

    async def _open_watch(self) -> aetcd.rtypes.Watch:
        return await asyncio.wait_for(
            self._client.watch_prefix(self._prefix_b, start_revision=self.revision + 1),
            self._timeout,
        )

    async def _run(self) -> None:
        backoff = BACKOFF_START
        failing_since: float | None = None
        while True:
            try:
                self._watch = await self._open_watch()
                if failing_since is not None:
                    log.warning(
                        "watch on %s re-established from revision %d after %.2fs",
                        self.prefix, self.revision + 1, time.monotonic() - failing_since,
                    )
                    failing_since = None
                backoff = BACKOFF_START
                async for event in self._watch:
                    self._on_event(event)
                raise DiscoveryError("watch stream ended")
            except aetcd.exceptions.RevisionCompactedError as e:
                log.warning("watch on %s: %s; re-reading the prefix", self.prefix, e)
                await self._cancel_watch()
                await self._resync_until_ok()
                continue
            except RETRYABLE as e:
                if failing_since is None:
                    failing_since = time.monotonic()
                    log.warning("watch on %s failed (%r); re-watching from revision %d",
                                self.prefix, e, self.revision + 1)
            except Exception:  # keep the mirror alive whatever aetcd raises
                failing_since = failing_since or time.monotonic()
                log.exception("unexpected error in watch on %s; re-watching", self.prefix)
            self._watch = None
            self.rewatches += 1
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX)

    async def _resync_until_ok(self) -> None:
        backoff = BACKOFF_START
        while True:
            try:
                await self._resync()
                self.resyncs += 1
                return
            except ETCD_ERRORS as e:
                log.warning("re-reading %s failed (%r); retrying", self.prefix, e)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX)

    def _on_event(self, event: aetcd.rtypes.Event) -> None:
        kv = event.kv
        # Several events may share one revision (a txn, a lease revoke): no dedup here;
        # etcd never repeats an event below the start revision of a new watch.
        self.revision = max(self.revision, kv.mod_revision)
        key = kv.key.decode()
        if event.kind == aetcd.rtypes.EventKind.DELETE:
            self._apply(key, None)
        else:
            self._apply(key, bytes(kv.value))
