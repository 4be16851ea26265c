"""Load-based scaling decisions: how many prefill and decode replicas to run (pure, no I/O).

Every ``adjustment-interval`` the Planner hands ``decide`` the mean of the load samples
it took in that interval (``Observation``), the replica counts it last asked for and the
counts actually serving (``Replicas``), and the state ``decide`` returned last time. The
signals are those Dynamo's load-based planner watches, plus the engines' queues:

- **decode pressure**: the largest of ``kv_usage / decode-kv-scale-up``,
  ``waiting / decode-waiting-scale-up`` and, with ``decode-batch-per-replica`` set,
  ``running / (decode-batch-per-replica * decode-batch-scale-up)`` over the decode engines
  (KV usage is the mean fraction of KV blocks in use; ``waiting`` and ``running`` are
  requests queued and running per decode replica: a full batch or cache queues);
- **prefill pressure**: ``prefill_queue / prefill-queue-scale-up``, jobs waiting in the
  prefill queue per prefill replica.

A role scales **up** by one replica when its pressure is >= 1, and **down** by one when it
is under the down thresholds (``decode-kv-scale-down`` and no more than
``decode-waiting-scale-down`` waiting; ``prefill-queue-scale-down``): the gap between the
two thresholds is the hysteresis. Further rules against over-compensation:

- no scale-down that the same load would undo: the pressure projected onto one replica
  fewer (per-replica load x n / (n - 1); waiting excluded, it is zero there) must stay
  under 1 (the queue-based signals depend on the capacity, so without this a role would
  flap between n and n - 1);
- one replica per role per interval (``max-step-up`` > 1: a scale-up of as many as the
  load needs, ``ceil(n * pressure) - n``, at most that many; and while replicas are
  still starting, more if the load on the serving ones needs more than the target), and
  none while that role is **settling** (its
  serving count differs from its target: a new replica still starting, a removed one
  still draining);
- after a role changed, it holds for ``cooldown-intervals`` intervals; after a decode
  scale-up, decode does not scale down for ``decode-grace-intervals`` (a new replica
  needs time to fill its cache, Dynamo's ``NEW_DECODE_WORKER_GRACE_PERIOD``);
- the prefill queue is not scaled up when its trend over the last interval brings it under
  the up threshold within ``prefill-trend-intervals`` intervals;
- ``min-*`` / ``max-*`` replicas per role, and a **GPU budget**:
  ``prefill * gpus-per-prefill + decode * gpus-per-decode <= gpu-budget``. When both roles
  want to grow and only one fits, the one under more pressure grows; when one role wants
  to grow and the budget is full, a replica of the other role is **moved** to it, if that
  role is not under pressure itself (``pressure < move-below``) and is above its minimum.

A graph without prefill workers (aggregated) sets ``max-prefill-replicas: 0``.

**Up fast, down slow** (:func:`surge`): between two adjustments the Planner also hands
the last ``surge-window`` seconds of samples to ``surge``, which applies the same rules
but keeps only a scale-up. A burst is then met within a second or two of its start, not
at the end of an interval whose mean it first has to lift (a 5 s interval met a step
from nothing to 3.9 requests/s 5-10 s late, and the queue of those seconds was pinned
to the one replica serving). Scale-downs still wait for a whole interval's mean.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from pydantic import Field, model_validator

from dynagraph.config import ConfigModel

Role = Literal["prefill", "decode"]
Reason = Literal["hold", "up", "down", "settling", "cooldown", "grace", "trend", "projected",
                 "min", "max", "budget", "moved-in", "moved-out"]
"""Why a role's target is what it is; a small fixed set, usable as a metric label."""


