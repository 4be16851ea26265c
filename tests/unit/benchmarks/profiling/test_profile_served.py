"""The arithmetic of ``benchmarks.profiling.profile_served``'s decode probe (pure, no engine)."""

from __future__ import annotations

import pytest

from benchmarks.profiling.profile_served import steady_seconds_per_token


def test_only_the_window_in_which_every_request_runs_counts() -> None:
    # a starts at 0 and runs alone at 1 ms/token, b joins at 10 ms; together both run at
    # 2 ms/token until a ends at 30 ms; b then runs alone again
    a = [(0.000, 1), (0.005, 6), (0.010, 11), (0.020, 16), (0.030, 21)]
    b = [(0.010, 1), (0.020, 6), (0.030, 11), (0.031, 12), (0.032, 13)]
    assert steady_seconds_per_token([a, b]) == pytest.approx([0.002, 0.002])


def test_tokens_are_counted_not_outputs() -> None:
    # one output carried three tokens (the reader was behind)
    a = [(0.0, 1), (0.001, 2), (0.004, 5), (0.005, 6)]
    assert steady_seconds_per_token([a]) == pytest.approx([0.001])


def test_a_request_with_no_two_outputs_in_the_window_uses_its_whole_run() -> None:
    a = [(0.0, 1), (0.010, 11)]
    b = [(0.009, 1), (0.012, 2), (0.015, 3)]
    # window [0.009, 0.010]: a has one output in it, b one -> both fall back
    assert steady_seconds_per_token([a, b]) == pytest.approx([0.001, 0.003])


def test_a_request_that_never_progressed_gives_no_sample() -> None:
    assert steady_seconds_per_token([[(0.0, 1)]]) == []
