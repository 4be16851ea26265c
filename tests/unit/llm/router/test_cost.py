"""The routing cost: Dynamo's block count and the time model, with exact expected choices."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest

from dynagraph.errors import ConfigError, NoInstancesError
from dynagraph.llm.router.cost import (
    DEFAULT_RATES,
    CostModel,
    Decision,
    RouterMode,
    WorkerLoad,
    choose_worker,
    predicted_ttft,
)
from dynagraph.llm.router.rates import WorkerRates
from dynagraph.runtime.round_robin import RoundRobin

A, B, C = 101, 202, 303


def loads(**active: int) -> dict[int, WorkerLoad]:
    ids = {"a": A, "b": B, "c": C}
    return {ids[k]: WorkerLoad(active_blocks=v) for k, v in active.items()}


def blocks(*args: Any, **kw: Any) -> Decision:
    """``choose_worker`` with Dynamo's block-count cost."""
    return choose_worker(*args, cost_model=CostModel.BLOCKS, **kw)


def test_kv_prefers_overlap_when_loads_equal() -> None:
    d = blocks("kv", {A: 2, B: 6}, loads(a=0, b=0, c=0), 8, random.Random(0))
    # costs: prefill + (active + request): A 6+8, B 2+8, C 8+8
    assert d == Decision(B, 6, {A: 14.0, B: 10.0, C: 16.0})
    assert d.cost == 10.0


def test_kv_trades_overlap_against_load() -> None:
    overlaps = {A: 6}
    ld = loads(a=10, b=0)
    # A: 2 + 18 = 20 ; B: 8 + 8 = 16 -> B despite A's cache
    assert blocks("kv", overlaps, ld, 8, random.Random(0)).worker_id == B
    # weight 3: A: 6 + 18 = 24 ; B: 24 + 8 = 32 -> A
    d = blocks("kv", overlaps, ld, 8, random.Random(0), overlap_weight=3.0)
    assert (d.worker_id, d.overlap_blocks, d.costs) == (A, 6, {A: 24.0, B: 32.0})


def test_overlap_is_capped_and_dead_workers_ignored() -> None:
    d = blocks("kv", {A: 50, 999: 50}, loads(a=0), 4, random.Random(0))
    assert d == Decision(A, 4, {A: 4.0})


def test_kv_load_ignores_cache() -> None:
    d = blocks("kv-load", {A: 8}, loads(a=3, b=1), 8, random.Random(0))
    assert d == Decision(B, 0, {A: 11.0, B: 9.0})


def test_ties_are_broken_by_the_rng() -> None:
    ld = loads(a=0, b=0, c=0)
    seen = Counter(blocks("kv", {}, ld, 4, random.Random(s)).worker_id for s in range(300))
    assert set(seen) == {A, B, C}
    # the same rng state gives the same answer
    assert blocks("kv", {}, ld, 4, random.Random(5)) == blocks(
        "kv", {}, ld, 4, random.Random(5)
    )


def test_temperature_samples_in_proportion() -> None:
    ld = loads(a=0, b=0)
    rng = random.Random(1)
    picks = Counter(
        blocks("kv", {A: 4}, ld, 4, rng, temperature=1.0).worker_id for _ in range(4000)
    )
    # normalised costs A 0, B 1 -> P(A) = 1 / (1 + e^-1) = 0.731
    assert 0.70 < picks[A] / 4000 < 0.76
    equal = Counter(
        blocks("kv", {}, ld, 4, rng, temperature=0.5).worker_id for _ in range(1000)
    )
    assert set(equal) == {A, B}


def test_round_robin_cycles_in_id_order() -> None:
    state = RoundRobin()
    ld = loads(c=0, a=0, b=0)
    got = [
        choose_worker("round-robin", {B: 2}, ld, 4, random.Random(0), rr_state=state)
        for _ in range(4)
    ]
    assert [d.worker_id for d in got] == [A, B, C, A]
    assert got[1].overlap_blocks == 2
    assert state.counter == 4


def test_random_uses_the_rng() -> None:
    ld = loads(a=0, b=0, c=0)
    rng1, rng2 = random.Random(9), random.Random(9)
    a = [choose_worker(RouterMode.RANDOM, {}, ld, 1, rng1).worker_id for _ in range(50)]
    b = [choose_worker("random", {}, ld, 1, rng2).worker_id for _ in range(50)]
    assert a == b and set(a) == {A, B, C}


