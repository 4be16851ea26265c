"""Helpers for prefill-queue tests (the contract on every backend, and NATS specifics)."""

from __future__ import annotations

import asyncio
import time

from dynagraph.runtime.queue import PrefillQueue, QueueStats


async def stats_become(q: PrefillQueue, want: QueueStats, within: float = 5.0) -> None:
    """Poll ``q.stats()`` until it equals ``want``; fail naming both after ``within`` s."""
    deadline = time.monotonic() + within
    while (got := await q.stats()) != want:
        assert time.monotonic() < deadline, f"stats {got} != {want} after {within}s"
        await asyncio.sleep(0.02)


async def drain_ids(q: PrefillQueue, wait_s: float = 0.5) -> list[str]:
    """Pull and ack until a pull waits ``wait_s`` for nothing: the request ids, in order."""
    got: list[str] = []
    while (item := await q.pull(wait_s)) is not None:
        got.append(item.job.request_id)
        await item.ack()
    return got
