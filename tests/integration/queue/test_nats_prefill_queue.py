"""NatsPrefillQueue specifics against a real nats-server (JetStream); the shared contract
is tests/contract/test_prefill_queue.py."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

import nats
import pytest

from dynagraph.runtime.infra import LocalService, free_port, start_nats
from dynagraph.runtime.queue import (
    NatsPrefillQueue,
    PrefillQueueError,
    QueueStats,
    RemotePrefillJob,
    ReplyTarget,
)
from tests.integration.queue.conftest import QueueFactory
from tests.support.queue import drain_ids, stats_become

pytestmark = pytest.mark.integration

REPLY = ReplyTarget(component="VllmWorker", endpoint="prefill_done", instance_id=1)
REPO_ROOT = str(Path(__file__).resolve().parents[3])


def job(rid: str, timeout: float = 60.0, now: float | None = None) -> RemotePrefillJob:
    return RemotePrefillJob.create(
        request_id=rid, prompt_token_ids=list(range(100)), reply_to=REPLY, timeout=timeout, now=now,
        engine_params={"kv_transfer_params": {"do_remote_decode": True}},
    )


async def test_concurrent_connect_and_shared_consumer(make_queue: QueueFactory) -> None:
    producer, w1, w2 = make_queue(), make_queue(), make_queue()
    await asyncio.gather(producer.connect(), w1.connect(), w2.connect())
    n = 30
    for i in range(n):
        await producer.enqueue(job(f"j{i}"))

    a, b = await asyncio.gather(drain_ids(w1), drain_ids(w2))
    assert sorted(a + b) == sorted(f"j{i}" for i in range(n))
    assert len(set(a) & set(b)) == 0
    assert await producer.stats() == QueueStats(waiting=0, in_flight=0)


async def test_dead_consumer_job_is_redelivered(make_queue: QueueFactory) -> None:
    producer, dying, survivor = make_queue(ack_wait=1), make_queue(ack_wait=1), make_queue(ack_wait=1)
    await asyncio.gather(producer.connect(), dying.connect(), survivor.connect())
    await producer.enqueue(job("orphan"))
    t0 = time.monotonic()
    taken = await dying.pull(2)
    assert taken is not None and taken.delivery_count == 1
    await dying.close()  # the worker's connection dies without an ack
    again = await survivor.pull(5)
    assert again is not None and again.job.request_id == "orphan"
    assert again.delivery_count == 2
    assert time.monotonic() - t0 >= 0.9  # not before ack_wait
    await again.ack()
    await stats_become(producer, QueueStats(waiting=0, in_flight=0))


async def test_old_jobs_expire_with_max_age(make_queue: QueueFactory) -> None:
    q = make_queue(max_age=1.0)
    await q.connect()
    await q.enqueue(job("stale"))
    assert await q.depth() == 1
    await stats_become(q, QueueStats(waiting=0, in_flight=0), within=5)
    assert await q.pull(0.2) is None


async def test_job_past_deadline_is_dropped(make_queue: QueueFactory) -> None:
    q = make_queue()
    await q.connect()
    await q.enqueue(job("late", timeout=1, now=time.time() - 5))
    await q.enqueue(job("fine"))
    item = await q.pull(2)
    assert item is not None and item.job.request_id == "fine"
    assert q.dropped_past_deadline == 1


async def test_survives_server_restart(own_nats: LocalService, make_queue: QueueFactory) -> None:
    producer = make_queue(own_nats.url, ack_wait=1, request_timeout=2)
    worker = make_queue(own_nats.url, ack_wait=1, request_timeout=2)
    await asyncio.gather(producer.connect(), worker.connect())
    for i in range(3):
        await producer.enqueue(job(f"k{i}"))
    held = await worker.pull(2)
    assert held is not None and held.job.request_id == "k0"

    restart = asyncio.create_task(asyncio.to_thread(own_nats.restart))
    await asyncio.sleep(0.05)
    await producer.enqueue(job("during"))  # likely while the server is down: waits, retries
    await restart
    await producer.enqueue(job("after"))  # same connections, reconnected
    got: dict[str, int] = {}
    end = time.monotonic() + 8
    while len(got) < 5 and time.monotonic() < end:
        item = await worker.pull(1)
        if item is not None:
            got[item.job.request_id] = item.delivery_count
            await item.ack()
    assert sorted(got) == ["after", "during", "k0", "k1", "k2"]
    assert got["k0"] == 2
    await stats_become(producer, QueueStats(waiting=0, in_flight=0))


async def test_connect_to_nothing_fails_fast() -> None:
    q = NatsPrefillQueue(f"nats://127.0.0.1:{free_port()}", "nobody", connect_timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(PrefillQueueError, match="cannot connect"):
        await q.connect()
    assert time.monotonic() - t0 < 5


async def test_recovers_when_the_stream_is_deleted(make_queue: QueueFactory) -> None:
    producer, worker, admin = make_queue(), make_queue(), make_queue()
    await asyncio.gather(producer.connect(), worker.connect(), admin.connect())
    await producer.enqueue(job("before"))
    await admin.destroy()  # e.g. a server that came back without its data
    assert await worker.pull(0.5) is None
    await producer.enqueue(job("after"))
    assert await producer.depth() == 1
    item = await worker.pull(2)
    assert item is not None and item.job.request_id == "after"
    await item.ack()


_HOLDER = """
import asyncio, sys
from dynagraph.runtime.queue import NatsPrefillQueue

async def main() -> None:
    q = NatsPrefillQueue(sys.argv[1], sys.argv[2], ack_wait=1)
    await q.connect()
    item = await q.pull(10)
    print("HELD", item.job.request_id if item else None, flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


async def test_killed_worker_process_job_is_redelivered(make_queue: QueueFactory) -> None:
    producer, survivor = make_queue(ack_wait=1), make_queue(ack_wait=1)
    await asyncio.gather(producer.connect(), survivor.connect())
    await producer.enqueue(job("victim"))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _HOLDER, producer.url, producer.namespace,
        stdout=asyncio.subprocess.PIPE, cwd=REPO_ROOT,
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 15)
        assert line.split() == [b"HELD", b"victim"]
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGKILL)
        await asyncio.wait_for(proc.wait(), 5)
    item = await survivor.pull(4)
    assert item is not None and item.job.request_id == "victim" and item.delivery_count == 2
    await item.ack()


async def test_undecodable_message_is_terminated(make_queue: QueueFactory) -> None:
    q = make_queue()
    await q.connect()
    nc = await nats.connect(q.url)
    try:
        await nc.jetstream().publish(q.subject, b"\xc1 not msgpack")
    finally:
        await nc.close()
    await q.enqueue(job("good"))
    item = await q.pull(2)
    assert item is not None and item.job.request_id == "good"
    await item.ack()
    await stats_become(q, QueueStats(waiting=0, in_flight=0))


async def test_many_processes_creating_the_queue_at_once() -> None:
    """Decode and prefill workers start together and all create the same stream on a
    fresh server. (Once, under load, nats-server answered such a racing create with
    "subjects overlap"; the retry for that answer is unit-tested in
    tests/unit/runtime/test_prefill_queue_stream_create.py.)"""
    for _ in range(4):
        svc = start_nats()
        queues = [NatsPrefillQueue(svc.url, "race", request_timeout=5) for _ in range(4)]
        try:
            await asyncio.gather(*(q.connect() for q in queues))
            await queues[0].enqueue(job("r"))
            assert (await queues[-1].stats()).waiting == 1
        finally:
            for q in queues:
                await q.close()
            svc.stop()
