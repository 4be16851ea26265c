"""SLO-aware admission policy: exact verdicts from pressure snapshots."""

from __future__ import annotations

import msgspec
import pytest
from pydantic import ValidationError

from dynagraph.errors import ConfigError
from dynagraph.llm.tenants.slo import default_slo_classes
from dynagraph.llm.tenants.slo_admission import (
    Action,
    Pressure,
    SloAdmission,
    SloAdmissionConfig,
    Verdict,
    WorkerPressure,
)


def policy(**kw: object) -> SloAdmission:
    base: dict[str, object] = {"enabled": True, "delay-at-requests": 4,
                               "shed-at-requests": 10, "delay-step": 0.5, "max-delay": 2.0}
    return SloAdmission(SloAdmissionConfig.model_validate({**base, **kw}),
                        default_slo_classes())


def snap(*workers: WorkerPressure) -> Pressure:
    return Pressure(workers=list(workers))


def test_interactive_is_admitted_however_high_the_pressure() -> None:
    p = snap(WorkerPressure(worker_id=1, running=50, waiting=50, kv_usage=1.0))
    assert policy().decide(p, "interactive") == Verdict(Action.ADMIT, "not deferrable")
    assert policy().decide(p, "default").action is Action.ADMIT


def test_disabled_admits_batch() -> None:
    p = snap(WorkerPressure(worker_id=1, running=50))
    assert policy(enabled=False).decide(p, "batch").action is Action.ADMIT


def test_batch_below_thresholds_is_admitted() -> None:
    p = snap(WorkerPressure(worker_id=1, running=2, waiting=1, kv_usage=0.5))
    assert policy().decide(p, "batch") == Verdict(Action.ADMIT, "below the delay thresholds")
    assert policy().decide(None, "batch") == Verdict(Action.ADMIT, "no load known")
    assert policy().decide(snap(), "batch").action is Action.ADMIT


def test_batch_is_delayed_at_the_request_threshold() -> None:
    p = snap(WorkerPressure(worker_id=1, running=3, waiting=1))
    assert policy().decide(p, "batch") == Verdict(
        Action.DELAY, "batch work delayed: 4 requests on the least loaded worker "
                      "(delay at 4)", delay_s=0.5)


def test_the_routers_inflight_count_wins_over_a_lagging_report() -> None:
    p = snap(WorkerPressure(worker_id=1, running=0, inflight=5))
    assert policy().decide(p, "batch").action is Action.DELAY


def test_the_least_loaded_worker_decides() -> None:
    busy = WorkerPressure(worker_id=1, running=20)
    idle = WorkerPressure(worker_id=2, running=1)
    assert policy().decide(snap(busy, idle), "batch").action is Action.ADMIT
    half = WorkerPressure(worker_id=2, running=5)
    assert policy().decide(snap(busy, half), "batch").action is Action.DELAY


def test_batch_is_shed_far_over_with_retry_after() -> None:
    p = snap(WorkerPressure(worker_id=1, running=8, waiting=2))
    assert policy().decide(p, "batch") == Verdict(
        Action.SHED, "batch work shed under pressure: 10 requests on the least loaded worker "
                     "(shed at 10)", retry_after=1)
    assert policy(**{"max-delay": 20.0}).decide(p, "batch").retry_after == 5


def test_a_delayed_request_is_shed_once_it_has_waited_max_delay() -> None:
    p = snap(WorkerPressure(worker_id=1, running=4))
    assert policy().decide(p, "batch", waited_s=1.5).action is Action.DELAY
    v = policy().decide(p, "batch", waited_s=2.0)
    assert v.action is Action.SHED and v.retry_after == 1
    assert v.reason.startswith("batch work shed after waiting 2.0s under pressure: 4 requests")


def test_kv_usage_levels() -> None:
    assert policy().decide(snap(WorkerPressure(worker_id=1, kv_usage=0.9)), "batch") == \
        Verdict(Action.DELAY, "batch work delayed: KV cache 90% full (delay at 85%)",
                delay_s=0.5)
    assert policy().decide(snap(WorkerPressure(worker_id=1, kv_usage=0.99)),
                           "batch").action is Action.SHED


def test_predicted_ttft_against_the_tightest_protected_target() -> None:
    pol = policy()
    assert pol.target_s == 1.0  # interactive's 1000 ms; batch is deferrable, default has none
    ok = snap(WorkerPressure(worker_id=1, predicted_ttft_s=0.4))
    assert pol.decide(ok, "batch").action is Action.ADMIT
    slow = snap(WorkerPressure(worker_id=1, predicted_ttft_s=0.6))
    assert pol.decide(slow, "batch") == Verdict(
        Action.DELAY, "batch work delayed: predicted TTFT 0.60s against the protected "
                      "target 1s", delay_s=0.5)
    late = snap(WorkerPressure(worker_id=1, predicted_ttft_s=1.2))
    assert pol.decide(late, "batch").action is Action.SHED


