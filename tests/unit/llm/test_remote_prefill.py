"""Remote prefill without services: coordinator (decode side) + job handler (prefill side)
wired through the in-memory queue, with a fake engine and an in-process reply call."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from dynagraph.errors import EngineError, NoInstancesError, StreamBroken
from dynagraph.llm.disagg.coordinator import (
    PrefillAck,
    PrefillPlan,
    PrefillResult,
    PrefixCacheEstimate,
    RemotePrefillCoordinator,
)
from dynagraph.llm.disagg.metrics import PrefillMetrics
from dynagraph.llm.disagg.policy import DisaggConfig, LiveDisaggSettings
from dynagraph.llm.disagg.prefill import PrefillJobHandler, serve_queue
from dynagraph.llm.engines.base import EngineOutput, SamplingSpec
from dynagraph.llm.router.hashing import BlockHasher
from dynagraph.runtime.queue import (
    MemoryPrefillQueue,
    PrefillQueueError,
    RemotePrefillJob,
    ReplyTarget,
)

REPLY = ReplyTarget(component="VllmWorker", endpoint="prefill_done", instance_id=7)


class FakeEngine:
    def __init__(self, *, fail: bool = False, delay: float = 0.0) -> None:
        self.calls: list[tuple[str, list[int], dict[str, Any] | None]] = []
        self.fail = fail
        self.delay = delay

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec,
                       *, kv_transfer_params: dict[str, Any] | None = None
                       ) -> AsyncIterator[EngineOutput]:
        assert sampling.max_tokens == 1
        self.calls.append((request_id, prompt_token_ids, kv_transfer_params))
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.fail:
            raise EngineError("boom")
        yield EngineOutput(token_ids=[1], finish_reason="length",
                           kv_transfer_params={"remote_block_ids": [[1]], "n": len(prompt_token_ids)})


def settings(**kw: Any) -> LiveDisaggSettings:
    base = DisaggConfig(remote_prefill=True, max_local_prefill_length=kw.pop("threshold", 64),
                        remote_prefill_timeout=kw.pop("timeout", 2.0), **kw)
    return LiveDisaggSettings(base, namespace="t")


def coordinator(queue: Any, **kw: Any) -> RemotePrefillCoordinator:
    return RemotePrefillCoordinator(
        settings=kw.pop("settings", settings()), queue=queue, reply_to=REPLY,
        prefix=PrefixCacheEstimate(BlockHasher(16), capacity_blocks=1000),
        prefill_workers=kw.pop("workers", lambda: 1), **kw,
    )


def wire(coord: RemotePrefillCoordinator, calls: list[PrefillResult]) -> Any:
    async def reply(target: ReplyTarget, result: PrefillResult) -> PrefillAck:
        assert target == REPLY
        calls.append(result)
        return PrefillAck(accepted=coord.deliver(result))
    return reply


async def plan_served(q: MemoryPrefillQueue, handler: PrefillJobHandler,
                      c: RemotePrefillCoordinator, prompt: list[int]) -> PrefillPlan:
    """``c.plan`` of ``prompt`` while ``handler`` serves the queue."""
    server = asyncio.create_task(serve_queue(q, handler, pull_timeout=0.05))
    try:
        return await c.plan("r1", prompt)
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)


# --- PrefixCacheEstimate -------------------------------------------------------------------

def test_prefix_estimate_full_blocks_and_lru() -> None:
    est = PrefixCacheEstimate(BlockHasher(4), capacity_blocks=3)
    a = est.hashes(list(range(10)))  # two full blocks
    assert a == BlockHasher(4).block_hashes(list(range(8)))  # the engine's own hashes
    assert est.cached_len(a) == 0
    est.record(a)
    assert len(est) == 2
    assert est.cached_len(a) == 8
    assert est.cached_len(est.hashes(list(range(4)) + [99] * 6)) == 4  # diverges in block 2
    est.record(est.hashes([50, 51, 52, 53, 54, 55, 56, 57]))  # 2 more: evicts a's first block
    assert len(est) == 3
    assert est.cached_len(a) == 0  # chain broken at block 1


# --- coordinator decisions -----------------------------------------------------------------

async def test_short_prompt_stays_local_without_touching_the_queue() -> None:
    q = MemoryPrefillQueue()
    await q.connect()
    c = coordinator(q)
    plan = await c.plan("r1", list(range(64)))
    assert not plan.remote and plan.decision.reason == "short-prompt" and plan.fallback is None
    assert (await q.stats()).waiting == 0


async def test_cached_prefix_counts_against_the_threshold() -> None:
    q = MemoryPrefillQueue()
    await q.connect()
    c = coordinator(q, settings=settings(timeout=0.05))
    prompt = list(range(100))
    first = await c.plan("r1", prompt)  # 100 uncached > 64: remote, nobody answers
    assert first.fallback == "timeout"
    second = await c.plan("r2", prompt + [1, 2])  # 96 cached, 6 uncached
    assert second.decision.reason == "short-prompt"


async def test_remote_round_trip_through_the_queue() -> None:
    q = MemoryPrefillQueue()
    await q.connect()
    metrics = PrefillMetrics(CollectorRegistry())
    c = coordinator(q, metrics=metrics)
    engine = FakeEngine()
    sent: list[PrefillResult] = []
    pulls: list[tuple[float, int]] = []
    handler = PrefillJobHandler(engine, wire(c, sent), instance_id=3, observer=PullLog(pulls))
    plan = await plan_served(q, handler, c, list(range(200)))
    assert plan.remote and plan.kv_transfer_params == {"remote_block_ids": [[1]], "n": 200}
    assert plan.result is not None and plan.result.prefill_instance == 3
    assert engine.calls[0][2] == {"do_remote_decode": True}
    assert len(sent) == 1
    stats = await q.stats()
    assert (stats.waiting, stats.in_flight) == (0, 0)  # acked
    assert metrics.requests.labels("remote", "long-prompt")._value.get() == 1
    assert c.pending == 0
    assert len(pulls) == 1 and pulls[0][1] == 1  # the queue-wait/redelivery metrics saw it


async def test_a_stopping_server_finishes_the_jobs_in_hand_and_pulls_no_more() -> None:
    q = MemoryPrefillQueue()
    await q.connect()
    c = coordinator(q)
    engine = FakeEngine(delay=0.2)
    sent: list[PrefillResult] = []
    stopping = asyncio.Event()
    server = asyncio.create_task(serve_queue(q, PrefillJobHandler(engine, wire(c, sent)),
                                             pull_timeout=0.05, stopping=stopping))
    plan = asyncio.create_task(c.plan("r1", list(range(200))))
    async with asyncio.timeout(2):
        while not engine.calls:  # noqa: ASYNC110 - polls the fake engine
            await asyncio.sleep(0.01)
    stopping.set()  # mid-prefill
    await asyncio.wait_for(server, 2)  # returns by itself, the job done
    assert (await plan).remote and len(sent) == 1
    later = asyncio.create_task(c.plan("r2", list(range(300))))
    await asyncio.sleep(0.2)
    assert len(engine.calls) == 1 and (await q.stats()).waiting == 1  # not pulled
    later.cancel()
    await asyncio.gather(later, return_exceptions=True)


class PullLog:
    def __init__(self, pulls: list[tuple[float, int]]) -> None:
        self.pulls = pulls

    def pulled(self, enqueued_at: float, delivery_count: int) -> None:
        self.pulls.append((enqueued_at, delivery_count))


async def test_no_prefill_worker_means_local_at_once() -> None:
    q = MemoryPrefillQueue()
    await q.connect()
    c = coordinator(q, workers=lambda: 0)
    plan = await c.plan("r1", list(range(200)))
    assert plan.fallback == "no-prefill-worker" and plan.label == "fallback"
    assert (await q.stats()).waiting == 0


async def test_queue_full_stays_local() -> None:
    q = MemoryPrefillQueue()
    await q.connect()
    for i in range(2):
        await q.enqueue(RemotePrefillJob.create(request_id=f"x{i}", prompt_token_ids=[1],
                                                reply_to=REPLY, timeout=30))
    c = coordinator(q)
    plan = await c.plan("r1", list(range(200)))
    assert not plan.remote and plan.decision.reason == "queue-full"


class BrokenQueue(MemoryPrefillQueue):
    async def depth(self) -> int:
        raise PrefillQueueError("down")


async def test_unreachable_queue_falls_back_to_local() -> None:
    c = coordinator(BrokenQueue())
    plan = await c.plan("r1", list(range(200)))
    assert plan.fallback == "queue-error" and not plan.remote


async def test_live_threshold_change_switches_the_decision() -> None:
    q = MemoryPrefillQueue()
    await q.connect()
    live = settings(timeout=0.05)
    c = coordinator(q, settings=live)
    assert (await c.plan("r1", list(range(100)))).decision.remote
    live.apply("/t/settings/VllmWorker/max-local-prefill-length", "5000")
    assert (await c.plan("r2", list(range(1000, 1100)))).decision.reason == "short-prompt"


async def test_late_result_is_refused() -> None:
    c = coordinator(MemoryPrefillQueue())
    assert not c.deliver(PrefillResult(request_id="nobody", kv_transfer_params={}))


# --- job handler ---------------------------------------------------------------------------

async def enqueue_and_pull(q: MemoryPrefillQueue, job_timeout: float = 5.0) -> Any:
    await q.enqueue(RemotePrefillJob.create(request_id="j1", prompt_token_ids=[1, 2, 3],
                                            reply_to=REPLY, timeout=job_timeout))
    item = await q.pull(1.0)
    assert item is not None
    return item


async def test_engine_failure_gives_the_job_back() -> None:
    q = MemoryPrefillQueue()
    await q.connect()
    item = await enqueue_and_pull(q)

    async def reply(target: ReplyTarget, result: PrefillResult) -> PrefillAck:
        raise AssertionError("must not reply")

    out = await PrefillJobHandler(FakeEngine(fail=True), reply).handle(item)
    assert out.status == "engine-failed"
    again = await q.pull(1.0)
    assert again is not None and again.delivery_count == 2


@pytest.mark.parametrize(("failure", "status", "redelivered"), [
    (NoInstancesError("gone"), "decode-gone", False),  # the decode worker is gone: term
    (StreamBroken("cut"), "reply-failed", True),        # a broken hand-off: nak, retried
])
async def test_a_failed_hand_off(failure: Exception, status: str, redelivered: bool) -> None:
    q = MemoryPrefillQueue()
    await q.connect()
    item = await enqueue_and_pull(q)

    async def reply(target: ReplyTarget, result: PrefillResult) -> PrefillAck:
        raise failure

    out = await PrefillJobHandler(FakeEngine(), reply).handle(item)
    assert out.status == status
    if redelivered:
        assert await q.pull(1.0) is not None
    else:
        stats = await q.stats()
        assert (stats.waiting, stats.in_flight) == (0, 0)


async def test_late_hand_off_still_acks() -> None:
    q = MemoryPrefillQueue()
    await q.connect()
    item = await enqueue_and_pull(q)

    async def reply(target: ReplyTarget, result: PrefillResult) -> PrefillAck:
        return PrefillAck(accepted=False)

    out = await PrefillJobHandler(FakeEngine(), reply).handle(item)
    assert out.status == "late"
    stats = await q.stats()
    assert (stats.waiting, stats.in_flight) == (0, 0)


async def test_expired_while_held_is_terminated() -> None:
    q = MemoryPrefillQueue()
    await q.connect()
    item = await enqueue_and_pull(q, job_timeout=0.1)

    async def reply(target: ReplyTarget, result: PrefillResult) -> PrefillAck:
        raise AssertionError("must not reply")

    out = await PrefillJobHandler(FakeEngine(), reply, hold_s=lambda: 0.2).handle(item)
    assert out.status == "expired"
    stats = await q.stats()
    assert (stats.waiting, stats.in_flight) == (0, 0)


async def test_a_prefill_still_running_at_the_deadline_is_cancelled_and_dropped() -> None:
    q = MemoryPrefillQueue(ack_wait=0.1)
    await q.connect()
    item = await enqueue_and_pull(q, job_timeout=0.2)

    async def reply(target: ReplyTarget, result: PrefillResult) -> PrefillAck:
        raise AssertionError("must not reply")

    engine = FakeEngine(delay=3600)  # an engine request that never finishes
    out = await asyncio.wait_for(
        PrefillJobHandler(engine, reply, heartbeat_s=0.03).handle(item), 5)
    assert out.status == "expired" and 0.1 < out.prefill_s < 2
    assert len(engine.calls) == 1
    stats = await q.stats()
    assert (stats.waiting, stats.in_flight) == (0, 0)  # terminated, never redelivered


async def test_heartbeat_keeps_a_long_prefill_from_redelivery() -> None:
    q = MemoryPrefillQueue(ack_wait=0.1)
    await q.connect()
    item = await enqueue_and_pull(q)
    seen: list[PrefillResult] = []

    async def reply(target: ReplyTarget, result: PrefillResult) -> PrefillAck:
        seen.append(result)
        return PrefillAck(accepted=True)

    handler = PrefillJobHandler(FakeEngine(delay=0.35), reply, heartbeat_s=0.03)
    task = asyncio.create_task(handler.handle(item))
    assert await q.pull(0.3) is None  # not redelivered while the heartbeat runs
    out = await task
    assert out.status == "handed-off" and len(seen) == 1


def test_serve_queue_rejects_zero_concurrency() -> None:
    with pytest.raises(ValueError):
        asyncio.run(serve_queue(MemoryPrefillQueue(), PrefillJobHandler(FakeEngine(), None),  # type: ignore[arg-type]
                                concurrency=0))
