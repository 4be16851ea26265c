"""Admission control at the Frontend: a bounded number of requests in flight, a bounded
queue in front of them, a deadline in the queue. Nothing is dropped silently: a request
that cannot get in is refused at once (HTTP 429 with ``Retry-After``) and everything
admitted is counted until it is released.

    admission = Admission(max_inflight=256, max_queued=512, queue_timeout=30)
    release = await admission.acquire(priority)     # raises Overloaded
    try: ... finally: release()

Waiters are served by ``priority`` (the request's SLO class's, lower first), then in
arrival order: with SLO classes, an interactive request must not queue behind batch work
that fills every slot (at scale, batch waiting for SLO admission in the Processor held
all 256 slots and interactive TTFT grew to 16 s in arrival order). Memory is bounded by
``max_inflight + max_queued``.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections.abc import Callable


class Overloaded(Exception):
    """No room for the request; ``retry_after`` seconds is a fair time to come back."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Admission:
    """``reserved`` of the ``max_inflight`` slots are only for requests of priority
    ``top_priority`` or lower (the top SLO class): however much lower-priority work waits,
    a top-class request finds a slot at once while fewer than ``reserved`` of them run."""

    def __init__(self, *, max_inflight: int, max_queued: int, queue_timeout: float,
                 reserved: int = 0, top_priority: int = 0) -> None:
        if max_inflight < 1 or max_queued < 0 or queue_timeout < 0:
            raise ValueError("need max_inflight >= 1, max_queued >= 0, queue_timeout >= 0")
        if not 0 <= reserved < max_inflight:
            raise ValueError("need 0 <= reserved < max_inflight")
        self.max_inflight = max_inflight
        self.max_queued = max_queued
        self.queue_timeout = queue_timeout
        self.reserved = reserved
        self.top_priority = top_priority
        self.inflight = 0
        self.inflight_below_top = 0
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []  # a heap
        self._arrivals = itertools.count()

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self, priority: int = 0) -> Callable[[], None]:
        """A slot (call the returned function exactly once to give it back); a waiter of
        lower ``priority`` gets the next free slot before those of higher ones."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (priority, next(self._arrivals), fut)
        heapq.heappush(self._waiters, entry)
        self._dispatch()
        if fut.done():
            return self._releaser(priority)
        if len(self._waiters) > self.max_queued:
            self._forget(entry)
            raise Overloaded(f"the server is at capacity ({self.inflight} requests in flight, "
                             f"{len(self._waiters)} queued)", self._retry_after())
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.queue_timeout)
        except TimeoutError:
            if fut.done() and not fut.cancelled():
                return self._releaser(priority)  # handed a slot just as the deadline passed
            fut.cancel()
            raise Overloaded(f"no room for the request within {self.queue_timeout:g}s",
                             self._retry_after()) from None
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release(priority)  # the slot was ours: pass it on
            fut.cancel()
            raise
        finally:
            self._forget(entry)
        return self._releaser(priority)

    def _forget(self, entry: tuple[int, int, asyncio.Future[None]]) -> None:
        if entry in self._waiters:
            self._waiters.remove(entry)
            heapq.heapify(self._waiters)

    def _fits(self, priority: int) -> bool:
        if self.inflight >= self.max_inflight:
            return False
        return (priority <= self.top_priority
                or self.inflight_below_top < self.max_inflight - self.reserved)

    def _dispatch(self) -> None:
        """Free slots to the best waiters. The best one not fitting means none does: a
        worse one is of a priority at least as far below the top."""
        while self._waiters:
            priority, _, fut = self._waiters[0]
            if fut.done():  # gave up; its task forgets it
                heapq.heappop(self._waiters)
                continue
            if not self._fits(priority):
                return
            heapq.heappop(self._waiters)
            self.inflight += 1
            if priority > self.top_priority:
                self.inflight_below_top += 1
            fut.set_result(None)

    def _releaser(self, priority: int) -> Callable[[], None]:
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                self._release(priority)

        return release

    def _release(self, priority: int) -> None:
        self.inflight -= 1
        if priority > self.top_priority:
            self.inflight_below_top -= 1
        self._dispatch()

    def _retry_after(self) -> int:
        return max(1, math.ceil(min(self.queue_timeout, 30.0) / 4))
