"""Timing profiles: validation, interpolation, extrapolation and step pricing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from dynagraph.errors import ConfigError
from dynagraph.llm.engines.mocker import Profile, StepWork, available_profiles, load_profile

MIXED_TOLERANCE = 0.15
"""How far the mixed-step rule may miss a measured mixed step (shipped cpu-tiny: within 8.3%)."""


def f_prefill(n: float, c: float) -> float:
    """A bilinear function: interpolation and extrapolation must reproduce it exactly."""
    return 0.002 + 1e-5 * n + 2e-6 * c + 1e-9 * n * c


def f_decode(b: float, ctx: float) -> float:
    return 0.003 + 1e-4 * b + 1e-7 * ctx


def profile_dict(**over: Any) -> dict[str, Any]:
    new, cached = [1, 64, 512], [0, 256, 1024]
    batch, ctx = [1, 8, 32], [128, 1024, 8192]
    d: dict[str, Any] = {
        "name": "synthetic", "description": "test", "hardware": "none", "measured_with": "x",
        "model": {"name": "m", "hidden_size": 8, "num_layers": 1, "num_heads": 1,
                  "num_kv_heads": 1, "head_dim": 8, "dtype": "float32"},
        "block_size": 16, "kv_bytes_per_token": 64,
        "prefill": {"new_tokens": new, "cached_tokens": cached,
                    "seconds": [[f_prefill(n, c) for c in cached] for n in new]},
        "decode": {"batch_size": batch, "context_tokens": ctx,
                   "seconds": [[f_decode(b, x) for x in ctx] for b in batch]},
    }
    d.update(over)
    return d


@pytest.fixture
def profile() -> Profile:
    return Profile.model_validate(profile_dict())


@pytest.mark.parametrize(("n", "c"), [
    (1, 0), (64, 256), (300, 700), (33, 1000),      # on the grid and inside it
    (2000, 0), (700, 5000), (4000, 3000),          # beyond the last row / column
])
def test_prefill_reproduces_a_bilinear_function(profile: Profile, n: int, c: int) -> None:
    assert profile.prefill_seconds(n, c) == pytest.approx(f_prefill(n, c), rel=1e-12)


@pytest.mark.parametrize(("b", "ctx"), [(1, 128), (4, 500), (32, 8192), (128, 65536), (2, 64)])
def test_decode_reproduces_a_bilinear_function(profile: Profile, b: int, ctx: int) -> None:
    assert profile.decode_seconds(b, ctx) == pytest.approx(f_decode(b, ctx), rel=1e-12)


def test_interpolation_of_non_linear_data_by_hand() -> None:
    d = profile_dict()
    d["prefill"] = {"new_tokens": [10, 20], "cached_tokens": [0, 100],
                    "seconds": [[1.0, 2.0], [3.0, 8.0]]}
    p = Profile.model_validate(d)
    # halfway on both axes: the mean of the four corners
    assert p.prefill_seconds(15, 50) == pytest.approx(3.5)
    # along the first row (cached 0): linear from 1.0 at 10 to 3.0 at 20, extrapolated
    assert p.prefill_seconds(30, 0) == pytest.approx(5.0)
    # beyond both: the edge cell's plane, 1 + 0.2*dn + 0.01*dc + 0.004*dn*dc from (10, 0)
    assert p.prefill_seconds(30, 200) == pytest.approx(1 + 4 + 2 + 0.004 * 20 * 200)


def test_extrapolation_never_goes_below_zero() -> None:
    d = profile_dict()
    d["decode"] = {"batch_size": [10, 20], "context_tokens": [100],
                   "seconds": [[1.0], [3.0]]}
    p = Profile.model_validate(d)
    assert p.decode_seconds(1, 5000) == 0.0  # a single context column: constant along it
    assert p.decode_seconds(15, 1) == pytest.approx(2.0)


def test_no_work_costs_nothing(profile: Profile) -> None:
    assert profile.prefill_seconds(0, 500) == 0.0
    assert profile.decode_seconds(0, 500) == 0.0
    assert profile.step_seconds(StepWork()) == 0.0
    assert StepWork().empty


def test_step_pricing_prefill_only_decode_only_and_mixed(profile: Profile) -> None:
    prefill = StepWork(prefill_tokens=300, prefill_weighted_cached=300 * 200)
    decode = StepWork(decode_seqs=8, decode_context=4000)
    p, d = f_prefill(300, 200), f_decode(8, 4000)
    assert profile.step_seconds(prefill) == pytest.approx(p)
    assert profile.step_seconds(decode) == pytest.approx(d)
    mixed = StepWork(300, 300 * 200, 8, 4000)
    overhead = f_decode(1, 128)  # default: the cheapest measured decode step
    assert profile.overhead_seconds == overhead
    assert profile.step_seconds(mixed) == pytest.approx(p + d - overhead)


def test_several_prefill_chunks_price_as_one_at_their_token_weighted_cached_mean(
    profile: Profile,
) -> None:
    # chunks (100 new on 0 cached) and (300 new on 400 cached): 400 tokens on 300 cached
    work = StepWork(prefill_tokens=400, prefill_weighted_cached=100 * 0 + 300 * 400)
    assert work.prefill_cached_mean == 300
    assert profile.step_seconds(work) == pytest.approx(f_prefill(400, 300))


def test_chunks_of_several_sequences_each_pay_their_own_row_and_one_pass(
    profile: Profile,
) -> None:
    chunks = ((100, 0), (300, 400))
    work = StepWork(prefill_tokens=400, prefill_weighted_cached=300 * 400,
                    prefill_chunks=chunks)
    each = f_prefill(100, 0), f_prefill(300, 400)
    shared = min(profile.overhead_seconds, *each)  # a pass's fixed cost, at most a chunk's
    p = sum(each) - shared
    assert profile.step_seconds(work) == pytest.approx(p)
    mixed = StepWork(400, 300 * 400, 8, 4000, chunks)
    assert profile.step_seconds(mixed) == pytest.approx(
        p + f_decode(8, 4000) - min(profile.overhead_seconds, p, f_decode(8, 4000)))


def test_chunks_pay_less_than_one_sequence_of_their_length_on_the_shipped_profile() -> None:
    """Attention grows with the square of a sequence's length: four prompts of 512 in one
    step cost less than one prompt of 2048 (the measured rows say how much)."""
    p = load_profile("cpu-tiny-avx512-calibrated")
    one = p.step_seconds(StepWork(prefill_tokens=2048))
    four = p.step_seconds(StepWork(prefill_tokens=2048, prefill_chunks=((512, 0),) * 4))
    assert four == pytest.approx(4 * p.prefill_seconds(512, 0) - 3 * p.overhead_seconds)
    assert four < 0.8 * one


def test_explicit_overhead_is_capped_by_the_cheaper_part() -> None:
    p = Profile.model_validate(profile_dict(step_overhead_seconds=1.0))
    work = StepWork(64, 0, 1, 128)
    # overhead 1 s exceeds both parts: the mixed step costs the dearer of the two
    assert p.step_seconds(work) == pytest.approx(max(f_prefill(64, 0), f_decode(1, 128)))


@pytest.mark.parametrize(("path", "value", "message"), [
    (("prefill", "new_tokens"), [1, 64, 64], "strictly ascending"),
    (("prefill", "new_tokens"), [0, 64, 512], "must be >= 1"),
    (("prefill", "cached_tokens"), [-1, 256, 1024], "must be >= 0"),
    (("decode", "seconds"), [[1.0, 1.0, 1.0]], "3 rows of 3"),
    (("decode", "seconds"), [[1.0, 1.0, 1.0], [1.0, 0.0, 1.0], [1.0, 1.0, 1.0]], "> 0"),
])
def test_bad_tables_are_refused(path: tuple[str, str], value: Any, message: str) -> None:
    d = profile_dict()
    d[path[0]][path[1]] = value
    with pytest.raises(ValueError, match=message):
        Profile.model_validate(d)


def test_unknown_keys_are_refused() -> None:
    with pytest.raises(ValueError, match="extra"):
        Profile.model_validate(profile_dict(speed=2))


def test_load_by_path_and_by_name(tmp_path: Path, profile: Profile) -> None:
    path = tmp_path / "p.json"
    path.write_text(profile.model_dump_json())
    assert load_profile(path) == profile
    assert load_profile(str(path)) == profile
    assert "cpu-tiny" in available_profiles()
    assert load_profile("cpu-tiny").name == "cpu-tiny"


def test_load_errors_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="unknown profile 'nope'.*cpu-tiny"):
        load_profile("nope")
    with pytest.raises(ConfigError, match="cannot read"):
        load_profile(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x"}')
    with pytest.raises(ConfigError, match="bad.json"):
        load_profile(bad)


def test_shipped_cpu_tiny_profile() -> None:
    p = load_profile("cpu-tiny")
    assert p.block_size == 32
    # tiny-llama: 4 layers x 2 KV heads x 64 dims x K and V x 2 bytes (bf16)
    assert p.kv_bytes_per_token == 2 * 4 * 2 * 64 * 2
    assert p.model.name == "tiny-llama"
    # more tokens never cost less along the measured grid's first column and row
    firsts = [row[0] for row in p.prefill.seconds]
    assert firsts[-1] > firsts[0]
    assert p.decode.seconds[-1][-1] > p.decode.seconds[0][0]
    assert p.mixed, "the profile carries measured mixed steps"


def test_mixed_step_rule_against_measured_mixed_steps() -> None:
    """The pricing rule, checked on the mixed steps measured from vLLM with the profile."""
    errors = load_profile("cpu-tiny").mixed_errors()
    assert errors
    assert max(abs(e) for e in errors) < MIXED_TOLERANCE, errors
