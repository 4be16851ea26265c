"""The poll of a step's freshly posted KV reads (``dynagraph.llm.kv.transfer.nixl_settle``)."""

from __future__ import annotations

from typing import Any

from dynagraph.llm.kv.transfer.nixl_settle import DEFAULT_SETTLE_US, ENV, in_flight, settle
from dynagraph.llm.kv.transfer.nixl_side import settle_budget_from_env


class FakeReads:
    """Handles that finish after a number of checks each; a fake clock the pauses advance."""

    def __init__(self, checks_to_done: dict[Any, int], final: str = "DONE") -> None:
        self.left = dict(checks_to_done)
        self.final = final
        self.checks: list[Any] = []
        self.now = 0.0
        self.pauses = 0

    def check(self, handle: Any) -> str:
        self.checks.append(handle)
        self.left[handle] -= 1
        return "PROC" if self.left[handle] > 0 else self.final

    def clock(self) -> float:
        return self.now

    def pause(self, seconds: float) -> None:
        self.pauses += 1
        self.now += seconds


def test_polls_until_every_read_left_progress_pausing_between_rounds() -> None:
    reads = FakeReads({1: 1, 2: 3})
    assert settle(reads.check, [1, 2], 0.002, reads.clock, reads.pause) == 0
    assert reads.checks == [1, 2, 2, 2]  # a finished read is not checked again
    assert reads.pauses == 2  # the CPU is given up between rounds (the progress thread)


def test_gives_up_at_the_budget_and_says_how_many_are_left() -> None:
    reads = FakeReads({7: 10_000})
    assert settle(reads.check, [7], 0.001, reads.clock, reads.pause) == 1
    assert 0.001 <= reads.now < 0.001 + 1e-4


def test_failed_reads_are_left_to_the_engine() -> None:
    reads = FakeReads({3: 2}, final="ERR")
    assert settle(reads.check, [3], 0.002, reads.clock, reads.pause) == 0
    assert reads.checks == [3, 3]


def test_no_budget_or_no_reads_checks_nothing() -> None:
    reads = FakeReads({1: 1})
    assert settle(reads.check, [1], 0.0, reads.clock, reads.pause) == 1
    assert settle(reads.check, [], 0.002, reads.clock, reads.pause) == 0
    assert reads.checks == []


def test_in_flight_takes_every_handle() -> None:
    marker = object()
    assert in_flight({"a": [1, 2], "b": [marker], "c": []}) == {1, 2, marker}


def test_budget_from_env() -> None:
    assert settle_budget_from_env({}) == DEFAULT_SETTLE_US / 1e6
    assert settle_budget_from_env({ENV: "500"}) == 0.0005
    assert settle_budget_from_env({ENV: "-1"}) == 0.0
    assert settle_budget_from_env({ENV: "soon"}) == DEFAULT_SETTLE_US / 1e6


def test_a_check_that_raises_is_left_to_the_engine() -> None:
    def check(handle: Any) -> str:
        if handle == "gone":
            raise RuntimeError("remote disconnected")
        return "DONE"

    assert settle(check, ["gone", "ok"], 0.002) == 0
