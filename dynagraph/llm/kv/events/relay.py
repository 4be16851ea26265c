"""KV event relay: an engine's KV events -> this worker's block set -> subscribers.

``KvEventFeed`` is the engine-independent part: fed lists of events (``publish``), it
keeps the block set and streams a snapshot then net deltas to each subscriber. The
mocker's worker feeds it straight from ``MockerEngine(on_kv_events=feed.publish)``;
``KvEventRelay`` is a feed that receives vLLM's events over ZMQ.

Lives in the worker process. Who does what (vLLM)::

    vLLM engine core --PUB (connects)--> SUB bound on tcp://127.0.0.1:<free port>
        -> KvEventRelay (decode with ``dynagraph.llm.router.events``)
        -> BlockSet (the hashes this worker holds, with copy counts)
        -> one bounded queue per subscriber (the worker's ``kv_events`` endpoint)
        -> Router (applies each ``RelayBatch`` to its ``PrefixIndex``)

Why a relay instead of the Router subscribing to vLLM directly: the relay binds only
to 127.0.0.1 (vLLM is handed a concrete endpoint, so its PUB *connects*), the Router
reaches workers over the ordinary request plane, and a Router that subscribes late
(or restarts) first gets a snapshot of the worker's whole block set, then live deltas.

Deltas are *net* per vLLM batch: vLLM may hold two physical copies of one hash and
report ``BlockRemoved`` when the first goes; ``BlockSet`` counts copies and only
reports a hash removed when its last copy goes, so the Router's index stays exact.

A subscriber that falls more than ``queue_size`` batches behind is not cut off: its
queue is replaced by one fresh snapshot (``snapshot=True``), which supersedes every
delta it missed. A gap in vLLM's own sequence numbers (ZMQ dropped a batch) is
logged and counted in ``RelayStats.gaps``; the block set may then be stale until the
blocks concerned are stored or removed again (vLLM's replay socket is not used).

The worker's other Router feed, ``load_snapshots``, lives here too: the engine's load
sampled at a fixed rate (10 per second by default) for the ``load_metrics`` endpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from dynagraph.llm.engines.base import EngineLoad
from dynagraph.llm.router.events import (
    DEFAULT_MEDIA,
    POOL_MEDIA,
    TIER_MEDIA,
    AllCleared,
    BlocksStored,
    BlocksStoredWithTokens,
    KvEvent,
    KvEventDecodeError,
    RelayBatch,
    decode_frames,
    hashes_agree,
)
from dynagraph.llm.router.hashing import BlockHasher

log = logging.getLogger(__name__)

DEFAULT_QUEUE_SIZE = 256
"""Batches a subscriber may lag behind before it is resynced with a snapshot."""


@dataclass(frozen=True)
class Delta:
    """The net effect of one vLLM batch on a ``BlockSet``."""

    cleared: bool
    stored: list[int]
    removed: list[int]

    def __bool__(self) -> bool:
        return self.cleared or bool(self.stored) or bool(self.removed)


class BlockSet:
    """The block hashes one worker holds in one tier, with a copy count each. Pure, no I/O.

    Only events of that tier's ``media`` (default: the engine's own cache,
    ``DEFAULT_MEDIA``) and of KV-cache group 0 count, as in
    :func:`dynagraph.llm.router.events.apply_events`.
    """

    __slots__ = ("_counts", "_media")

    def __init__(self, media: frozenset[str | None] = DEFAULT_MEDIA) -> None:
        self._counts: dict[int, int] = {}
        self._media = media

    def __len__(self) -> int:
        return len(self._counts)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._counts

    def hashes(self) -> list[int]:
        """Every held hash, oldest first."""
        return list(self._counts)

    def discard(self, hashes: Iterable[int]) -> None:
        """Forget these hashes, every copy (blocks deleted behind the engine's back)."""
        for h in hashes:
            self._counts.pop(h, None)

    def apply(self, events: Iterable[KvEvent]) -> Delta:
        """Apply one batch's events in order; return what changed for an observer."""
        counts = self._counts
        before: dict[int, bool] = {}  # hash -> held before this batch (since a clear)
        cleared = False
        for ev in events:
            if isinstance(ev, AllCleared):
                counts.clear()
                before.clear()
                cleared = True
                continue
            if ev.medium not in self._media or (ev.group_idx or 0) != 0:
                continue
            if isinstance(ev, BlocksStored):
                for h in ev.block_hashes:
                    n = counts.get(h, 0)
                    before.setdefault(h, n > 0 and not cleared)
                    counts[h] = n + 1
            else:
                for h in ev.block_hashes:
                    n = counts.get(h, 0)
                    if n == 0:
                        continue
                    before.setdefault(h, not cleared)
                    if n == 1:
                        del counts[h]
                    else:
                        counts[h] = n - 1
        stored = [h for h, was in before.items() if not was and h in counts]
        removed = [h for h, was in before.items() if was and h not in counts]
        return Delta(cleared, stored, removed)


@dataclass
class RelayStats:
    batches: int = 0
    """vLLM batches received."""
    gaps: int = 0
    """Times vLLM's sequence skipped (batches lost between vLLM and the relay)."""
    decode_errors: int = 0
    resyncs: int = 0
    """Times a slow subscriber's queue was replaced by a snapshot."""
    hashes_verified: bool | None = None
    """Whether our ``BlockHasher`` reproduced vLLM's hashes (None: not checked yet)."""


_CLOSED = object()


class RelaySubscription:
    """One subscriber's stream: a snapshot first, then live batches.

    Iterate with ``async for``; the iteration ends when the relay closes. Call
    :meth:`close` (or use ``async with``) when done so the relay forgets it.
    """

    def __init__(self, relay: KvEventFeed, queue_size: int) -> None:
        self._relay = relay
        self._queue: asyncio.Queue[Any] = asyncio.Queue(maxsize=queue_size)

    def _put(self, item: Any) -> bool:
        """Queue ``item``; False if the queue is full (the caller resyncs)."""
        try:
            self._queue.put_nowait(item)
            return True
        except asyncio.QueueFull:
            return False

    def _reset(self, item: Any) -> None:
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(item)

    def __aiter__(self) -> AsyncIterator[RelayBatch]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RelayBatch]:
        while True:
            item = await self._queue.get()
            if item is _CLOSED:
                return
            yield item

    def close(self) -> None:
        self._relay._subscribers.discard(self)

    async def __aenter__(self) -> RelaySubscription:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class KvEventFeed:
    """One engine's block set and its subscribers; fed with lists of events.

    ``publish(events)`` applies one batch of events (in order) to the block set and
    sends the net change to every subscriber; ``subscribe()`` per ``kv_events`` caller;
    ``end()`` ends every subscriber's stream. Single event loop, no I/O of its own.
    """

    def __init__(self, *, queue_size: int = DEFAULT_QUEUE_SIZE) -> None:
        self._queue_size = queue_size
        self.blocks = BlockSet()
        self.pooled = BlockSet(POOL_MEDIA)
        """Blocks in the host KV pool (``kv-offload-gib``), published as their own tier."""
        self.tiered = BlockSet(TIER_MEDIA)
        """Blocks this engine wrote to the tier under its pool (``kv-offload-dir``)."""
        self.stats = RelayStats()
        self.seq = 0
        self._subscribers: set[RelaySubscription] = set()

    def subscribe(self) -> RelaySubscription:
        """A new stream whose first item is a snapshot of the current block set."""
        sub = RelaySubscription(self, self._queue_size)
        sub._put(self._snapshot())
        self._subscribers.add(sub)
        return sub

    def num_subscribers(self) -> int:
        return len(self._subscribers)

    def _snapshot(self) -> RelayBatch:
        return RelayBatch(seq=self.seq, snapshot=True, stored=self.blocks.hashes(),
                          pooled_stored=self.pooled.hashes(),
                          tiered_stored=self.tiered.hashes())

    def publish(self, events: Iterable[KvEvent]) -> RelayBatch | None:
        """Apply one batch of events; returns what was sent (None: no net change)."""
        events = list(events)
        delta = self.blocks.apply(events)
        pooled = self.pooled.apply(events)
        tiered = self.tiered.apply(events)
        if not delta and not pooled and not tiered:
            return None
        self.seq += 1
        return self._send(RelayBatch(
            seq=self.seq, cleared=delta.cleared, stored=delta.stored, removed=delta.removed,
            pooled_stored=pooled.stored, pooled_removed=pooled.removed,
            tiered_stored=tiered.stored, tiered_removed=tiered.removed))

    def forget_tiered(self, hashes: list[int]) -> RelayBatch | None:
        """Blocks deleted from the shared tier (``dynagraph.llm.kv.offload.tier_trim``, by any
        worker of the tier): dropped from this engine's tier set, and sent on whether or
        not this engine wrote them, since the Router drops them for the whole tier."""
        if not hashes:
            return None
        self.tiered.discard(hashes)
        self.seq += 1
        return self._send(RelayBatch(seq=self.seq, tiered_removed=hashes))

    def _send(self, out: RelayBatch) -> RelayBatch:
        for sub in list(self._subscribers):
            if not sub._put(out):
                self.stats.resyncs += 1
                sub._reset(self._snapshot())
        return out

    def end(self) -> None:
        """End every subscriber's stream (their iterations stop). Idempotent."""
        for sub in list(self._subscribers):
            sub._reset(_CLOSED)
        self._subscribers.clear()


