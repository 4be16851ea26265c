"""In-memory prefill queue with the same delivery semantics as the NATS one.

For unit tests and single-process demos. One ``MemoryPrefillQueue`` object is shared
by producers and consumers (there is no server). Clocks are injectable so tests can
step time exactly: ``clock`` (monotonic seconds) drives ack_wait, nak delays and
max_age; ``wall_clock`` (UNIX seconds) is compared with each job's ``deadline``.

Differences from JetStream worth knowing: a job that reached ``max_deliver`` is
forgotten at once (JetStream keeps it in the stream, undeliverable, until max_age);
``pull`` hands out redeliveries before new jobs, in enqueue order.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from dynagraph.runtime.queue.base import (
    DEFAULT_ACK_WAIT,
    DEFAULT_DUPLICATE_WINDOW,
    DEFAULT_MAX_AGE,
    DEFAULT_MAX_DELIVER,
    PrefillQueueError,
    QueueStats,
)
from dynagraph.runtime.queue.job import RemotePrefillJob

log = logging.getLogger(__name__)


@dataclass
class _Entry:
    seq: int
    job: RemotePrefillJob
    stored_at: float
    deliveries: int = 0
    due: float | None = None  # set while in flight: when it becomes redeliverable


class MemoryQueueItem:
    """A delivery from a ``MemoryPrefillQueue``; settle with ack / nak / term."""

    def __init__(self, queue: MemoryPrefillQueue, entry: _Entry) -> None:
        self._queue = queue
        self._entry = entry
        self._delivery = entry.deliveries

    @property
    def job(self) -> RemotePrefillJob:
        return self._entry.job

    @property
    def delivery_count(self) -> int:
        return self._delivery

    def _current(self) -> bool:
        # Like JetStream, a settle from an older delivery still applies while the job exists.
        return self._queue._entries.get(self._entry.seq) is self._entry

    async def ack(self) -> None:
        if self._current():
            self._queue._remove(self._entry.seq)

    async def term(self) -> None:
        await self.ack()

    async def nak(self, delay: float | None = None) -> None:
        if self._current():
            self._entry.due = self._queue._clock() + (delay or 0.0)
            self._queue._changed.set()

    async def in_progress(self) -> None:
        if self._current():
            self._entry.due = self._queue._clock() + self._queue.ack_wait


class MemoryPrefillQueue:
    """A ``PrefillQueue`` in process memory. See the module docstring."""

    def __init__(
        self,
        *,
        ack_wait: float = DEFAULT_ACK_WAIT,
        max_deliver: int = DEFAULT_MAX_DELIVER,
        max_age: float = DEFAULT_MAX_AGE,
        duplicate_window: float = DEFAULT_DUPLICATE_WINDOW,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if ack_wait <= 0 or max_age <= 0 or max_deliver < 1:
            raise ValueError("ack_wait and max_age must be > 0 and max_deliver >= 1")
        self.ack_wait = ack_wait
        self.max_deliver = max_deliver
        self.max_age = max_age
        self.duplicate_window = duplicate_window
        self._clock = clock
        self._wall_clock = wall_clock
        self._entries: dict[int, _Entry] = {}
        self._fresh: deque[int] = deque()  # never delivered, in enqueue order
        self._recent_ids: dict[str, float] = {}
        self._seq = 0
        self._changed = asyncio.Event()
        self._closed = False
        self.dropped_past_deadline = 0
        self.dropped_max_deliver = 0

    async def connect(self) -> None:
        self._closed = False

    async def close(self) -> None:
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise PrefillQueueError("memory prefill queue is closed; call connect() first")

    async def enqueue(self, job: RemotePrefillJob) -> None:
        self._check_open()
        now = self._clock()
        self._sweep(now)
        seen = self._recent_ids.get(job.request_id)
        if seen is not None and now - seen < self.duplicate_window:
            log.debug("duplicate prefill job %s ignored", job.request_id)
            return
        self._recent_ids[job.request_id] = now
        self._seq += 1
        self._entries[self._seq] = _Entry(self._seq, job, now)
        self._fresh.append(self._seq)
        self._changed.set()

    async def depth(self) -> int:
        self._check_open()
        self._sweep(self._clock())
        return len(self._fresh)

    async def stats(self) -> QueueStats:
        self._check_open()
        self._sweep(self._clock())
        return QueueStats(waiting=len(self._fresh), in_flight=len(self._entries) - len(self._fresh))

    async def pull(self, timeout: float) -> MemoryQueueItem | None:  # noqa: ASYNC109 - long-poll time, not a cancel
        self._check_open()
        loop = asyncio.get_running_loop()
        end = loop.time() + max(timeout, 0.0)
        while True:
            self._changed.clear()
            item = self._take()
            if item is not None:
                return item
            remaining = end - loop.time()
            if remaining <= 0:
                return None
            wait = remaining
            next_due = min((e.due for e in self._entries.values() if e.due is not None), default=None)
            if next_due is not None:
                wait = min(wait, max(next_due - self._clock(), 0.001))
            try:
                await asyncio.wait_for(self._changed.wait(), wait)
            except TimeoutError:
                pass

    def _take(self) -> MemoryQueueItem | None:
        """Deliver the next redeliverable or fresh job that is still wanted."""
        while True:
            now = self._clock()
            self._sweep(now)
            entry = self._next_due(now)
            if entry is None and self._fresh:
                entry = self._entries[self._fresh.popleft()]
            if entry is None:
                return None
            entry.deliveries += 1
            entry.due = now + self.ack_wait
            if entry.job.expired(self._wall_clock()):
                log.info("prefill job %s is past its deadline; dropped", entry.job.request_id)
                self.dropped_past_deadline += 1
                self._remove(entry.seq)
                continue
            return MemoryQueueItem(self, entry)

    def _next_due(self, now: float) -> _Entry | None:
        due = [e for e in self._entries.values() if e.due is not None and e.due <= now]
        return min(due, key=lambda e: e.seq) if due else None

    def _sweep(self, now: float) -> None:
        """Apply max_age, max_deliver and the duplicate window at time ``now``."""
        for entry in list(self._entries.values()):
            if now - entry.stored_at >= self.max_age:
                log.info("prefill job %s older than max_age; expired", entry.job.request_id)
                self._remove(entry.seq)
            elif entry.due is not None and entry.due <= now and entry.deliveries >= self.max_deliver:
                log.warning(
                    "prefill job %s not acked after %d deliveries; dropped",
                    entry.job.request_id, entry.deliveries,
                )
                self.dropped_max_deliver += 1
                self._remove(entry.seq)
        stale = [rid for rid, t in self._recent_ids.items() if now - t >= self.duplicate_window]
        for rid in stale:
            del self._recent_ids[rid]

    def _remove(self, seq: int) -> None:
        entry = self._entries.pop(seq, None)
        if entry is not None and entry.due is None:
            self._fresh.remove(seq)
