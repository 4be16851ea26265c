"""benchmarks.profiling.calibrate_profile's pure correction step."""

from __future__ import annotations

import pytest

from benchmarks.profiling.calibrate_profile import corrected, relative_errors


def _tables(prefill: list[list[float]], decode: list[list[float]], mixed: list[float]
            ) -> dict:
    return {"prefill": {"new_tokens": [1, 32], "cached_tokens": [0], "seconds": prefill},
            "decode": {"batch_size": [1], "context_tokens": [512, 1024], "seconds": decode},
            "mixed": [{"prefill_new_tokens": 64, "prefill_cached_tokens": 0,
                       "decode_batch_size": 4, "decode_context_tokens": 512, "seconds": s}
                      for s in mixed]}


def test_each_point_moves_by_its_error() -> None:
    target = _tables([[0.010], [0.020]], [[0.004, 0.005]], [0.030])
    measured = _tables([[0.013], [0.021]], [[0.005, 0.005]], [0.036])
    out = corrected(target, target, measured, floor=0.1)
    assert out["prefill"]["seconds"] == [[0.007], [0.019]]
    assert out["decode"]["seconds"] == [[0.003, 0.005]]
    assert out["mixed"][0]["seconds"] == pytest.approx(0.024)
    assert out["prefill"]["new_tokens"] == [1, 32]  # the axes are the target's


def test_a_second_pass_corrects_the_corrected_profile() -> None:
    target = _tables([[0.010], [0.020]], [[0.004, 0.005]], [0.030])
    current = _tables([[0.007], [0.019]], [[0.003, 0.005]], [0.024])
    measured = _tables([[0.011], [0.020]], [[0.0035, 0.005]], [0.031])
    out = corrected(target, current, measured, floor=0.1)
    assert out["prefill"]["seconds"] == [[0.006], [0.019]]  # still slow: lowered again
    assert out["decode"]["seconds"] == [[0.0035, 0.005]]  # now too fast: raised


def test_no_point_drops_below_the_floor() -> None:
    target = _tables([[0.010], [0.020]], [[0.004, 0.005]], [0.030])
    measured = _tables([[0.050], [0.020]], [[0.004, 0.005]], [0.030])  # graph time > engine
    out = corrected(target, target, measured, floor=0.25)
    assert out["prefill"]["seconds"][0] == [0.0025]


def test_relative_errors_are_means_per_table() -> None:
    target = _tables([[0.010], [0.020]], [[0.004, 0.005]], [0.030])
    measured = _tables([[0.012], [0.020]], [[0.005, 0.005]], [0.027])
    errors = relative_errors(target, measured)
    assert errors == {"prefill": 0.1, "decode": 0.125, "mixed": 0.1}


def test_a_table_within_the_noise_is_left_alone() -> None:
    target = _tables([[0.010], [0.020]], [[0.004, 0.005]], [0.030])
    measured = _tables([[0.013], [0.025]], [[0.0041, 0.0049]], [0.036])  # decode: 2% off
    out = corrected(target, target, measured, floor=0.1, min_error=0.05)
    assert out["decode"]["seconds"] == [[0.004, 0.005]]  # kept as measured
    assert out["prefill"]["seconds"] == [[0.007], [0.015]]  # corrected
    assert out["mixed"][0]["seconds"] == pytest.approx(0.024)
