"""Processor with a Router: asks it, calls the chosen worker, falls back on failures."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from components.kv_router import Router
from components.processor import Processor, ProcessorConfig
from components.worker import VllmWorker
from dynagraph.errors import InstanceUnavailable, NoInstancesError, RemoteError, StreamBroken
from dynagraph.llm.migration import Attempt
from dynagraph.llm.protocol import PreprocessedRequest, SamplingParams
from dynagraph.sdk import instance_ids
from dynagraph.sdk.testing import in_memory_client


class FakeRouter:
    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.asked: list[Any] = []
        self.closed = 0

    def client(self) -> Any:
        return in_memory_client(Router, {"generate": self.generate})

    async def generate(self, request: Any, instance_id: int) -> AsyncIterator[Any]:
        self.asked.append(request)
        try:
            if isinstance(self.answer, Exception):
                raise self.answer
            yield self.answer
        finally:
            self.closed += 1


class FakeWorkers:
    def __init__(self, ids: list[int], broken: dict[int, Exception] | None = None) -> None:
        self.ids = ids
        self.broken = broken or {}
        self.calls: list[int] = []

    def client(self) -> Any:
        return in_memory_client(VllmWorker, {"generate": self.direct},
                                instance_ids=lambda: self.ids)

    async def direct(self, request: Any, instance_id: int) -> AsyncIterator[Any]:
        self.calls.append(instance_id)
        if instance_id in self.broken:
            raise self.broken[instance_id]
        yield {"token_ids": [instance_id]}
        yield {"token_ids": [instance_id], "finish_reason": "length"}


@pytest.fixture
def processor(tiny_tokenizer_dir: Path) -> Callable[[Any, FakeWorkers], Processor]:
    def make(router: Any, workers: FakeWorkers) -> Processor:
        config = ProcessorConfig(model=str(tiny_tokenizer_dir), router_mode="kv")
        return Processor(config, router=router.client(), worker=workers.client())

    return make


Make = Callable[[Any, FakeWorkers], Processor]


def decision(worker_id: int) -> dict[str, Any]:
    return {"worker_id": worker_id, "overlap_blocks": 1, "request_blocks": 1, "mode": "kv"}


async def dispatched(processor: Make, workers: FakeWorkers) -> list[int]:
    """The tokens a request gets through ``_dispatch`` (migration on) when no Router answers
    (round robin over ``workers.ids``, read at each attempt)."""
    p = processor(FakeRouter(RemoteError("X", "no router")), workers)
    pre = PreprocessedRequest(request_id="r", token_ids=[1, 2],
                              sampling=SamplingParams(max_tokens=2))
    return [t async for x in p._dispatch(pre, lambda: tuple(workers.ids)) for t in x.token_ids]


async def run(p: Processor, tokens: list[int], attempt: Attempt | None = None) -> list[Any]:
    pre = PreprocessedRequest(request_id="r", token_ids=tokens,
                              sampling=SamplingParams(max_tokens=2))
    live = tuple(instance_ids(p.worker.generate))
    at = attempt or Attempt()
    if p.use_router:
        return [x async for x in p._routed(pre, live, at)]
    return [x async for x in p._first_reachable(pre, None, live, at)]


async def test_calls_the_worker_the_router_chose_and_closes_the_route(processor: Make) -> None:
    router, workers = FakeRouter(decision(7)), FakeWorkers([5, 7])
    out = await run(processor(router, workers), [1, 2, 3])
    assert [x.token_ids[0] for x in out] == [7, 7] and workers.calls == [7]
    assert router.asked == [{"token_ids": [1, 2, 3], "track": True, "mode": "kv"}]  # any
    assert router.closed == 1


async def test_the_router_is_told_which_workers_it_may_choose_once_one_has_failed(
        processor: Make) -> None:
    router, workers = FakeRouter(decision(7)), FakeWorkers([5, 7])
    at = Attempt()
    at.failed(5)
    await run(processor(router, workers), [1, 2, 3], at)
    assert router.asked[0]["workers"] == [7] and workers.calls == [7]


@pytest.mark.parametrize("exc", [InstanceUnavailable("refused"), StreamBroken("reset"),
                                 NoInstancesError("gone")])
async def test_a_dead_chosen_worker_falls_back_to_another(exc: Exception, processor: Make) -> None:
    workers = FakeWorkers([5, 7], broken={7: exc})
    out = await run(processor(FakeRouter(decision(7)), workers), [1])
    assert [x.token_ids[0] for x in out] == [5, 5] and workers.calls == [7, 5]


async def test_a_failing_router_means_round_robin(processor: Make) -> None:
    workers = FakeWorkers([5, 7])
    p = processor(FakeRouter(RemoteError("Boom", "router bug")), workers)
    firsts = [(await run(p, [1]))[0].token_ids[0] for _ in range(4)]
    assert sorted(firsts) == [5, 5, 7, 7]


async def test_no_worker_left_raises(processor: Make) -> None:
    workers = FakeWorkers([7], broken={7: InstanceUnavailable("refused")})
    with pytest.raises(InstanceUnavailable):
        await run(processor(FakeRouter(decision(7)), workers), [1])
    with pytest.raises(NoInstancesError):
        await run(processor(FakeRouter(RemoteError("X", "y")), FakeWorkers([])), [1])


async def test_excluded_workers_are_not_asked_even_if_the_router_says_so(processor: Make) -> None:
    workers = FakeWorkers([5, 7])
    attempt = Attempt()
    attempt.failed(7)
    out = await run(processor(FakeRouter(decision(7)), workers), [1], attempt)
    assert [x.token_ids[0] for x in out] == [5, 5] and workers.calls == [5] and attempt.worker == 5


async def test_a_migration_finds_a_worker_that_joined_after_the_request_began(
        processor: Make) -> None:
    class Workers(FakeWorkers):
        async def direct(self, request: Any, instance_id: int) -> AsyncIterator[Any]:
            self.calls.append(instance_id)
            if instance_id == 7:  # the only worker when the request began: dies mid-stream
                yield {"token_ids": [11]}
                self.ids = [9]  # meanwhile 9 joined and 7's lease expired
                raise StreamBroken("sent nothing for 4.0s")
            yield {"token_ids": [12], "finish_reason": "length"}

    workers = Workers([7])
    assert await dispatched(processor, workers) == [11, 12]
    assert workers.calls == [7, 9]



async def test_a_stalled_worker_is_asked_again_once_every_other_has_failed(
        processor: Make) -> None:
    """Seen on a starved host: 5 stalled before its first output, the request went to 7,
    then 7 was killed mid-stream; 5 was back, and the request went on there."""
    class Workers(FakeWorkers):
        stalled = True

        async def direct(self, request: Any, instance_id: int) -> AsyncIterator[Any]:
            self.calls.append(instance_id)
            if instance_id == 5 and self.stalled:
                self.stalled = False
                raise StreamBroken("'generate' sent nothing for 4.0s")
            if instance_id == 7:
                yield {"token_ids": [11]}
                raise StreamBroken("connection lost")
            yield {"token_ids": [12], "finish_reason": "length"}

    workers = Workers([5, 7])
    assert await dispatched(processor, workers) == [11, 12]
    assert workers.calls == [5, 7, 5], workers.calls

# --- SLO-aware admission ---------------------------------------------------------------


class ScriptedRouter(FakeRouter):
    """Answers with one decision after another (the last one repeats)."""

    def __init__(self, answers: list[Any]) -> None:
        super().__init__(answers[0])
        self.answers = answers

    async def generate(self, request: Any, instance_id: int) -> AsyncIterator[Any]:
        answer = self.answers[min(len(self.asked), len(self.answers) - 1)]
        self.asked.append(request)
        try:
            yield answer
        finally:
            self.closed += 1


def pressured(worker_id: int, running: int) -> dict[str, Any]:
    return {**decision(worker_id), "pressure": {"workers": [{"worker_id": worker_id,
                                                             "running": running}]}}


def slo_processor(tiny_tokenizer_dir: Path, router: Any, workers: FakeWorkers,
                  max_delay: float) -> Processor:
    config = ProcessorConfig.model_validate({
        "model": str(tiny_tokenizer_dir), "router-mode": "kv",
        "slo-admission": {"enabled": True, "delay-at-requests": 2, "shed-at-requests": 50,
                          "delay-step": 0.01, "max-delay": max_delay}})
    return Processor(config, router=router.client(), worker=workers.client())


async def run_as(p: Processor, slo_class: str) -> list[Any]:
    from dynagraph.llm.tenants import TenantToken

    pre = PreprocessedRequest(request_id="r", token_ids=[1, 2], tenant=TenantToken(
        tenant="t", slo_class=slo_class), sampling=SamplingParams(max_tokens=2))
    return [x async for x in p._routed(pre, tuple(instance_ids(p.worker.generate)), Attempt(),
                                       admission=True)]


async def test_batch_waits_while_under_pressure_then_goes(tiny_tokenizer_dir: Path) -> None:
    router = ScriptedRouter([pressured(7, 5), pressured(7, 3), pressured(7, 1)])
    workers = FakeWorkers([7])
    out = await run_as(slo_processor(tiny_tokenizer_dir, router, workers, 5.0), "batch")
    assert [x.token_ids[0] for x in out] == [7, 7] and workers.calls == [7]
    # every ask is a tracked route with a gate; the two delayed ones were closed at once
    assert len(router.asked) == 3 and router.closed == 3
    assert all(a["track"] and a["slo_class"] == "batch" for a in router.asked)
    waited = [a["admission"]["waited_s"] for a in router.asked]  # wall clock, 0.01 s steps
    assert waited == sorted(waited) and waited[0] < 0.01 <= waited[1] and waited[2] >= 0.02
    assert router.asked[0]["admission"]["delay_at_requests"] == 2


async def test_deferrable_requests_ask_one_at_a_time_in_arrival_order(
        tiny_tokenizer_dir: Path) -> None:
    router = ScriptedRouter([pressured(7, 5)] * 3 + [pressured(7, 0)])
    workers = FakeWorkers([7])
    p = slo_processor(tiny_tokenizer_dir, router, workers, 5.0)
    first, second = await asyncio.gather(run_as(p, "batch"), run_as(p, "batch"))
    assert [x.token_ids for x in first] == [x.token_ids for x in second] == [[7], [7]]
    # the first asked 4 times (3 delays, then admitted) before the second asked at all
    waited = [a["admission"]["waited_s"] for a in router.asked]
    assert len(waited) == 5 and waited[3] < waited[4] and waited[4] >= 0.03, waited


async def test_the_routers_verdict_wins_over_its_pressure_snapshot(
        tiny_tokenizer_dir: Path) -> None:
    # the Router judged (and counted) where the snapshot alone would say otherwise
    delayed = {**pressured(7, 0), "verdict": {"action": "delay", "reason": "r", "delay_s": 0.01}}
    admitted = {**pressured(7, 9), "verdict": {"action": "admit"}}
    router, workers = ScriptedRouter([delayed, admitted]), FakeWorkers([7])
    out = await run_as(slo_processor(tiny_tokenizer_dir, router, workers, 5.0), "batch")
    assert [x.token_ids[0] for x in out] == [7, 7] and len(router.asked) == 2


async def test_deferrable_work_waits_while_the_router_does_not_answer(
        tiny_tokenizer_dir: Path) -> None:
    from dynagraph.errors import RequestShed

    router, workers = FakeRouter(TimeoutError()), FakeWorkers([7])
    with pytest.raises(RequestShed, match="the Router did not answer"):
        await run_as(slo_processor(tiny_tokenizer_dir, router, workers, 0.03), "batch")
    assert len(router.asked) >= 2 and workers.calls == []  # every 0.01 s for 0.03 s
    # not deferrable: round robin as before
    out = await run_as(slo_processor(tiny_tokenizer_dir, router, workers, 0.03), "interactive")
    assert [x.token_ids[0] for x in out] == [7, 7]


async def test_interactive_goes_at_once_and_batch_is_shed_past_max_delay(
        tiny_tokenizer_dir: Path) -> None:
    from dynagraph.errors import RequestShed

    router, workers = ScriptedRouter([pressured(7, 5)]), FakeWorkers([7])
    p = slo_processor(tiny_tokenizer_dir, router, workers, 0.03)
    assert [x.token_ids[0] for x in await run_as(p, "interactive")] == [7, 7]
    assert len(router.asked) == 1
    with pytest.raises(RequestShed, match="batch work shed after waiting") as info:
        await run_as(p, "batch")
    assert info.value.retry_after == 1 and info.value.code == "slo_shed"
    assert workers.calls == [7]  # only the interactive request reached the worker


async def test_a_request_waits_for_the_restart_of_its_only_worker(processor: Make) -> None:
    """The only worker dies mid-stream and, still registered, cannot be reached; the
    request waits (``migration-wait``) until its restart registers and goes on there."""
    class Workers(FakeWorkers):
        async def direct(self, request: Any, instance_id: int) -> AsyncIterator[Any]:
            self.calls.append(instance_id)
            if instance_id == 7 and len(self.calls) == 1:
                yield {"token_ids": [11]}
                raise StreamBroken("connection lost")
            if instance_id == 7:  # killed: its lease has not expired yet
                asyncio.get_running_loop().call_later(0.3, setattr, self, "ids", [8])
                raise InstanceUnavailable("cannot connect")
            yield {"token_ids": [12], "finish_reason": "length"}

    workers = Workers([7])
    assert await dispatched(processor, workers) == [11, 12]
    assert workers.calls == [7, 7, 8], workers.calls