class PlannerPolicy(ConfigModel):
    """Thresholds, bounds and the budget (YAML keys in kebab-case)."""

    decode_kv_scale_up: float = Field(default=0.8, gt=0, le=1)
    decode_kv_scale_down: float = Field(default=0.3, ge=0, le=1)
    decode_waiting_scale_up: float = Field(default=2.0, gt=0)
    """Requests waiting per decode replica (batch or cache full) that call for one more."""
    decode_waiting_scale_down: float = Field(default=0.0, ge=0)
    decode_batch_per_replica: float | None = Field(default=None, gt=0)
    """Requests a decode replica runs at once (its engines' ``max-num-seqs``); None: the
    running count is not a signal."""
    decode_batch_scale_up: float = Field(default=0.9, gt=0, le=1)
    """Fraction of ``decode-batch-per-replica`` running that calls for one more replica."""
    prefill_queue_scale_up: float = Field(default=2.0, gt=0)
    """Prefill-queue jobs waiting per prefill replica that call for one more."""
    prefill_queue_scale_down: float = Field(default=0.2, ge=0)
    min_decode_replicas: int = Field(default=1, ge=0)
    max_decode_replicas: int = Field(default=8, ge=0)
    min_prefill_replicas: int = Field(default=0, ge=0)
    max_prefill_replicas: int = Field(default=8, ge=0)
    gpu_budget: int = Field(default=8, ge=0)
    gpus_per_decode: int = Field(default=1, ge=0)
    gpus_per_prefill: int = Field(default=1, ge=0)
    cooldown_intervals: int = Field(default=1, ge=0)
    """Intervals a role holds after it changed (0: it may change again next interval)."""
    decode_grace_intervals: int = Field(default=3, ge=0)
    """Intervals after a decode scale-up before decode may scale down."""
    prefill_trend_intervals: int = Field(default=3, ge=0)
    """Look-ahead of the prefill-queue trend (0: trend ignored)."""
    move_below: float = Field(default=0.5, ge=0)
    """A role gives a replica to the other only while its pressure is under this."""
    max_step_up: int = Field(default=1, ge=1)
    """Most replicas a role gains in one interval (1: Dynamo's one at a time)."""
    surge_window: float = Field(default=1.0, ge=0)
    """Seconds of samples a scale-up between adjustments is judged on (0: scale-ups wait
    for the adjustment interval, as scale-downs do)."""

    @model_validator(mode="after")
    def _consistent(self) -> PlannerPolicy:
        if self.decode_kv_scale_down >= self.decode_kv_scale_up:
            raise ValueError("decode-kv-scale-down must be below decode-kv-scale-up")
        if self.decode_waiting_scale_down >= self.decode_waiting_scale_up:
            raise ValueError("decode-waiting-scale-down must be below decode-waiting-scale-up")
        if self.prefill_queue_scale_down >= self.prefill_queue_scale_up:
            raise ValueError("prefill-queue-scale-down must be below prefill-queue-scale-up")
        if self.min_decode_replicas > self.max_decode_replicas:
            raise ValueError("min-decode-replicas exceeds max-decode-replicas")
        if self.min_prefill_replicas > self.max_prefill_replicas:
            raise ValueError("min-prefill-replicas exceeds max-prefill-replicas")
        floor = (self.min_decode_replicas * self.gpus_per_decode
                 + self.min_prefill_replicas * self.gpus_per_prefill)
        if floor > self.gpu_budget:
            raise ValueError(f"the minimum replicas need {floor} GPUs, over gpu-budget "
                             f"{self.gpu_budget}")
        return self


@dataclass(frozen=True)
class Observation:
    """One adjustment interval's load, averaged over its samples."""

    decode_kv_usage: float = 0.0
    """Mean fraction of KV blocks in use over the decode engines, 0..1."""
    decode_waiting: float = 0.0
    """Requests waiting per decode replica."""
    decode_running: float = 0.0
    """Requests running per decode replica."""
    prefill_queue: float = 0.0
    """Prefill-queue jobs not yet picked up, per prefill replica (all of them if none)."""


@dataclass(frozen=True)
class Replicas:
    prefill: int
    decode: int

    def gpus(self, policy: PlannerPolicy) -> int:
        return self.prefill * policy.gpus_per_prefill + self.decode * policy.gpus_per_decode

    def get(self, role: Role) -> int:
        return self.prefill if role == "prefill" else self.decode

    def with_(self, role: Role, n: int) -> Replicas:
        return replace(self, prefill=n) if role == "prefill" else replace(self, decode=n)


@dataclass(frozen=True)
class PlannerState:
    """What ``decide`` remembers between intervals (start with ``PlannerState()``)."""

    interval: int = 0
    last_change: tuple[int | None, int | None] = (None, None)
    """Interval of the last change of (prefill, decode)."""
    last_decode_up: int | None = None
    prev_prefill_queue: float | None = None


