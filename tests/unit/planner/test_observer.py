"""Averaging load samples into an interval's Observation."""

from __future__ import annotations

from dynagraph.llm.engines.base import EngineLoad
from dynagraph.planner import Observation
from dynagraph.planner.observer import LoadWindow, Sample


def load(running: int, waiting: int, used: int, total: int = 100) -> EngineLoad:
    return EngineLoad(running=running, waiting=waiting, kv_blocks_used=used,
                      kv_blocks_total=total)


def test_sample_sums_requests_and_keeps_each_engines_kv_usage() -> None:
    s = Sample.of([load(2, 1, 50), load(4, 3, 10)], prefill_queue=5)
    assert s == Sample(kv_usage=(0.5, 0.1), waiting=4, running=6, prefill_queue=5)


def test_window_averages_per_sample_and_per_replica_then_empties() -> None:
    w = LoadWindow()
    w.add(Sample.of([load(2, 1, 50), load(4, 3, 10)], prefill_queue=6))  # kv mean 0.3
    w.add(Sample.of([load(0, 0, 10)], prefill_queue=2))                  # kv mean 0.1
    w.add(Sample.of([], prefill_queue=0))                                 # no engine: no kv
    obs = w.observe(decode_replicas=2, prefill_replicas=2)
    assert obs.decode_kv_usage == (0.3 + 0.1) / 2
    assert obs.decode_waiting == 4 / 3 / 2
    assert obs.decode_running == 6 / 3 / 2
    assert obs.prefill_queue == 8 / 3 / 2
    assert w.observe(2, 2) == Observation()


def test_no_replicas_count_as_one() -> None:
    w = LoadWindow()
    w.add(Sample.of([], prefill_queue=3))
    assert w.observe(decode_replicas=0, prefill_replicas=0).prefill_queue == 3.0


def test_recent_averages_the_last_samples_and_keeps_the_window() -> None:
    w = LoadWindow()
    for waiting in (0, 0, 4, 8):
        w.add(Sample.of([load(8, waiting, 50)]))
    assert w.recent(2, decode_replicas=2, prefill_replicas=0).decode_waiting == 6 / 2
    assert w.recent(0, 2, 0) == Observation()
    assert w.observe(1, 0).decode_waiting == 3.0  # all four samples were kept
