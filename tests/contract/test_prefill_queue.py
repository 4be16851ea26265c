"""The prefill-queue contract (``dynagraph.runtime.queue.base``), on memory and NATS.

Each case uses real time with short ``ack_wait``s; a NATS client is "another process".
"""

from __future__ import annotations

import asyncio
import time

from dynagraph.runtime.queue import PrefillQueue, QueueStats, RemotePrefillJob, ReplyTarget
from tests.support.poll import until
from tests.support.queue import drain_ids, stats_become

from .conftest import QueueFactory

REPLY = ReplyTarget(component="VllmWorker", endpoint="prefill_done", instance_id=7)


def job(rid: str, timeout: float = 60.0, now: float | None = None) -> RemotePrefillJob:
    return RemotePrefillJob.create(request_id=rid, prompt_token_ids=list(range(100)),
                                   reply_to=REPLY, timeout=timeout, now=now)


async def test_enqueue_pull_ack_removes(queues: QueueFactory) -> None:
    q = await queues(ack_wait=5)
    assert isinstance(q, PrefillQueue)
    for i in range(3):
        await q.enqueue(job(f"r{i}"))
    assert await q.depth() == 3
    item = await q.pull(2)
    assert item is not None and item.delivery_count == 1
    assert item.job == job("r0", now=item.job.enqueued_at)
    assert await q.stats() == QueueStats(waiting=2, in_flight=1)
    await item.ack()
    await stats_become(q, QueueStats(waiting=2, in_flight=0))
    for i in (1, 2):
        it = await q.pull(2)
        assert it is not None and it.job.request_id == f"r{i}"
        await it.ack()
    assert await q.pull(0.2) is None
    await stats_become(q, QueueStats(waiting=0, in_flight=0))


async def test_consumers_share_each_job_once(queues: QueueFactory) -> None:
    producer, w1, w2 = await queues(), await queues(), await queues()
    for i in range(20):
        await producer.enqueue(job(f"j{i}"))

    a, b = await asyncio.gather(drain_ids(w1), drain_ids(w2))
    assert sorted(a + b) == sorted(f"j{i}" for i in range(20)) and not set(a) & set(b)


async def test_a_request_id_is_stored_once(queues: QueueFactory) -> None:
    q = await queues()
    await q.enqueue(job("same"))
    await q.enqueue(job("same"))
    assert await q.depth() == 1


async def test_unacked_job_is_redelivered_after_ack_wait(queues: QueueFactory) -> None:
    producer, dying, survivor = (await queues(ack_wait=1), await queues(ack_wait=1),
                                 await queues(ack_wait=1))
    await producer.enqueue(job("orphan"))
    t0 = time.monotonic()
    taken = await dying.pull(2)
    assert taken is not None and taken.delivery_count == 1  # never acked: the worker died
    again = await survivor.pull(5)
    assert again is not None and again.job.request_id == "orphan"
    assert again.delivery_count == 2 and time.monotonic() - t0 >= 0.9  # not before ack_wait
    await again.ack()
    await stats_become(producer, QueueStats(waiting=0, in_flight=0))


async def test_in_progress_keeps_the_job(queues: QueueFactory) -> None:
    q, other = await queues(ack_wait=1), await queues(ack_wait=1)
    await q.enqueue(job("long"))
    item = await q.pull(2)
    assert item is not None

    async def heartbeat() -> None:
        for _ in range(8):
            await asyncio.sleep(0.25)
            await item.in_progress()

    hb = asyncio.create_task(heartbeat())
    assert await other.pull(1.8) is None  # longer than ack_wait, but kept alive
    await hb
    await item.ack()


async def test_nak_redelivers_until_max_deliver(queues: QueueFactory) -> None:
    q = await queues(ack_wait=5, max_deliver=2)
    await q.enqueue(job("flaky"))
    first = await q.pull(2)
    assert first is not None
    await first.nak()
    second = await q.pull(2)
    assert second is not None and second.delivery_count == 2
    await second.nak()
    assert await q.pull(0.5) is None


async def test_term_is_never_redelivered(queues: QueueFactory) -> None:
    q = await queues(ack_wait=1)
    await q.enqueue(job("poison"))
    item = await q.pull(2)
    assert item is not None
    await item.term()
    assert await q.pull(1.5) is None
    await stats_become(q, QueueStats(waiting=0, in_flight=0))


async def test_a_job_past_its_deadline_is_dropped_on_pull(queues: QueueFactory) -> None:
    q = await queues()
    await q.enqueue(job("late", timeout=1, now=time.time() - 5))
    await q.enqueue(job("fine"))
    item = await q.pull(2)
    assert item is not None and item.job.request_id == "fine"


async def test_pull_waits_for_a_job_then_times_out(queues: QueueFactory) -> None:
    producer, consumer = await queues(), await queues()
    waiter = asyncio.create_task(consumer.pull(3))
    await until(lambda: not waiter.done(), 1)  # nothing yet
    await producer.enqueue(job("soon"))
    item = await asyncio.wait_for(waiter, 5)
    assert item is not None and item.job.request_id == "soon"
    await item.ack()
    t0 = time.monotonic()
    assert await consumer.pull(0.3) is None
    assert time.monotonic() - t0 >= 0.25
