"""Processor with a Router: asks it, calls the chosen worker, falls back on failures."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from components.processor import Processor, ProcessorConfig
from dynagraph.errors import InstanceUnavailable, NoInstancesError, RemoteError, StreamBroken


class FakeRouter:
    def __init__(self, answer: Any) -> None:
        self.answer = answer
        self.asked: list[Any] = []
        self.closed = 0

    async def generate(self, request: Any) -> AsyncIterator[Any]:
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

    def instance_ids(self) -> list[int]:
        return list(self.ids)

    async def direct(self, request: Any, instance_id: int) -> AsyncIterator[Any]:
        self.calls.append(instance_id)
        if instance_id in self.broken:
            raise self.broken[instance_id]
        yield {"from": instance_id}
        yield {"from": instance_id, "done": True}


@pytest.fixture
def processor(tiny_tokenizer_dir: Path) -> Callable[[Any, FakeWorkers], Processor]:
    def make(router: Any, workers: FakeWorkers) -> Processor:
        config = ProcessorConfig(model=str(tiny_tokenizer_dir), router_mode="kv")
        return Processor(config, router=router, worker=workers)

    return make


Make = Callable[[Any, FakeWorkers], Processor]


def decision(worker_id: int) -> dict[str, Any]:
    return {"worker_id": worker_id, "overlap_blocks": 1, "request_blocks": 1, "mode": "kv"}


async def run(p: Processor, tokens: list[int]) -> list[Any]:
    return [x async for x in p._routed({"token_ids": tokens}, tokens)]


async def test_calls_the_worker_the_router_chose_and_closes_the_route(processor: Make) -> None:
    router, workers = FakeRouter(decision(7)), FakeWorkers([5, 7])
    out = await run(processor(router, workers), [1, 2, 3])
    assert [x["from"] for x in out] == [7, 7] and workers.calls == [7]
    assert router.asked == [{"token_ids": [1, 2, 3], "track": True, "mode": "kv"}]
    assert router.closed == 1


@pytest.mark.parametrize("exc", [InstanceUnavailable("refused"), StreamBroken("reset"),
                                 NoInstancesError("gone")])
async def test_a_dead_chosen_worker_falls_back_to_another(exc: Exception, processor: Make) -> None:
    workers = FakeWorkers([5, 7], broken={7: exc})
    out = await run(processor(FakeRouter(decision(7)), workers), [1])
    assert [x["from"] for x in out] == [5, 5] and workers.calls == [7, 5]


async def test_a_failing_router_means_round_robin(processor: Make) -> None:
    workers = FakeWorkers([5, 7])
    p = processor(FakeRouter(RemoteError("Boom", "router bug")), workers)
    firsts = [(await run(p, [1]))[0]["from"] for _ in range(4)]
    assert sorted(firsts) == [5, 5, 7, 7]


async def test_no_worker_left_raises(processor: Make) -> None:
    workers = FakeWorkers([7], broken={7: InstanceUnavailable("refused")})
    with pytest.raises(InstanceUnavailable):
        await run(processor(FakeRouter(decision(7)), workers), [1])
    with pytest.raises(NoInstancesError):
        await run(processor(FakeRouter(RemoteError("X", "y")), FakeWorkers([])), [1])