@dataclass(frozen=True)
class Decision:
    target: Replicas
    reasons: tuple[Reason, Reason]
    """(prefill, decode)."""
    pressure: tuple[float, float]
    """(prefill, decode): >= 1 wants a replica more."""
    state: PlannerState

    @property
    def changed(self) -> bool:
        return self.reasons[0] in _CHANGES or self.reasons[1] in _CHANGES


_CHANGES = frozenset({"up", "down", "moved-in", "moved-out"})


def pressures(policy: PlannerPolicy, obs: Observation) -> tuple[float, float]:
    """(prefill, decode) pressure: >= 1.0 means the role wants one replica more."""
    decode = max(obs.decode_kv_usage / policy.decode_kv_scale_up,
                 obs.decode_waiting / policy.decode_waiting_scale_up,
                 _batch_pressure(policy, obs.decode_running))
    return obs.prefill_queue / policy.prefill_queue_scale_up, decode


def _batch_pressure(policy: PlannerPolicy, running: float) -> float:
    if policy.decode_batch_per_replica is None:
        return 0.0
    return running / (policy.decode_batch_per_replica * policy.decode_batch_scale_up)


def projected_pressure(policy: PlannerPolicy, obs: Observation, role: Role, n: int) -> float:
    """The role's pressure if the same load ran on ``n - 1`` replicas instead of ``n``
    (infinite for ``n <= 1``). KV usage is a mean per engine, so it scales as the
    per-replica counts do."""
    if n <= 1:
        return float("inf")
    k = n / (n - 1)
    if role == "prefill":
        return obs.prefill_queue * k / policy.prefill_queue_scale_up
    return max(obs.decode_kv_usage * k / policy.decode_kv_scale_up,
               _batch_pressure(policy, obs.decode_running * k))


def _wish(policy: PlannerPolicy, state: PlannerState, obs: Observation, role: Role,
          pressure: float, target: Replicas, serving: Replicas) -> tuple[int, Reason]:
    """The role's wanted change (-1, 0, +1) and why, before bounds and budget."""
    n, m = serving.get(role), target.get(role)
    if n != m:
        if m > n and pressure >= 1.0 and policy.max_step_up > 1:
            # Still starting, and the load on the n serving replicas needs more than m.
            need = math.ceil(max(n, 1) * pressure - 1e-9)
            if need > m:
                return min(policy.max_step_up, need - m), "up"
        return 0, "settling"
    last = state.last_change[0 if role == "prefill" else 1]
    if last is not None and state.interval - last <= policy.cooldown_intervals:
        return 0, "cooldown"
    if pressure >= 1.0:
        if role == "prefill" and policy.prefill_trend_intervals and (
                state.prev_prefill_queue is not None):
            slope = obs.prefill_queue - state.prev_prefill_queue
            ahead = obs.prefill_queue + slope * policy.prefill_trend_intervals
            if ahead < policy.prefill_queue_scale_up:
                return 0, "trend"
        return _step_up(policy, target.get(role), pressure), "up"
    if role == "prefill":
        low = obs.prefill_queue < policy.prefill_queue_scale_down
    else:
        low = (obs.decode_kv_usage < policy.decode_kv_scale_down
               and obs.decode_waiting <= policy.decode_waiting_scale_down)
        if low and state.last_decode_up is not None and (
                state.interval - state.last_decode_up <= policy.decode_grace_intervals):
            return 0, "grace"
    n = target.get(role)
    if low and n > _bounds(policy, role)[0] and projected_pressure(policy, obs, role, n) >= 1.0:
        return 0, "projected"
    return (-1, "down") if low else (0, "hold")


def _step_up(policy: PlannerPolicy, n: int, pressure: float) -> int:
    """Replicas to add: enough to bring the pressure to 1 if the load spread evenly
    (``ceil(n * pressure) - n``, at least 1), at most ``max-step-up``."""
    need = math.ceil(max(n, 1) * pressure - 1e-9) - max(n, 1)
    return max(1, min(policy.max_step_up, need))


def _bounds(policy: PlannerPolicy, role: Role) -> tuple[int, int]:
    if role == "prefill":
        return policy.min_prefill_replicas, policy.max_prefill_replicas
    return policy.min_decode_replicas, policy.max_decode_replicas


