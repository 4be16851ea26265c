"""The Planner's decision rules, with exact expected targets and reasons."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from dynagraph.planner import (
    Observation,
    PlannerPolicy,
    PlannerState,
    Replicas,
    decide,
    pressures,
    surge,
)


def pol(**kw: Any) -> PlannerPolicy:
    return PlannerPolicy.model_validate({"cooldown-intervals": 0, "decode-grace-intervals": 0,
                                         "prefill-trend-intervals": 0,
                                         **{k.replace("_", "-"): v for k, v in kw.items()}})


BUSY_DECODE = Observation(decode_kv_usage=0.9)
IDLE = Observation()


def test_pressure_is_the_larger_ratio_to_the_up_thresholds() -> None:
    p = pol(decode_kv_scale_up=0.8, decode_waiting_scale_up=4, prefill_queue_scale_up=2)
    assert pressures(p, Observation(0.4, 3.0, prefill_queue=1.0)) == (0.5, 0.75)
    assert pressures(p, Observation(0.8, 1.0, prefill_queue=3.0)) == (1.5, 1.0)
    b = pol(decode_batch_per_replica=8, decode_batch_scale_up=0.5)
    assert pressures(b, Observation(decode_running=6.0)) == (0.0, 1.5)


def test_scales_up_by_one_when_pressure_reaches_one() -> None:
    d = decide(pol(), PlannerState(), Observation(decode_waiting=2.0, prefill_queue=2.0),
               Replicas(1, 1), Replicas(1, 1))
    assert d.target == Replicas(2, 2)
    assert d.reasons == ("up", "up")
    assert d.changed


def test_hysteresis_holds_between_the_thresholds() -> None:
    obs = Observation(decode_kv_usage=0.5, prefill_queue=1.0)
    d = decide(pol(), PlannerState(), obs, Replicas(2, 2), Replicas(2, 2))
    assert (d.target, d.reasons, d.changed) == (Replicas(2, 2), ("hold", "hold"), False)


def test_scales_down_by_one_under_the_down_thresholds() -> None:
    d = decide(pol(), PlannerState(), IDLE, Replicas(3, 3), Replicas(3, 3))
    assert (d.target, d.reasons) == (Replicas(2, 2), ("down", "down"))


def test_waiting_requests_block_a_decode_scale_down() -> None:
    obs = Observation(decode_kv_usage=0.1, decode_waiting=0.5)
    d = decide(pol(), PlannerState(), obs, Replicas(0, 3), Replicas(0, 3))
    assert d.reasons[1] == "hold"


def test_minimum_and_maximum() -> None:
    p = pol(min_decode_replicas=2, max_prefill_replicas=1)
    d = decide(p, PlannerState(), Observation(prefill_queue=5.0), Replicas(1, 2), Replicas(1, 2))
    assert (d.target, d.reasons) == (Replicas(1, 2), ("max", "min"))


def test_a_settling_role_holds() -> None:
    d = decide(pol(), PlannerState(), Observation(decode_waiting=9, prefill_queue=9),
               Replicas(2, 3), Replicas(1, 3))
    assert (d.target, d.reasons) == (Replicas(2, 4), ("settling", "up"))


def test_cooldown_after_a_change() -> None:
    p = pol(cooldown_intervals=2)
    s = PlannerState()
    targets = []
    t = Replicas(0, 1)
    for _ in range(5):
        d = decide(p, s, BUSY_DECODE, t, t)
        s, t = d.state, d.target
        targets.append((t.decode, d.reasons[1]))
    assert targets == [(2, "up"), (2, "cooldown"), (2, "cooldown"), (3, "up"), (3, "cooldown")]


def test_no_decode_scale_down_within_the_grace_after_a_scale_up() -> None:
    p = pol(decode_grace_intervals=2)
    d = decide(p, PlannerState(), BUSY_DECODE, Replicas(0, 1), Replicas(0, 1))
    seen = []
    s, t = d.state, d.target
    for _ in range(4):
        d = decide(p, s, IDLE, t, t)
        s, t = d.state, d.target
        seen.append((t.decode, d.reasons[1]))
    assert seen == [(2, "grace"), (2, "grace"), (1, "down"), (1, "min")]


def test_a_falling_prefill_queue_is_not_scaled_up() -> None:
    p = pol(prefill_trend_intervals=3, prefill_queue_scale_up=2.0)
    s = PlannerState(prev_prefill_queue=4.0)
    # 3.0 now, falling by 1.0 an interval: 0.0 in three intervals, under 2.0
    d = decide(p, s, Observation(prefill_queue=3.0), Replicas(1, 1), Replicas(1, 1))
    assert d.reasons[0] == "trend"
    d = decide(p, PlannerState(prev_prefill_queue=2.5), Observation(prefill_queue=3.0),
               Replicas(1, 1), Replicas(1, 1))
    assert (d.target.prefill, d.reasons[0]) == (2, "up")


def test_budget_goes_to_the_role_under_more_pressure() -> None:
    p = pol(gpu_budget=5, decode_waiting_scale_up=2.0, prefill_queue_scale_up=2.0)
    obs = Observation(decode_waiting=3.0, prefill_queue=5.0)  # decode 1.5, prefill 2.5
    d = decide(p, PlannerState(), obs, Replicas(2, 2), Replicas(2, 2))
    assert (d.target, d.reasons) == (Replicas(3, 2), ("up", "budget"))


def test_gpus_per_replica_count_in_the_budget() -> None:
    p = pol(gpu_budget=6, gpus_per_decode=2, gpus_per_prefill=1, move_below=0.0)
    d = decide(p, PlannerState(), Observation(decode_waiting=5.0, prefill_queue=1.0),
               Replicas(2, 2), Replicas(2, 2))
    assert (d.target, d.reasons) == (Replicas(2, 2), ("hold", "budget"))
    assert d.target.gpus(p) == 6


def test_a_full_budget_moves_a_replica_from_the_idle_role() -> None:
    p = pol(gpu_budget=4)
    obs = Observation(decode_waiting=4.0, prefill_queue=0.5)  # prefill 0.25 < move-below
    d = decide(p, PlannerState(), obs, Replicas(2, 2), Replicas(2, 2))
    assert (d.target, d.reasons) == (Replicas(1, 3), ("moved-out", "moved-in"))


def test_a_busy_role_does_not_give_up_a_replica() -> None:
    p = pol(gpu_budget=4)
    obs = Observation(decode_waiting=4.0, prefill_queue=1.5)  # prefill 0.75 >= move-below
    d = decide(p, PlannerState(), obs, Replicas(2, 2), Replicas(2, 2))
    assert (d.target, d.reasons) == (Replicas(2, 2), ("hold", "budget"))


def test_a_shrinking_role_frees_the_budget_for_the_other() -> None:
    p = pol(gpu_budget=4)
    obs = Observation(decode_waiting=4.0, prefill_queue=0.0)
    d = decide(p, PlannerState(), obs, Replicas(2, 2), Replicas(2, 2))
    assert (d.target, d.reasons) == (Replicas(1, 3), ("down", "up"))


def test_no_move_from_a_role_at_its_minimum() -> None:
    p = pol(gpu_budget=2, min_prefill_replicas=1)
    d = decide(p, PlannerState(), Observation(decode_waiting=4.0), Replicas(1, 1),
               Replicas(1, 1))
    assert (d.target, d.reasons) == (Replicas(1, 1), ("min", "budget"))


def test_an_aggregated_graph_scales_decode_only() -> None:
    p = pol(max_prefill_replicas=0, min_prefill_replicas=0)
    d = decide(p, PlannerState(), Observation(decode_waiting=3.0, prefill_queue=4.0),
               Replicas(0, 1), Replicas(0, 1))
    assert (d.target, d.reasons) == (Replicas(0, 2), ("max", "up"))


def test_state_counts_intervals_and_remembers_the_queue() -> None:
    d = decide(pol(), PlannerState(), Observation(prefill_queue=0.5), Replicas(1, 1),
               Replicas(1, 1))
    assert d.state == PlannerState(interval=1, last_change=(None, None), last_decode_up=None,
                                   prev_prefill_queue=0.5)


@pytest.mark.parametrize("bad", [
    {"decode-kv-scale-down": 0.9, "decode-kv-scale-up": 0.8},
    {"prefill-queue-scale-down": 2.0, "prefill-queue-scale-up": 2.0},
    {"min-decode-replicas": 3, "max-decode-replicas": 2},
    {"min-decode-replicas": 3, "min-prefill-replicas": 2, "gpu-budget": 4},
    {"unknown-key": 1},
])
def test_inconsistent_policies_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        PlannerPolicy.model_validate(bad)


def test_no_scale_down_that_the_same_load_would_undo() -> None:
    p = pol(decode_batch_per_replica=8, decode_batch_scale_up=0.9, decode_kv_scale_down=0.3)
    # 3 running per replica on 2 replicas: 6 on one, 6 / 7.2 < 1: down
    d = decide(p, PlannerState(), Observation(decode_running=3.0), Replicas(0, 2),
               Replicas(0, 2))
    assert (d.target.decode, d.reasons[1]) == (1, "down")
    # 4 per replica: 8 on one, 8 / 7.2 >= 1 would scale right back up: hold
    d = decide(p, PlannerState(), Observation(decode_running=4.0), Replicas(0, 2),
               Replicas(0, 2))
    assert (d.target.decode, d.reasons[1]) == (2, "projected")
    # KV usage 0.25 per engine on 4 replicas is 0.333 on 3: under 0.8, down
    d = decide(p, PlannerState(), Observation(decode_kv_usage=0.25), Replicas(0, 4),
               Replicas(0, 4))
    assert d.reasons[1] == "down"


def test_projection_of_the_prefill_queue() -> None:
    p = pol(prefill_queue_scale_up=1.0, prefill_queue_scale_down=0.6)
    d = decide(p, PlannerState(), Observation(prefill_queue=0.55), Replicas(2, 1),
               Replicas(2, 1))
    assert (d.target.prefill, d.reasons[0]) == (2, "projected")  # 1.1 on one replica
    d = decide(p, PlannerState(), Observation(prefill_queue=0.45), Replicas(2, 1),
               Replicas(2, 1))
    assert (d.target.prefill, d.reasons[0]) == (1, "down")


def test_a_large_step_up_sized_by_the_pressure() -> None:
    p = pol(max_step_up=4, decode_waiting_scale_up=2.0, max_decode_replicas=8)
    # 1 replica, 7 waiting: pressure 3.5 -> ceil(3.5) - 1 = 3 more
    d = decide(p, PlannerState(), Observation(decode_waiting=7.0), Replicas(0, 1),
               Replicas(0, 1))
    assert (d.target.decode, d.reasons[1]) == (4, "up")
    # 2 replicas at pressure 1.2: ceil(2.4) - 2 = 1 more
    d = decide(p, PlannerState(), Observation(decode_waiting=2.4), Replicas(0, 2),
               Replicas(0, 2))
    assert d.target.decode == 3
    # capped by max-step-up, then by max-decode-replicas
    d = decide(p, PlannerState(), Observation(decode_waiting=40.0), Replicas(0, 1),
               Replicas(0, 1))
    assert d.target.decode == 5
    d = decide(p, PlannerState(), Observation(decode_waiting=40.0), Replicas(0, 6),
               Replicas(0, 6))
    assert d.target.decode == 8


def test_a_large_step_up_takes_what_the_budget_leaves() -> None:
    p = pol(max_step_up=4, gpu_budget=5, move_below=0.0)
    d = decide(p, PlannerState(), Observation(decode_waiting=20.0, prefill_queue=1.0),
               Replicas(2, 1), Replicas(2, 1))
    assert (d.target, d.reasons) == (Replicas(2, 3), ("hold", "up"))


def test_while_starting_a_larger_step_catches_up_with_the_load() -> None:
    p = pol(max_step_up=3, decode_waiting_scale_up=2.0)
    # target 2, one serving and 7 waiting on it: 4 needed, 2 more now
    d = decide(p, PlannerState(), Observation(decode_waiting=7.0), Replicas(0, 2),
               Replicas(0, 1))
    assert (d.target.decode, d.reasons[1]) == (4, "up")
    # the target already covers the load: settle
    d = decide(p, PlannerState(), Observation(decode_waiting=3.0), Replicas(0, 2),
               Replicas(0, 1))
    assert (d.target.decode, d.reasons[1]) == (2, "settling")
    # one step at a time (Dynamo's rule) always settles
    d = decide(pol(), PlannerState(), Observation(decode_waiting=7.0), Replicas(0, 2),
               Replicas(0, 1))
    assert (d.target.decode, d.reasons[1]) == (2, "settling")


def test_a_surge_only_adds_replicas_and_ignores_cooldown() -> None:
    p = pol(max_step_up=3, decode_waiting_scale_up=2.0, cooldown_intervals=2)
    state = PlannerState(interval=4, last_change=(None, 3))  # decode changed last interval
    # an adjustment would hold decode in cooldown; a surge does not
    assert decide(p, state, Observation(decode_waiting=6.0), Replicas(0, 1),
                  Replicas(0, 1)).reasons[1] == "cooldown"
    d = surge(p, state, Observation(decode_waiting=6.0), Replicas(0, 1), Replicas(0, 1))
    assert d is not None and (d.target, d.reasons[1]) == (Replicas(0, 3), "up")
    # counted as a change of the adjustment just made; the interval count is kept
    assert d.state.interval == 4 and d.state.last_change == (None, 3)
    assert d.state.last_decode_up == 3
    # no pressure, or a load that only calls for fewer replicas: nothing
    assert surge(p, state, Observation(decode_waiting=1.0), Replicas(0, 2),
                 Replicas(0, 2)) is None
    assert surge(p, state, IDLE, Replicas(2, 3), Replicas(2, 3)) is None


def test_a_surge_keeps_the_prefill_trend_of_the_adjustments() -> None:
    p = pol(max_step_up=2, prefill_queue_scale_up=2.0, prefill_trend_intervals=3)
    state = PlannerState(interval=2, prev_prefill_queue=1.0)
    d = surge(p, state, Observation(prefill_queue=5.0), Replicas(1, 1), Replicas(1, 1))
    assert d is not None and d.target == Replicas(3, 1)
    assert d.state.prev_prefill_queue == 1.0 and d.state.last_change == (1, None)


def test_a_surge_is_off_with_no_window() -> None:
    p = pol(surge_window=0)
    assert surge(p, PlannerState(), Observation(decode_waiting=9.0), Replicas(0, 1),
                 Replicas(0, 1)) is None
