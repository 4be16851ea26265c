"""AdmissionTurns: deferrable requests ask one at a time, wait, and are shed past their limit."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import pytest

from dynagraph.errors import RequestShed
from dynagraph.llm.tenants.slo import default_slo_classes
from dynagraph.llm.tenants.slo_admission import (
    Action,
    Pressure,
    SloAdmissionConfig,
    Verdict,
    WorkerPressure,
)
from dynagraph.llm.tenants.turns import AdmissionTurns


@dataclass
class Counters:
    delayed: list[tuple[str, float]] = field(default_factory=list)
    shed: list[str] = field(default_factory=list)

    def slo_delayed(self, slo_class: str, seconds: float) -> None:
        self.delayed.append((slo_class, seconds))

    def slo_shed(self, slo_class: str) -> None:
        self.shed.append(slo_class)


@dataclass
class Answer:
    verdict: Verdict | None = None
    pressure: Pressure | None = None


def turns(max_delay: float = 1.0) -> tuple[AdmissionTurns, Counters]:
    counters = Counters()
    cfg = SloAdmissionConfig(enabled=True, delay_at_requests=2, shed_at_requests=9,
                             delay_step=0.01, max_delay=max_delay, delay_at_prefills=None)
    return AdmissionTurns(cfg, default_slo_classes(), counters), counters


def busy(running: int) -> Answer:
    return Answer(pressure=Pressure(workers=[WorkerPressure(worker_id=1, running=running)]))


def test_only_deferrable_classes_are_gated() -> None:
    t, _ = turns()
    assert t.deferrable("batch") and not t.deferrable("interactive")


def test_the_routers_verdict_wins_and_admission_after_a_wait_is_counted() -> None:
    t, counters = turns()
    assert t.wait_s("r", "batch", busy(5), 0.0) == 0.01  # judged from the snapshot: delay
    assert t.wait_s("r", "batch", Answer(verdict=Verdict(action=Action.ADMIT)), 0.5) == 0.0
    assert counters.delayed == [("batch", 0.5)]
    assert t.wait_s("r", "batch", None, 0.0) > 0  # no answer counts as pressure
    with pytest.raises(RequestShed) as info:
        t.wait_s("r", "batch", busy(20), 0.0)
    assert info.value.code == "slo_shed" and counters.shed == ["batch"]


async def test_turns_are_taken_in_arrival_order_and_a_long_wait_is_shed() -> None:
    t, counters = turns(max_delay=0.05)
    order: list[str] = []

    async def ask(name: str, hold: float) -> None:
        await t.take(name, "batch", time.monotonic())
        order.append(name)
        await asyncio.sleep(hold)
        t.release()

    await asyncio.gather(ask("a", 0.01), ask("b", 0.01), ask("c", 0.0))
    assert order == ["a", "b", "c"]
    await t.take("holder", "batch", time.monotonic())  # never released: the next one is shed
    with pytest.raises(RequestShed, match="in line for admission"):
        await t.take("late", "batch", time.monotonic())
    assert counters.shed == ["batch"]
