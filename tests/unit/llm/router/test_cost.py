from __future__ import annotations

import random
from collections import Counter

import pytest

from dynagraph.errors import ConfigError, NoInstancesError
from dynagraph.llm.router.cost import (
    Decision,
    RouterMode,
    WorkerLoad,
    choose_worker,
)
from dynagraph.runtime.round_robin import RoundRobin

A, B, C = 101, 202, 303


def loads(**active: int) -> dict[int, WorkerLoad]:
    ids = {"a": A, "b": B, "c": C}
    return {ids[k]: WorkerLoad(active_blocks=v) for k, v in active.items()}


def test_kv_prefers_overlap_when_loads_equal() -> None:
    d = choose_worker("kv", {A: 2, B: 6}, loads(a=0, b=0, c=0), 8, random.Random(0))
    # costs: prefill + (active + request): A 6+8, B 2+8, C 8+8
    assert d == Decision(B, 6, {A: 14.0, B: 10.0, C: 16.0})
    assert d.cost == 10.0


def test_kv_trades_overlap_against_load() -> None:
    overlaps = {A: 6}
    ld = loads(a=10, b=0)
    # A: 2 + 18 = 20 ; B: 8 + 8 = 16 -> B despite A's cache
    assert choose_worker("kv", overlaps, ld, 8, random.Random(0)).worker_id == B
    # weight 3: A: 6 + 18 = 24 ; B: 24 + 8 = 32 -> A
    d = choose_worker("kv", overlaps, ld, 8, random.Random(0), overlap_weight=3.0)
    assert (d.worker_id, d.overlap_blocks, d.costs) == (A, 6, {A: 24.0, B: 32.0})


def test_overlap_is_capped_and_dead_workers_ignored() -> None:
    d = choose_worker("kv", {A: 50, 999: 50}, loads(a=0), 4, random.Random(0))
    assert d == Decision(A, 4, {A: 4.0})


def test_kv_load_ignores_cache() -> None:
    d = choose_worker("kv-load", {A: 8}, loads(a=3, b=1), 8, random.Random(0))
    assert d == Decision(B, 0, {A: 11.0, B: 9.0})


def test_ties_are_broken_by_the_rng() -> None:
    ld = loads(a=0, b=0, c=0)
    seen = Counter(choose_worker("kv", {}, ld, 4, random.Random(s)).worker_id for s in range(300))
    assert set(seen) == {A, B, C}
    # the same rng state gives the same answer
    assert choose_worker("kv", {}, ld, 4, random.Random(5)) == choose_worker(
        "kv", {}, ld, 4, random.Random(5)
    )


def test_temperature_samples_in_proportion() -> None:
    ld = loads(a=0, b=0)
    rng = random.Random(1)
    picks = Counter(
        choose_worker("kv", {A: 4}, ld, 4, rng, temperature=1.0).worker_id for _ in range(4000)
    )
    # normalised costs A 0, B 1 -> P(A) = 1 / (1 + e^-1) = 0.731
    assert 0.70 < picks[A] / 4000 < 0.76
    equal = Counter(
        choose_worker("kv", {}, ld, 4, rng, temperature=0.5).worker_id for _ in range(1000)
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
    with pytest.raises(ConfigError, match="rr_state"):
        choose_worker("round-robin", {}, loads(a=0), 1, random.Random(0))
    with pytest.raises(ConfigError, match="temperature"):
        choose_worker("kv", {}, loads(a=0), 1, random.Random(0), temperature=-1)