def test_errors() -> None:
    with pytest.raises(NoInstancesError):
        choose_worker("kv", {}, {}, 1, random.Random(0))
    with pytest.raises(ConfigError, match="unknown router mode"):
        choose_worker("fastest", {}, loads(a=0), 1, random.Random(0))
    with pytest.raises(ConfigError, match="cost model"):
        choose_worker("kv", {}, loads(a=0), 1, random.Random(0), cost_model="tokens")
    with pytest.raises(ConfigError, match="rr_state"):
        choose_worker("round-robin", {}, loads(a=0), 1, random.Random(0))
    with pytest.raises(ConfigError, match="temperature"):
        choose_worker("kv", {}, loads(a=0), 1, random.Random(0), temperature=-1)


# --- the time model -------------------------------------------------------------------
# Speeds are powers of two so that every cost below is exact in binary floating point:
# 1/1024 s per prompt token (~1k tokens/s), 1/64 s per decode step, 2048-token steps.

P = 1 / 1024
D = 1 / 64
RATES = WorkerRates(prefill_s_per_token=P, decode_step_s=D, chunk_tokens=2048)
BS = 32
PROMPT = 2900  # 90 full blocks + 20 tokens
FULL = 90


def timed(mode: str, overlaps: dict[int, int], ld: dict[int, WorkerLoad], *,
          rates: dict[int, WorkerRates] | None = None, seed: int = 0, **kw: Any) -> Decision:
    return choose_worker(mode, overlaps, ld, FULL, random.Random(seed), prompt_tokens=PROMPT,
                         block_size=BS, rates={w: RATES for w in ld} if rates is None else rates,
                         **kw)


def test_time_repeat_goes_to_the_idle_holder_at_the_price_of_its_uncached_tokens() -> None:
    d = timed("kv", {A: FULL}, {A: WorkerLoad(), B: WorkerLoad()})
    # A computes the 20 tokens past its cached prefix, B all 2900
    assert d == Decision(A, FULL, {A: 20 * P, B: 2900 * P}, {A: 20 * P, B: 2900 * P})


def test_time_decoding_load_does_not_push_a_repeat_off_its_holder() -> None:
    """The issue's case: the holder is busy decoding three long requests, the other idle.
    Dynamo's block cost (weight 1) sends the repeat away and recomputes 2900 tokens; in
    time the decodes only add one decode step to the holder's prefill."""
    ld = {A: WorkerLoad(active_blocks=270, decoding=3), B: WorkerLoad()}
    assert blocks("kv", {A: FULL}, ld, FULL, random.Random(0)).costs == {A: 360.0, B: 180.0}
    assert blocks("kv", {A: FULL}, ld, FULL, random.Random(0)).worker_id == B
    d = timed("kv", {A: FULL}, ld)
    assert d.worker_id == A
    assert d.costs == {A: 20 * P + D, B: 2900 * P}


def test_time_a_long_queue_on_the_holder_sends_the_repeat_elsewhere() -> None:
    ld = {A: WorkerLoad(queued_tokens=8192), B: WorkerLoad()}
    d = timed("kv", {A: FULL}, ld)
    assert (d.worker_id, d.overlap_blocks) == (B, 0)
    assert d.costs == {A: (8192 + 20) * P, B: 2900 * P}


def test_time_a_full_batch_on_the_holder_sends_the_repeat_to_a_free_place() -> None:
    """A holder running all 8 of its places, none queued: the repeat would wait for one
    of them to end (a request stays 32 s there: one place frees every 4 s), longer than
    computing the whole prompt elsewhere (2.8 s)."""
    rates = WorkerRates(P, D, 2048, request_s=32.0)
    full = WorkerLoad(decoding=8, active=8, slots=8)
    d = timed("kv", {A: FULL}, {A: full, B: WorkerLoad(slots=8)},
              rates={A: rates, B: rates})
    assert d.worker_id == B
    assert d.costs == {A: 20 * P + D + 4, B: 2900 * P}
    # two waiting already: third in line; a free place left: no wait; slots unknown: none
    assert predicted_ttft(WorkerLoad(active=10, slots=8), rates, uncached_tokens=1024) == (
        1 + 12, 1 + 12)
    assert predicted_ttft(WorkerLoad(active=7, slots=8), rates, uncached_tokens=1024)[0] == 1
    assert predicted_ttft(WorkerLoad(active=50), rates, uncached_tokens=1024)[0] == 1