def test_deferrable_work_waits_while_a_prefill_runs() -> None:
    busy = snap(WorkerPressure(worker_id=1, running=1, prefilling=1))
    assert policy().decide(busy, "batch") == Verdict(
        Action.DELAY, "batch work delayed: 1 requests in prefill on the least loaded worker "
                      "(delay at 1)", delay_s=0.5)
    assert policy().decide(busy, "interactive").action is Action.ADMIT
    assert policy(**{"delay-at-prefills": 2}).decide(busy, "batch").action is Action.ADMIT
    assert policy(**{"delay-at-prefills": None}).decide(busy, "batch").action is Action.ADMIT
    # decoding work is no reason to wait, and a free worker beside a busy one admits
    decoding = WorkerPressure(worker_id=2, running=3, prefilling=0)
    assert policy().decide(snap(busy.workers[0], decoding), "batch").action is Action.ADMIT
    assert policy().gate("batch").place(snap(busy.workers[0], decoding), chosen=1)[0] == 2


def test_the_strongest_signal_counts() -> None:
    p = snap(WorkerPressure(worker_id=1, running=4, kv_usage=0.99))
    assert policy().decide(p, "batch").reason == (
        "batch work shed under pressure: KV cache 99% full (shed at 98%)")


def test_config_is_validated() -> None:
    with pytest.raises(ValidationError, match="delay-at-requests"):
        SloAdmissionConfig.model_validate({"delay-at-requests": 10, "shed-at-requests": 5})
    with pytest.raises(ValidationError):
        SloAdmissionConfig.model_validate({"delay-stepp": 1})  # unknown keys are refused
    with pytest.raises(ConfigError, match="unknown SLO classes"):
        SloAdmission(SloAdmissionConfig(defer_classes=["bulk"]), default_slo_classes())


def test_pressure_round_trips_and_omits_defaults() -> None:
    p = snap(WorkerPressure(worker_id=7, running=1, predicted_ttft_s=0.25))
    raw = msgspec.to_builtins(p)
    assert raw == {"workers": [{"worker_id": 7, "running": 1, "predicted_ttft_s": 0.25}]}
    assert msgspec.convert(raw, Pressure) == p


def test_the_gate_travels_with_the_route_request_and_judges_as_the_policy() -> None:
    from dynagraph.llm.router import RouteDecision, RouteRequest, RouterMode

    pol = policy()
    gate = pol.gate("batch", waited_s=1.6)
    ask = msgspec.convert(msgspec.to_builtins(RouteRequest([1, 2], admission=gate)),
                          RouteRequest)
    assert ask.admission == gate and gate.target_s == 1.0  # interactive's 1000 ms
    for p in (snap(WorkerPressure(worker_id=1, running=3, waiting=1)),
              snap(WorkerPressure(worker_id=1, running=12)), snap(), None):
        assert gate.decide(p) == pol.decide(p, "batch", waited_s=1.6)
    verdict = gate.decide(snap(WorkerPressure(worker_id=1, running=4)))
    assert verdict.action is Action.SHED  # 1.6 s waited + a 0.5 s step passes max-delay 2
    back = msgspec.convert(msgspec.to_builtins(RouteDecision(
        worker_id=1, overlap_blocks=0, request_blocks=1, mode=RouterMode("kv"), verdict=verdict)),
        RouteDecision)
    assert back.verdict == verdict


def test_a_gated_request_is_placed_where_there_is_room() -> None:
    gate = policy().gate("batch")  # delay at 4, shed at 10
    busy, free = (WorkerPressure(worker_id=1, running=5), WorkerPressure(worker_id=2, running=1))
    assert gate.place(snap(busy, free), chosen=2) == (2, Verdict(
        Action.ADMIT, "below the delay thresholds"))
    # the cost chose the busy worker: the request goes where there is room
    assert gate.place(snap(busy, free), chosen=1)[0] == 2
    # nowhere has room: judged on the least pressured, which it would go to
    also_busy = WorkerPressure(worker_id=2, running=0, inflight=4)
    w, verdict = gate.place(snap(busy, also_busy), chosen=1)
    assert w == 2 and verdict.action is Action.DELAY and "4 requests" in verdict.reason
    assert gate.place(snap(), chosen=7) == (7, Verdict(Action.ADMIT, "no load known"))


def test_no_router_answer_is_a_wait_then_a_shed() -> None:
    assert policy().gate("batch").unanswered() == Verdict(
        Action.DELAY, "batch work delayed: the Router did not answer", delay_s=0.5)
    late = policy().gate("batch", waited_s=1.8).unanswered()
    assert late.action is Action.SHED and "the Router did not answer" in late.reason
