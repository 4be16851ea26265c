"""The Planner component's adjustment step: serving counts in, scale calls out."""

from __future__ import annotations

from typing import Any

from components.planner import Planner, PlannerConfig
from dynagraph.llm.engines.base import EngineLoad
from dynagraph.planner.observer import Sample
from dynagraph.sdk._context import RuntimeContext


class FakeConnector:
    def __init__(self, serving: dict[str, int]) -> None:
        self.counts = serving
        self.calls: list[tuple[str, int]] = []

    async def set_replicas(self, component: str, replicas: int) -> None:
        self.calls.append((component, replicas))

    async def serving(self, component: str) -> int:
        return self.counts[component]


class FakeClient:
    component = "MockerWorker"


def planner(conn: FakeConnector, **kw: Any) -> Planner:
    cfg = PlannerConfig.model_validate({"max-prefill-replicas": 0, "cooldown-intervals": 0,
                                        "decode-grace-intervals": 0, **kw})
    p = Planner(cfg, runtime=RuntimeContext.standalone("dynamo", "Planner"),
                decode=FakeClient(), prefill=None)
    p.connector = conn
    return p


def busy(waiting: int) -> Sample:
    return Sample.of([EngineLoad(running=8, waiting=waiting, kv_blocks_used=1,
                                 kv_blocks_total=100)])


async def test_scales_up_then_settles_then_down() -> None:
    conn = FakeConnector({"MockerWorker": 1})
    p = planner(conn)
    p.window.add(busy(4))
    await p._adjust()
    assert conn.calls == [("MockerWorker", 2)]
    assert p.history[-1]["reasons"] == ["min", "up"]
    p.window.add(busy(4))
    await p._adjust()  # the new worker is not serving yet
    assert conn.calls == [("MockerWorker", 2)] and p.history[-1]["reasons"][1] == "settling"
    conn.counts["MockerWorker"] = 2
    p.window.add(Sample.of([]))
    await p._adjust()
    assert conn.calls[-1] == ("MockerWorker", 1)
    assert (p.target.decode if p.target else None) == 1


async def test_no_operation_decides_but_never_scales() -> None:
    conn = FakeConnector({"MockerWorker": 1})
    p = planner(conn, **{"no-operation": True})
    p.window.add(busy(4))
    await p._adjust()
    assert conn.calls == [] and p.history[-1]["target"] == [0, 2]
    assert p.target is not None and p.target.decode == 1