def test_time_prompts_sharing_nothing_join_the_shortest_queue() -> None:
    ld = {A: WorkerLoad(queued_tokens=1000), B: WorkerLoad(queued_tokens=999)}
    assert timed("kv", {}, ld).worker_id == B
    # decoding: every step of the prefill (2 of 2048 tokens) also runs the decodes
    ld = {A: WorkerLoad(decoding=5), B: WorkerLoad()}
    d = timed("kv", {}, ld)
    assert (d.worker_id, d.costs) == (B, {A: 2900 * P + 2 * D, B: 2900 * P})
    # equal: the rng breaks the tie, both ways over seeds
    ld = {A: WorkerLoad(queued_tokens=10), B: WorkerLoad(queued_tokens=10)}
    assert {timed("kv", {}, ld, seed=s).worker_id for s in range(20)} == {A, B}


def test_time_steps_count_the_queue_and_the_request() -> None:
    load = WorkerLoad(queued_tokens=4000, decoding=1)
    # 4000 + 100 tokens = 3 steps of 2048, each with the decode
    assert predicted_ttft(load, RATES, uncached_tokens=100) == (4100 * P + 3 * D,) * 2
    assert predicted_ttft(load, WorkerRates(P, D, 0), uncached_tokens=100)[0] == 4100 * P + D


def test_time_overlap_weight_overrides_the_price_of_the_own_prefill() -> None:
    ld = {A: WorkerLoad(queued_tokens=4096), B: WorkerLoad(queued_tokens=2048)}
    d = timed("kv", {A: FULL}, ld)
    assert d.worker_id == A
    assert d.costs == {A: (4096 + 20) * P, B: (2048 + 2900) * P}
    d = timed("kv", {A: FULL}, ld, overlap_weight=0.0)  # queue only
    assert (d.worker_id, d.costs) == (B, {A: 4096 * P, B: 2048 * P})
    assert d.ttft_s == {A: (4096 + 20) * P, B: (2048 + 2900) * P}  # the forecast is unweighted


def test_time_a_faster_worker_wins_despite_its_queue() -> None:
    fast = WorkerRates(prefill_s_per_token=P / 2, decode_step_s=D, chunk_tokens=2048)
    ld = {A: WorkerLoad(queued_tokens=2048), B: WorkerLoad()}
    d = timed("kv", {}, ld, rates={A: fast, B: RATES})
    assert (d.worker_id, d.costs) == (A, {A: (2048 + 2900) * P / 2, B: 2900 * P})
    # unknown speeds fall back to the defaults
    d = timed("kv", {}, {A: WorkerLoad()}, rates={})
    assert d.costs == {A: 2900 * DEFAULT_RATES.prefill_s_per_token}


def test_time_kv_load_ignores_the_cache() -> None:
    ld = {A: WorkerLoad(queued_tokens=1), B: WorkerLoad()}
    d = timed("kv-load", {A: FULL}, ld, overlap_weight=5.0)
    assert (d.worker_id, d.overlap_blocks) == (B, 0)
    assert d.costs == {A: 2901 * P, B: 2900 * P}


def test_time_prompt_length_defaults_to_full_blocks_and_a_full_hit_computes_one_token() -> None:
    d = choose_worker("kv", {A: 4}, {A: WorkerLoad(), B: WorkerLoad()}, 4, random.Random(0),
                      block_size=BS, rates={A: RATES, B: RATES})
    assert d.costs == {A: 1 * P, B: 128 * P}


def test_time_tiers_price_blocks_held_outside_the_engine() -> None:
    """The extension point: B can load 60 blocks past its 30 on-engine blocks from a host
    pool at 1/256 s per block, cheaper than computing them (32/1024 s per block)."""
    ld = {A: WorkerLoad(), B: WorkerLoad()}
    prices = {"host": 1 / 256, "disk": 1.0}
    d = timed("kv", {A: 40, B: 30}, ld, tiers={B: {"host": 60, "disk": 90}}, tier_prices=prices)
    # A computes 2900 - 40 * 32; B computes the 20-token tail and loads 60 blocks
    assert d.costs == {A: (2900 - 1280) * P, B: 20 * P + 60 / 256}
    assert (d.worker_id, d.overlap_blocks) == (B, 30)
    # a tier without a price is not used; nor are tiers in kv-load mode
    d = timed("kv", {A: 40, B: 30}, ld, tiers={B: {"ssd": 60}}, tier_prices=prices)
    assert d.costs[B] == (2900 - 960) * P
    assert timed("kv-load", {}, ld, tiers={B: {"host": 90}}, tier_prices=prices).costs[B] == 2900 * P
