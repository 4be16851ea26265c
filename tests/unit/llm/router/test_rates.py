"""Learning a worker's speeds from its load samples: exact values."""

from __future__ import annotations

import math

import pytest

from dynagraph.llm.engines.base import EngineLoad
from dynagraph.llm.router.rates import (
    DECODE_HALF_LIFE_STEPS,
    PREFILL_HALF_LIFE_TOKENS,
    RateLearner,
    RatePriors,
    RobustEwma,
    WorkerRates,
    fleet_rates,
)


def test_ewma_holds_the_prior_until_data_then_averages_with_a_light_prior() -> None:
    e = RobustEwma(1.0, half_life=100.0, prior_weight=10.0)
    assert (e.value, e.seen) == (1.0, 0.0)
    e.observe(2.0, weight=10.0)  # alpha = 10 / (10 + 0 + 10): halfway in log space
    assert e.value == pytest.approx(math.sqrt(2.0))
    e.observe(2.0, weight=20.0)  # alpha = 20 / 40
    assert e.value == pytest.approx(2.0 ** 0.75)
    assert e.seen == 30.0


def test_ewma_forgets_with_its_half_life_once_warm() -> None:
    e = RobustEwma(1.0, half_life=100.0, prior_weight=0.001)
    e.observe(1.0, weight=100.0)  # warm now, value still 1
    e.observe(2.0, weight=100.0)  # alpha = 1 - 0.5 = 0.5
    assert e.value == pytest.approx(math.sqrt(2.0))


def test_ewma_an_outlier_moves_it_by_at_most_max_ratio_to_the_alpha() -> None:
    e = RobustEwma(1.0, half_life=100.0, prior_weight=0.001, max_ratio=3.0)
    e.observe(1.0, weight=100.0)
    e.observe(1000.0, weight=100.0)  # clamped to 3x, alpha 0.5
    assert e.value == pytest.approx(math.sqrt(3.0))
    e.observe(1e-6, weight=100.0)  # clamped to 1/3 of the estimate, alpha 0.5
    assert e.value == pytest.approx(1.0)


def test_ewma_ignores_junk_and_takes_a_new_prior_only_before_data() -> None:
    e = RobustEwma(1.0, half_life=10.0)
    for value, weight in ((0.0, 1.0), (-1.0, 1.0), (math.nan, 1.0), (math.inf, 1.0),
                          (1.0, 0.0), (1.0, -1.0)):
        e.observe(value, weight)
    assert (e.value, e.seen) == (1.0, 0.0)
    e.set_prior(4.0)
    assert e.value == 4.0
    e.observe(4.0)
    e.set_prior(9.0)
    assert e.value == pytest.approx(4.0)
    with pytest.raises(ValueError):
        RobustEwma(0.0, half_life=1.0)
    with pytest.raises(ValueError):
        RobustEwma(1.0, half_life=1.0, max_ratio=1.0)


def test_learner_starts_from_priors_then_learns_from_counter_increases() -> None:
    learner = RateLearner(RatePriors(prefill_s_per_token=1e-4, decode_step_s=0.004,
                                     chunk_tokens=512))
    assert learner.rates() == WorkerRates(1e-4, 0.004, 512)
    # 4096 tokens in 0.8 s: 1/5120 s per token (2x the prior: inside the clamp)
    learner.observe(EngineLoad(prefill_tokens_total=4096, prefill_seconds_total=0.8,
                               decode_steps_total=100, decode_seconds_total=0.5,
                               max_num_batched_tokens=2048))
    alpha_p = 4096 / (PREFILL_HALF_LIFE_TOKENS / 10 + 4096)
    alpha_d = 100 / (DECODE_HALF_LIFE_STEPS / 10 + 100)
    r = learner.rates()
    assert r.prefill_s_per_token == pytest.approx(1e-4 * (0.8 / 4096 / 1e-4) ** alpha_p)
    assert r.decode_step_s == pytest.approx(0.004 * (0.005 / 0.004) ** alpha_d)
    assert r.chunk_tokens == 2048
    # no new work: nothing learned
    learner.observe(EngineLoad(prefill_tokens_total=4096, prefill_seconds_total=0.8,
                               decode_steps_total=100, decode_seconds_total=0.5))
    assert learner.rates() == r


def test_learner_takes_nominal_speeds_as_priors_and_survives_a_restart() -> None:
    learner = RateLearner()
    learner.observe(EngineLoad(nominal_prefill_tokens_per_s=20000.0, nominal_decode_step_s=0.003))
    assert learner.rates().prefill_s_per_token == pytest.approx(1 / 20000)
    assert learner.rates().decode_step_s == pytest.approx(0.003)
    learner.observe(EngineLoad(prefill_tokens_total=10000, prefill_seconds_total=0.5))
    before = learner.rates()
    # counters went back (the worker restarted): a new baseline, nothing learned
    learner.observe(EngineLoad(prefill_tokens_total=100, prefill_seconds_total=50.0))
    assert learner.rates() == before
    learner.observe(EngineLoad(prefill_tokens_total=200, prefill_seconds_total=50.005))
    assert learner.prefill.seen == 10100


def _learned(s_per_token: float, step_s: float = 0.004) -> RateLearner:
    x = RateLearner()
    x.prefill = RobustEwma(s_per_token, 10.0)
    x.prefill.observe(s_per_token, 10.0)
    x.decode = RobustEwma(step_s, 10.0)
    x.decode.observe(step_s, 10.0)
    return x


def test_a_worker_without_data_takes_the_fleet_speed() -> None:
    learners = {1: _learned(1e-4), 2: _learned(1.3e-4), 3: _learned(4e-4), 4: RateLearner()}
    r = fleet_rates(learners)
    assert [r[w].prefill_s_per_token for w in (1, 2, 3)] == pytest.approx([1e-4, 1.3e-4, 4e-4])
    assert r[4].prefill_s_per_token == pytest.approx(1.3e-4)  # the median of those with data
    assert r[4].decode_step_s == pytest.approx(0.004)
    # nobody has data: everyone keeps its prior
    assert fleet_rates({1: RateLearner(), 2: RateLearner()})[1] == RateLearner().rates()


def test_workers_with_equal_speeds_share_one_object() -> None:
    learners = {w: RateLearner() for w in range(4)}
    rates = fleet_rates(learners)
    assert len({id(r) for r in rates.values()}) == 1
