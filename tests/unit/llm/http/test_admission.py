"""Admission: bounded in flight, bounded FIFO queue with a deadline, exact accounting."""

from __future__ import annotations

import asyncio

import pytest

from dynagraph.llm.http.admission import Admission, Overloaded


async def test_slots_then_queue_then_refusal() -> None:
    adm = Admission(max_inflight=2, max_queued=1, queue_timeout=5)
    r1, r2 = await adm.acquire(), await adm.acquire()
    waiter = asyncio.create_task(adm.acquire())
    await asyncio.sleep(0)
    assert adm.inflight == 2 and adm.queued == 1 and not waiter.done()
    with pytest.raises(Overloaded, match="at capacity") as info:
        await adm.acquire()  # queue full: refused at once
    assert info.value.retry_after >= 1
    r1()
    r3 = await asyncio.wait_for(waiter, 1)  # the freed slot went to the waiter
    assert adm.inflight == 2 and adm.queued == 0
    r1()  # releasing twice is harmless
    r2()
    r3()
    assert adm.inflight == 0


async def test_the_queue_deadline_refuses_and_forgets_the_waiter() -> None:
    adm = Admission(max_inflight=1, max_queued=4, queue_timeout=0.05)
    release = await adm.acquire()
    with pytest.raises(Overloaded, match="within 0.05s"):
        await adm.acquire()
    assert adm.queued == 0
    release()
    assert adm.inflight == 0


async def test_waiters_are_served_in_order_and_a_cancelled_one_passes_its_turn() -> None:
    adm = Admission(max_inflight=1, max_queued=4, queue_timeout=5)
    release = await adm.acquire()
    order: list[int] = []

    async def wait(i: int) -> None:
        rel = await adm.acquire()
        order.append(i)
        rel()

    tasks = [asyncio.create_task(wait(i)) for i in range(3)]
    await asyncio.sleep(0)
    tasks[1].cancel()
    release()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert order == [0, 2] and adm.inflight == 0 and adm.queued == 0


async def test_a_waiter_of_a_lower_priority_number_is_served_first() -> None:
    """Batch work (priority 10) holding the queue must not make an interactive request
    (priority 0) wait behind it; equal priorities keep arrival order."""
    adm = Admission(max_inflight=1, max_queued=8, queue_timeout=5)
    release = await adm.acquire(10)
    order: list[str] = []

    async def wait(name: str, priority: int) -> None:
        rel = await adm.acquire(priority)
        order.append(name)
        rel()

    tasks = []
    for name, priority in (("batch1", 10), ("batch2", 10), ("interactive", 0),
                           ("default", 5), ("batch3", 10)):
        tasks.append(asyncio.create_task(wait(name, priority)))
        await asyncio.sleep(0)  # queued in this order
    release()
    await asyncio.gather(*tasks)
    assert order == ["interactive", "default", "batch1", "batch2", "batch3"]
    assert adm.inflight == 0 and adm.queued == 0


async def test_reserved_slots_are_for_the_top_class_only() -> None:
    """Batch work fills the open slots and queues; an interactive request still gets a
    reserved slot at once, and batch never takes one."""
    adm = Admission(max_inflight=3, max_queued=8, queue_timeout=5, reserved=1, top_priority=0)
    batch = [await adm.acquire(10), await adm.acquire(10)]
    queued = asyncio.create_task(adm.acquire(10))  # the reserved slot is not for it
    await asyncio.sleep(0)
    assert not queued.done() and adm.inflight == 2 and adm.queued == 1
    interactive = await asyncio.wait_for(adm.acquire(0), 1)
    assert adm.inflight == 3 and adm.inflight_below_top == 2
    interactive()  # the reserved slot is free again, and still not batch's
    await asyncio.sleep(0)
    assert not queued.done() and adm.inflight == 2
    batch[0]()  # an open slot: the queued batch request takes it
    release = await asyncio.wait_for(queued, 1)
    assert adm.inflight == 2 and adm.inflight_below_top == 2 and adm.queued == 0
    for r in (release, batch[1]):
        r()
    assert adm.inflight == 0 and adm.inflight_below_top == 0


def test_the_reserve_must_leave_an_open_slot() -> None:
    with pytest.raises(ValueError, match="reserved"):
        Admission(max_inflight=2, max_queued=0, queue_timeout=1, reserved=2)