class KvEventRelay(KvEventFeed):
    """Receives one vLLM engine's KV events over ZMQ and fans them out to subscribers.

    Used by the worker: ``endpoint = relay.bind()`` before the engine starts (hand the
    endpoint to vLLM as ``kv_events_endpoint``), ``await relay.start()``, then
    ``relay.subscribe()`` per ``kv_events`` caller, ``await relay.close()`` on exit.
    ``hasher`` (optional) checks the first root ``BlockStored`` against our hashing.
    """

    def __init__(self, *, host: str = "127.0.0.1", queue_size: int = DEFAULT_QUEUE_SIZE,
                 hasher: BlockHasher | None = None) -> None:
        if host != "127.0.0.1" and host != "localhost":
            raise ValueError(f"the KV event relay binds to 127.0.0.1 only, not {host!r}")
        super().__init__(queue_size=queue_size)
        self._host = host
        self._hasher = hasher
        self._last_vllm_seq: int | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._endpoint: str | None = None

    @property
    def endpoint(self) -> str:
        if self._endpoint is None:
            raise RuntimeError("KvEventRelay.bind() was not called")
        return self._endpoint

    def bind(self) -> str:
        """Bind the SUB socket on a free port; return the endpoint vLLM must connect to."""
        if self._endpoint is not None:
            return self._endpoint
        self._ctx = zmq.asyncio.Context()
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        port = sock.bind_to_random_port(f"tcp://{self._host}")
        self._sock = sock
        self._endpoint = f"tcp://{self._host}:{port}"
        return self._endpoint

    async def start(self) -> None:
        """Start receiving (binds first if needed). Idempotent."""
        self.bind()
        if self._task is None:
            self._task = asyncio.create_task(self._receive(), name="kv-event-relay")

    def handle_frames(self, frames: list[bytes]) -> RelayBatch | None:
        """Process one received vLLM batch (public for tests); returns what was published."""
        verify = self._hasher is not None and self.stats.hashes_verified is None
        try:
            batch = decode_frames(frames, with_tokens=verify)
        except KvEventDecodeError as exc:
            self.stats.decode_errors += 1
            log.warning("dropping an undecodable KV event batch: %s", exc)
            return None
        self.stats.batches += 1
        if batch.seq >= 0:
            expected = 0 if self._last_vllm_seq is None else self._last_vllm_seq + 1
            if batch.seq != expected:
                self.stats.gaps += 1
                log.warning("KV events: vLLM seq %d after %s (expected %d); the block set "
                            "may be stale", batch.seq, self._last_vllm_seq, expected)
            self._last_vllm_seq = batch.seq
        if verify:
            self._verify(batch.events)
        return self.publish(batch.events)

    def _verify(self, events: list[KvEvent]) -> None:
        assert self._hasher is not None
        for ev in events:
            if isinstance(ev, BlocksStoredWithTokens):
                verdict = hashes_agree(self._hasher, ev)
                if verdict is not None:
                    self.stats.hashes_verified = verdict
                    if verdict:
                        log.info("KV events: vLLM's block hashes match ours (block size %d)",
                                 self._hasher.block_size)
                    else:
                        log.error("KV events: vLLM's block hashes differ from ours; check "
                                  "block-size, prefix_caching_hash_algo and PYTHONHASHSEED")
                    return

    async def _receive(self) -> None:
        assert self._sock is not None
        while True:
            try:
                frames = await self._sock.recv_multipart()
            except zmq.ZMQError as exc:
                log.warning("KV event relay socket failed: %s", exc)
                return
            self.handle_frames(frames)

    async def close(self) -> None:
        """Stop receiving, end every subscriber's stream, release the socket. Idempotent."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(task, 5)
        self.end()
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None


async def load_snapshots(load: Callable[[], EngineLoad], interval: float = 0.1, *,
                         changes_only: bool = False) -> AsyncIterator[EngineLoad]:
    """``load()`` now and then every ``interval`` seconds, on a fixed schedule.

    The schedule does not drift (a slow consumer delays, never bunches, the next
    sample). With ``changes_only`` a sample equal to the last one yielded is skipped
    (an idle engine's stream goes quiet; the request plane's heartbeats keep it alive).
    Runs until the consumer stops iterating.
    """
    if interval <= 0:
        raise ValueError(f"interval must be positive, got {interval}")
    next_at = time.monotonic()
    last: EngineLoad | None = None
    while True:
        now = load()
        if not changes_only or now != last:
            last = now
            yield now
        next_at += interval
        delay = next_at - time.monotonic()
        if delay < 0:
            next_at = time.monotonic()
            delay = 0.0
        await asyncio.sleep(delay)
