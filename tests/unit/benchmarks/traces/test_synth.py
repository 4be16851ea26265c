"""Synthetic traces: determinism, prefix sharing by construction, arrivals, options."""

from __future__ import annotations

import argparse
import random
import statistics
from collections import defaultdict

import pytest
from pydantic import ValidationError

from benchmarks.traces.synth import (
    SynthConfig,
    SynthRequest,
    add_synth_args,
    arrivals,
    generate,
    generate_trace,
    synth_config_from_args,
)
from benchmarks.traces.trace import dump_lines, parse_line

B = 512


@pytest.fixture(scope="module")
def reqs() -> list[SynthRequest]:
    return generate(SynthConfig(seed=7, duration_s=120))


def test_deterministic() -> None:
    cfg = SynthConfig(seed=3, duration_s=30)
    assert generate_trace(cfg) == generate_trace(cfg)
    assert dump_lines(generate_trace(cfg)) == dump_lines(generate_trace(SynthConfig(
        seed=3, duration_s=30)))
    assert generate_trace(cfg) != generate_trace(SynthConfig(seed=4, duration_s=30))


def test_records_are_valid_and_ordered(reqs: list[SynthRequest]) -> None:
    cfg = SynthConfig(seed=7, duration_s=120)
    assert len(reqs) > 100
    ts = [r.record.timestamp for r in reqs]
    assert ts == sorted(ts) and ts[-1] < 120_000 and all(t.is_integer() for t in ts)
    for line_no, line in enumerate(dump_lines(r.record for r in reqs).splitlines(), 1):
        parse_line(line, line=line_no)  # hash id count matches input_length
    for r in reqs:
        assert r.record.input_length + r.record.output_length <= cfg.max_context_tokens
        assert cfg.output_tokens_min <= r.record.output_length <= cfg.output_tokens_max


def test_hash_ids_number_in_order_of_first_appearance(reqs: list[SynthRequest]) -> None:
    seen = -1
    for r in reqs:
        for h in r.record.hash_ids:
            assert h <= seen + 1
            seen = max(seen, h)


def test_equal_id_means_equal_prefix(reqs: list[SynthRequest]) -> None:
    prefix_of: dict[int, tuple[int, ...]] = {}
    for r in reqs:
        ids = r.record.hash_ids
        for i, h in enumerate(ids):
            assert prefix_of.setdefault(h, ids[: i + 1]) == ids[: i + 1]


def test_later_turns_extend_earlier_ones(reqs: list[SynthRequest]) -> None:
    by_conv: dict[int, list[SynthRequest]] = defaultdict(list)
    for r in reqs:
        by_conv[r.conversation].append(r)
    multi = [turns for turns in by_conv.values() if len(turns) > 1]
    assert len(multi) > 10
    for turns in multi:
        turns.sort(key=lambda r: r.turn)
        assert [r.turn for r in turns] == list(range(len(turns)))
        for prev, cur in zip(turns, turns[1:], strict=False):
            a, b = prev.record, cur.record
            assert b.timestamp >= a.timestamp
            assert b.input_length > a.input_length + a.output_length
            full = a.input_length // B
            assert b.hash_ids[:full] == a.hash_ids[:full]
            if a.input_length % B:  # a partly filled block is never reused as a full one
                assert b.hash_ids[full] != a.hash_ids[full]


def test_system_prompts_are_shared(reqs: list[SynthRequest]) -> None:
    first_turns = [r for r in reqs if r.turn == 0]
    by_sp: dict[int, set[int]] = defaultdict(set)
    for r in first_turns:
        by_sp[r.system_prompt].add(r.record.hash_ids[0])
    # min system prompt 512 tokens: the first block is all system prompt, one id per prompt
    assert all(len(ids) == 1 for ids in by_sp.values())
    firsts = [next(iter(ids)) for ids in by_sp.values()]
    assert len(set(firsts)) == len(firsts)
    counts = sorted((sum(r.system_prompt == sp for r in first_turns) for sp in by_sp),
                    reverse=True)
    assert counts[0] > counts[-1]  # Zipf popularity


def test_unique_user_content_is_not_shared(reqs: list[SynthRequest]) -> None:
    # The last block of a first turn holds its own user message: never seen before.
    seen: set[int] = set()
    for r in reqs:
        if r.turn == 0 and r.record.input_length > 1536:  # past the longest system prompt
            assert r.record.hash_ids[-1] not in seen
        seen.update(r.record.hash_ids)


def _cv(xs: list[float]) -> float:
    gaps = [b - a for a, b in zip(xs, xs[1:], strict=False)]
    return statistics.pstdev(gaps) / statistics.fmean(gaps)


@pytest.mark.parametrize(("arrival", "lo", "hi"), [
    ("poisson", 0.85, 1.15), ("gamma", 2.0, 4.0), ("onoff", 1.3, 5.0)])
def test_arrival_burstiness(arrival: str, lo: float, hi: float) -> None:
    cfg = SynthConfig(seed=1, duration_s=3000, arrival=arrival, rate=1.0, gamma_cv=3.0,  # type: ignore[arg-type]
                      burst_rate=8.0, burst_on_s=5.0, burst_off_s=20.0)
    ts = list(arrivals(cfg, random.Random(1)))
    assert ts == sorted(ts) and 0 < ts[0] and ts[-1] < 3000
    assert lo <= _cv(ts) <= hi


def test_onoff_mean_rate() -> None:
    cfg = SynthConfig(seed=2, duration_s=5000, arrival="onoff", rate=1.0, burst_rate=9.0,
                      burst_on_s=5.0, burst_off_s=15.0)
    n = len(list(arrivals(cfg, random.Random(2))))
    expected = (9.0 * 5 + 1.0 * 15) / 20 * 5000  # time-weighted mean rate
    assert abs(n - expected) / expected < 0.15


def test_max_requests_and_duration() -> None:
    recs = generate_trace(SynthConfig(seed=0, duration_s=30, max_requests=25))
    assert len(recs) == 25


def test_config_validation() -> None:
    with pytest.raises(ValidationError):
        SynthConfig.model_validate({"no-such-key": 1})
    with pytest.raises(ValidationError, match="max-context-tokens"):
        SynthConfig(system_prompt_tokens_max=4000, max_context_tokens=4004)
    assert SynthConfig.model_validate({"burst-rate": 2}).burst_rate == 2.0


def test_cli_options_roundtrip() -> None:
    p = argparse.ArgumentParser()
    add_synth_args(p, prefix="synth-", exclude=frozenset({"block_tokens"}))
    args = p.parse_args(["--synth-seed", "5", "--synth-arrival", "gamma",
                         "--synth-max-requests", "9", "--synth-duration-s", "12.5"])
    cfg = synth_config_from_args(args, block_tokens=64)
    assert (cfg.seed, cfg.arrival, cfg.max_requests, cfg.duration_s, cfg.block_tokens) == (
        5, "gamma", 9, 12.5, 64)
    with pytest.raises(SystemExit):
        p.parse_args(["--synth-block-tokens", "64"])
    with pytest.raises(SystemExit):
        p.parse_args(["--synth-arrival", "uniform"])
