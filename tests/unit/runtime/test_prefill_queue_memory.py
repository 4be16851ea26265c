"""MemoryPrefillQueue semantics with a stepped clock, plus the job wire format."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from dynagraph.errors import ConfigError
from dynagraph.runtime.queue import (
    MemoryPrefillQueue,
    PrefillQueue,
    PrefillQueueError,
    PrefillSampling,
    QueueItem,
    QueueStats,
    RemotePrefillJob,
    ReplyTarget,
    decode_job,
    encode_job,
    stream_name,
    subject_name,
)

REPLY = ReplyTarget(component="VllmWorker", endpoint="prefill_done", instance_id=7)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def step(self, dt: float) -> None:
        self.t += dt


def job(rid: str, clock: Clock, timeout: float = 1000.0, n: int = 4) -> RemotePrefillJob:
    return RemotePrefillJob.create(
        request_id=rid, prompt_token_ids=list(range(n)), reply_to=REPLY, timeout=timeout, now=clock()
    )


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def q(clock: Clock) -> MemoryPrefillQueue:
    return MemoryPrefillQueue(ack_wait=10, max_deliver=3, max_age=100, duplicate_window=50,
                              clock=clock, wall_clock=clock)


async def pull(q: MemoryPrefillQueue) -> QueueItem | None:
    return await q.pull(0)


# -- wire format ---------------------------------------------------------------------

def test_job_roundtrip_is_msgpack() -> None:
    j = RemotePrefillJob.create(
        request_id="r1", prompt_token_ids=[1, 2, 3], reply_to=REPLY, timeout=5.0, now=100.0,
        sampling=PrefillSampling(temperature=0.0, seed=3),
        engine_params={"kv_transfer_params": {"do_remote_decode": True}},
    )
    data = encode_job(j)
    assert isinstance(data, bytes)
    assert decode_job(data) == j
    assert j.enqueued_at == 100.0 and j.deadline == 105.0
    assert not j.expired(104.9) and j.expired(105.0)


def test_bad_payload_is_rejected() -> None:
    with pytest.raises(msgspec.ValidationError):
        decode_job(msgspec.msgpack.encode({"request_id": 3}))
    with pytest.raises(ValueError):
        RemotePrefillJob.create(request_id="x", prompt_token_ids=[], reply_to=REPLY, timeout=0)


def test_names_per_namespace() -> None:
    assert stream_name("dynamo") == "PREFILL_dynamo"
    assert subject_name("dyn-1") == "dynagraph.dyn-1.prefill"
    with pytest.raises(ConfigError):
        stream_name("a.b")


def test_satisfies_protocols(q: MemoryPrefillQueue) -> None:
    assert isinstance(q, PrefillQueue)


# -- delivery semantics ----------------------------------------------------------------

async def test_enqueue_pull_ack_removes(q: MemoryPrefillQueue, clock: Clock) -> None:
    await q.enqueue(job("a", clock))
    await q.enqueue(job("b", clock))
    assert await q.depth() == 2
    item = await pull(q)
    assert item is not None and isinstance(item, QueueItem)
    assert (item.job.request_id, item.delivery_count) == ("a", 1)
    assert await q.stats() == QueueStats(waiting=1, in_flight=1)
    await item.ack()
    assert await q.stats() == QueueStats(waiting=1, in_flight=0)
    item_b = await pull(q)
    assert item_b is not None and item_b.job.request_id == "b"
    await item_b.ack()
    assert await pull(q) is None
    assert await q.stats() == QueueStats(waiting=0, in_flight=0)


async def test_unacked_is_redelivered_after_ack_wait(q: MemoryPrefillQueue, clock: Clock) -> None:
    await q.enqueue(job("a", clock))
    first = await pull(q)
    assert first is not None
    clock.step(9.9)
    assert await pull(q) is None
    clock.step(0.1)
    again = await pull(q)
    assert again is not None and again.job.request_id == "a" and again.delivery_count == 2
    await again.ack()
    assert await q.stats() == QueueStats(waiting=0, in_flight=0)


async def test_redelivery_goes_before_new_jobs(q: MemoryPrefillQueue, clock: Clock) -> None:
    await q.enqueue(job("a", clock))
    assert await pull(q) is not None
    await q.enqueue(job("b", clock))
    clock.step(10)
    got = await pull(q)
    assert got is not None and got.job.request_id == "a"


async def test_in_progress_extends_ack_wait(q: MemoryPrefillQueue, clock: Clock) -> None:
    await q.enqueue(job("a", clock))
    item = await pull(q)
    assert item is not None
    clock.step(8)
    await item.in_progress()
    clock.step(8)
    assert await pull(q) is None
    clock.step(2)
    assert (await pull(q)) is not None


async def test_nak_now_and_with_delay(q: MemoryPrefillQueue, clock: Clock) -> None:
    await q.enqueue(job("a", clock))
    item = await pull(q)
    assert item is not None
    await item.nak()
    again = await pull(q)
    assert again is not None and again.delivery_count == 2
    await again.nak(delay=3)
    clock.step(2.9)
    assert await pull(q) is None
    clock.step(0.1)
    third = await pull(q)
    assert third is not None and third.delivery_count == 3


async def test_max_deliver_then_gone(q: MemoryPrefillQueue, clock: Clock) -> None:
    await q.enqueue(job("a", clock))
    counts = []
    for _ in range(3):
        item = await pull(q)
        assert item is not None
        counts.append(item.delivery_count)
        clock.step(10)
    assert counts == [1, 2, 3]
    assert await pull(q) is None
    assert q.dropped_max_deliver == 1
    assert await q.stats() == QueueStats(waiting=0, in_flight=0)


async def test_late_ack_from_first_delivery_still_acks(q: MemoryPrefillQueue, clock: Clock) -> None:
    await q.enqueue(job("a", clock))
    first = await pull(q)
    clock.step(10)
    second = await pull(q)
    assert first is not None and second is not None
    await first.ack()
    clock.step(10)
    assert await pull(q) is None


async def test_term_never_redelivers(q: MemoryPrefillQueue, clock: Clock) -> None:
    await q.enqueue(job("a", clock))
    item = await pull(q)
    assert item is not None
    await item.term()
    clock.step(10)
    assert await pull(q) is None


async def test_max_age_expires_waiting_and_in_flight(q: MemoryPrefillQueue, clock: Clock) -> None:
    await q.enqueue(job("old", clock))
    await q.enqueue(job("held", clock))
    clock.step(50)
    await q.enqueue(job("young", clock))
    held = await pull(q)
    assert held is not None and held.job.request_id == "old"
    assert await q.stats() == QueueStats(waiting=2, in_flight=1)
    clock.step(50)
    assert await q.stats() == QueueStats(waiting=1, in_flight=0)
    young = await pull(q)
    assert young is not None and young.job.request_id == "young"


async def test_job_past_deadline_is_dropped_on_pull(q: MemoryPrefillQueue, clock: Clock) -> None:
    await q.enqueue(job("late", clock, timeout=5))
    await q.enqueue(job("fine", clock, timeout=50))
    clock.step(5)
    assert await q.depth() == 2  # a deadline does not shrink the depth until pulled
    item = await pull(q)
    assert item is not None and item.job.request_id == "fine"
    assert q.dropped_past_deadline == 1


async def test_duplicate_request_id_within_window(q: MemoryPrefillQueue, clock: Clock) -> None:
    await q.enqueue(job("a", clock))
    await q.enqueue(job("a", clock))
    assert await q.depth() == 1
    clock.step(50)
    await q.enqueue(job("a", clock))
    assert await q.depth() == 2


async def test_pull_waits_for_enqueue_and_times_out() -> None:
    q = MemoryPrefillQueue(ack_wait=10)
    assert await q.pull(0.01) is None
    waiter = asyncio.create_task(q.pull(5))
    await asyncio.sleep(0)
    await q.enqueue(RemotePrefillJob.create(request_id="w", prompt_token_ids=[1], reply_to=REPLY,
                                            timeout=60))
    item = await asyncio.wait_for(waiter, 1)
    assert item is not None and item.job.request_id == "w"


async def test_two_consumers_share_each_job_once(q: MemoryPrefillQueue, clock: Clock) -> None:
    for i in range(10):
        await q.enqueue(job(f"j{i}", clock))

    async def worker() -> list[str]:
        got = []
        while (item := await q.pull(0)) is not None:
            got.append(item.job.request_id)
            await item.ack()
            await asyncio.sleep(0)
        return got

    a, b = await asyncio.gather(worker(), worker())
    assert sorted(a + b) == sorted(f"j{i}" for i in range(10))
    assert a and b


async def test_closed_queue_raises(q: MemoryPrefillQueue, clock: Clock) -> None:
    await q.close()
    with pytest.raises(PrefillQueueError):
        await q.enqueue(job("a", clock))
    await q.connect()
    await q.enqueue(job("a", clock))