def decide(policy: PlannerPolicy, state: PlannerState, obs: Observation, target: Replicas,
           serving: Replicas) -> Decision:
    """The next target replica counts (see the module docstring for the rules).

    ``target``: the counts last asked for; ``serving``: the replicas serving now.
    """
    roles: tuple[Role, Role] = ("prefill", "decode")
    press = pressures(policy, obs)
    wish: dict[Role, int] = {}
    why: dict[Role, Reason] = {}
    for role, p in zip(roles, press, strict=True):
        wish[role], why[role] = _wish(policy, state, obs, role, p, target, serving)
        lo, hi = _bounds(policy, role)
        n = target.get(role)
        if wish[role] > 0 and n >= hi:
            wish[role], why[role] = 0, "max"
        elif wish[role] > 0:
            wish[role] = min(wish[role], hi - n)
        elif wish[role] < 0 and n <= lo:
            wish[role], why[role] = 0, "min"
    new = Replicas(target.prefill + wish["prefill"], target.decode + wish["decode"])
    if new.gpus(policy) > policy.gpu_budget:
        new, why = _fit_budget(policy, target, new, wish, why, dict(zip(roles, press,
                                                                        strict=True)))
    changed = [role for role in roles if new.get(role) != target.get(role)]
    last = (state.interval if "prefill" in changed else state.last_change[0],
            state.interval if "decode" in changed else state.last_change[1])
    decode_up = new.decode > target.decode
    next_state = PlannerState(
        interval=state.interval + 1, last_change=last,
        last_decode_up=state.interval if decode_up else state.last_decode_up,
        prev_prefill_queue=obs.prefill_queue)
    return Decision(new, (why["prefill"], why["decode"]), press, next_state)


def _fit_budget(policy: PlannerPolicy, target: Replicas, new: Replicas, wish: dict[Role, int],
                why: dict[Role, Reason], press: dict[Role, float]
                ) -> tuple[Replicas, dict[Role, Reason]]:
    """``new`` is over the budget: grow only the role under more pressure, moving a
    replica from the other role if the budget needs it and that role can spare one."""
    roles: tuple[Role, Role] = ("prefill", "decode")
    growing = [r for r in roles if wish[r] > 0]
    winner = max(growing, key=lambda r: press[r])
    other: Role = "decode" if winner == "prefill" else "prefill"
    why = dict(why)
    if other in growing:
        why[other] = "budget"
    base = target.with_(other, min(target.get(other), new.get(other)))
    per = policy.gpus_per_prefill if winner == "prefill" else policy.gpus_per_decode
    free = policy.gpu_budget - base.gpus(policy)
    fits = wish[winner] if per == 0 else min(wish[winner], free // per)
    if fits >= 1:
        return base.with_(winner, target.get(winner) + fits), why
    grown = base.with_(winner, target.get(winner) + 1)
    lo, _ = _bounds(policy, other)
    if base.get(other) == target.get(other) and target.get(other) > lo and (
            press[other] < policy.move_below) and why[other] not in ("settling", "cooldown", "grace"):
        moved = grown.with_(other, target.get(other) - 1)
        if moved.gpus(policy) <= policy.gpu_budget:
            why[winner], why[other] = "moved-in", "moved-out"
            return moved, why
    why[winner] = "budget"
    return base, why


def surge(policy: PlannerPolicy, state: PlannerState, obs: Observation, target: Replicas,
          serving: Replicas) -> Decision | None:
    """A scale-up between two adjustments, judged on ``obs`` (the last ``surge-window``
    seconds): ``decide``'s target if it adds replicas and removes none, else None.

    Cooldowns do not hold a surge back (it only adds). The returned state counts the
    change as one of the adjustment just made (so the next adjustment is not in cooldown
    for it when ``cooldown-intervals`` is 0, and decode's scale-down grace starts now);
    the interval count and the prefill-queue trend stay the adjustments' own.
    """
    if policy.surge_window <= 0:
        return None
    d = decide(policy, replace(state, last_change=(None, None)), obs, target, serving)
    new = d.target
    if new == target or new.prefill < target.prefill or new.decode < target.decode:
        return None
    at = state.interval - 1
    last = (at if new.prefill != target.prefill else state.last_change[0],
            at if new.decode != target.decode else state.last_change[1])
    return replace(d, state=replace(
        state, last_change=last,
        last_decode_up=at if new.decode > target.decode else state.last_decode_up))
