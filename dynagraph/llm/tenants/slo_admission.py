"""SLO-aware admission: admit, delay or shed one request, from a snapshot of the workers'
pressure and the request's SLO class. Pure: no clock, no I/O.

The Router judges, the Processor waits. A deferrable request's route request carries a
:class:`Gate` (the thresholds, the protected target, how long the request has waited);
the Router summarises the candidate workers' :class:`Pressure` (per worker its running
and waiting requests, the requests the Router itself has in flight there, KV usage, and a
predicted time to first token where it has one), asks ``Gate.place`` (the worker its cost
chose if that one is below the thresholds, else the least pressured candidate, judged on
that one) and, only when the verdict is ``admit``, starts counting the request on that
worker, all in one synchronous step. So no two waiting requests can both see the last free place: checking
in one round trip and counting in another let several through at once when load dropped
(the least loaded worker at 10 requests with ``delay-at-requests: 4``). A delayed request
waits and asks again; ``SloAdmission.decide`` is the same judgement for a caller that has
only a pressure snapshot. Classes in ``defer-classes`` (``batch`` by default) are *deferrable*: they are
delayed while the system is under pressure and shed when it is far over; every other
class is always admitted (vLLM's priority scheduling serves it first).

Pressure is judged on the *least* pressured candidate (a request can go there), one
level per signal, the highest of them counting::

    requests = max(running + waiting, inflight)      # reports lag; the Router's count not
    delay  if requests >= delay-at-requests  or kv_usage >= delay-at-kv-usage
              or predicted_ttft >= delay-at-ttft * target
              or prefilling >= delay-at-prefills
    shed   if requests >= shed-at-requests   or kv_usage >= shed-at-kv-usage
              or predicted_ttft >= shed-at-ttft * target

``target`` is the tightest TTFT target of the classes that are *not* deferrable (the work
the admission protects). ``prefilling`` counts the worker's requests still waiting for
their first token: an engine step runs every scheduled prefill chunk at once, so a
protected request that arrives behind a few deferrable prefills waits for all of them;
``delay-at-prefills: 1`` lets deferrable work start only on a worker with no prefill
in flight, so a protected request waits behind at most one. A deferrable request that is delayed waits ``delay-step`` s and
asks again; once it has waited ``max-delay`` s it is shed. A shed request is refused with
HTTP 429 and ``Retry-After`` (nothing is dropped silently).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from enum import StrEnum

import msgspec
from pydantic import Field, model_validator

from dynagraph.config import ConfigModel
from dynagraph.errors import ConfigError
from dynagraph.llm.tenants.slo import SloClass


class WorkerPressure(msgspec.Struct, frozen=True, omit_defaults=True):
    """One candidate worker's pressure, as the Router sees it."""

    worker_id: int
    running: int = 0
    waiting: int = 0
    inflight: int = 0
    """Requests this Router routed to the worker that have not finished."""
    kv_usage: float = 0.0
    predicted_ttft_s: float | None = None
    """A new request's predicted seconds to first token there (None: no prediction)."""
    prefilling: int = 0
    """Requests there still waiting for their first token (the Router's forecast,
    corrected by the worker's reports)."""

    @property
    def requests(self) -> int:
        return max(self.running + self.waiting, self.inflight)


class Pressure(msgspec.Struct, frozen=True, omit_defaults=True):
    """The candidates' pressure (empty: the Router knows no load)."""

    workers: list[WorkerPressure] = []


class Action(StrEnum):
    ADMIT = "admit"
    DELAY = "delay"
    SHED = "shed"


class Verdict(msgspec.Struct, frozen=True, omit_defaults=True):
    """The judgement of one deferrable request (travels Router -> Processor)."""

    action: Action
    reason: str = ""
    delay_s: float = 0.0
    """How long to wait before asking again (``DELAY`` only)."""
    retry_after: int = 0
    """Seconds the client should wait before retrying (``SHED`` only)."""


class SloAdmissionConfig(ConfigModel):
    """The Processor's ``slo-admission`` block."""

    enabled: bool = False
    defer_classes: list[str] = Field(default_factory=lambda: ["batch"])
    """Classes delayed, then shed, under pressure; the others are always admitted."""
    delay_at_requests: int = Field(default=8, ge=1)
    """Requests (running + waiting, or in flight from this Router) on the least loaded
    worker at which deferrable work waits."""
    shed_at_requests: int = Field(default=32, ge=1)
    delay_at_kv_usage: float = Field(default=0.85, gt=0.0, le=1.0)
    shed_at_kv_usage: float = Field(default=0.98, gt=0.0, le=1.0)
    delay_at_ttft: float = Field(default=0.5, gt=0.0)
    """Fraction of the tightest protected TTFT target a predicted TTFT may reach before
    deferrable work waits (used only where the Router predicts TTFT)."""
    shed_at_ttft: float = Field(default=1.0, gt=0.0)
    delay_at_prefills: int | None = Field(default=1, ge=1)
    """Requests in prefill on the least loaded worker at which deferrable work waits
    (null: not a signal). 1 = deferrable work starts only where no prefill is running
    (``benchmarks/results/slo_admission.md``: the misses that came in bursts when batch
    work was admitted went away)."""
    delay_step: float = Field(default=0.25, gt=0.0)
    """Seconds between a delayed request's checks."""
    max_delay: float = Field(default=30.0, ge=0.0)
    """Seconds a deferrable request may wait; then it is shed."""

    @model_validator(mode="after")
    def _ordered(self) -> SloAdmissionConfig:
        for low, high, name in ((self.delay_at_requests, self.shed_at_requests, "requests"),
                                (self.delay_at_kv_usage, self.shed_at_kv_usage, "kv-usage"),
                                (self.delay_at_ttft, self.shed_at_ttft, "ttft")):
            if low > high:
                raise ValueError(f"delay-at-{name} ({low}) must not exceed "
                                 f"shed-at-{name} ({high})")
        return self


_OK, _DELAY, _SHED = 0, 1, 2


class Gate(msgspec.Struct, frozen=True, kw_only=True):
    """Everything needed to judge one deferrable request against a pressure snapshot: the
    thresholds (``SloAdmissionConfig``'s), the protected TTFT target and the request's
    class and waiting time so far. Sent with the request's route request."""

    slo_class: str
    waited_s: float = 0.0
    target_s: float | None = None
    delay_at_requests: int
    shed_at_requests: int
    delay_at_kv_usage: float
    shed_at_kv_usage: float
    delay_at_ttft: float
    shed_at_ttft: float
    delay_step: float
    max_delay: float
    delay_at_prefills: int | None = None

    def level(self, w: WorkerPressure) -> tuple[int, str]:
        """(0 ok / 1 delay / 2 shed, why) for one worker."""
        found: tuple[int, str] = (_OK, "")
        checks: list[tuple[int, str]] = []
        n = w.requests
        if n >= self.shed_at_requests:
            checks.append((_SHED, f"{n} requests on the least loaded worker "
                                  f"(shed at {self.shed_at_requests})"))
        elif n >= self.delay_at_requests:
            checks.append((_DELAY, f"{n} requests on the least loaded worker "
                                   f"(delay at {self.delay_at_requests})"))
        if w.kv_usage >= self.shed_at_kv_usage:
            checks.append((_SHED, f"KV cache {w.kv_usage:.0%} full (shed at "
                                  f"{self.shed_at_kv_usage:.0%})"))
        elif w.kv_usage >= self.delay_at_kv_usage:
            checks.append((_DELAY, f"KV cache {w.kv_usage:.0%} full (delay at "
                                   f"{self.delay_at_kv_usage:.0%})"))
        if w.predicted_ttft_s is not None and self.target_s is not None:
            ratio = w.predicted_ttft_s / self.target_s
            what = (f"predicted TTFT {w.predicted_ttft_s:.2f}s against the protected "
                    f"target {self.target_s:g}s")
            if ratio >= self.shed_at_ttft:
                checks.append((_SHED, what))
            elif ratio >= self.delay_at_ttft:
                checks.append((_DELAY, what))
        if self.delay_at_prefills is not None and w.prefilling >= self.delay_at_prefills:
            checks.append((_DELAY, f"{w.prefilling} requests in prefill on the least loaded "
                                   f"worker (delay at {self.delay_at_prefills})"))
        for lvl, why in checks:
            if lvl > found[0]:
                found = (lvl, why)
        return found

    def decide(self, pressure: Pressure | None) -> Verdict:
        """Admit, delay or shed, judged on the least pressured candidate."""
        if pressure is None or not pressure.workers:
            return Verdict(Action.ADMIT, "no load known")
        return self._verdict(*min((self.level(w) for w in pressure.workers),
                                  key=lambda x: x[0]))

    def place(self, pressure: Pressure, chosen: int) -> tuple[int, Verdict]:
        """Where the request goes and the verdict: the ``chosen`` worker (the Router's
        cost) if it is below every delay threshold, else the least pressured candidate
        (fewest requests among equals), judged on that one. So an admitted request never
        lands on a worker over the thresholds while another has room."""
        levels = {w.worker_id: (self.level(w), w.requests) for w in pressure.workers}
        if not levels:
            return chosen, Verdict(Action.ADMIT, "no load known")
        if chosen in levels and levels[chosen][0][0] == _OK:
            return chosen, self._verdict(_OK, "")
        best = min(levels, key=lambda k: (levels[k][0][0], levels[k][1], k))
        return best, self._verdict(*levels[best][0])

    def unanswered(self) -> Verdict:
        """The verdict when the Router did not answer: wait (or, past max-delay, shed)."""
        return self._verdict(_DELAY, "the Router did not answer")

    def gave_up(self, why: str) -> Verdict:
        """Shed after waiting ``waited_s`` (``why``: where it waited)."""
        return Verdict(Action.SHED, f"{self.slo_class} work shed after waiting "
                                    f"{self.waited_s:.1f}s {why}", retry_after=self._retry())

    def _retry(self) -> int:
        return max(1, math.ceil(max(self.max_delay / 4, self.delay_step)))

    def _verdict(self, lvl: int, why: str) -> Verdict:
        if lvl == _OK:
            return Verdict(Action.ADMIT, "below the delay thresholds")
        if lvl == _SHED:
            return Verdict(Action.SHED, f"{self.slo_class} work shed under pressure: {why}",
                           retry_after=self._retry())
        if self.waited_s + self.delay_step > self.max_delay:
            return self.gave_up(f"under pressure: {why}")
        return Verdict(Action.DELAY, f"{self.slo_class} work delayed: {why}",
                       delay_s=self.delay_step)


class SloAdmission:
    """``decide(pressure, slo_class, waited_s)`` for one configuration and set of classes."""

    def __init__(self, config: SloAdmissionConfig, classes: Mapping[str, SloClass]) -> None:
        unknown = sorted(set(config.defer_classes) - set(classes))
        if unknown:
            raise ConfigError(f"defer-classes names unknown SLO classes {unknown} (known: "
                              f"{', '.join(sorted(classes))})", key="slo-admission")
        self.config = config
        self.defer = frozenset(config.defer_classes)
        targets = [c.ttft_ms for name, c in classes.items()
                   if name not in self.defer and c.ttft_ms is not None]
        self.target_s: float | None = min(targets) / 1000.0 if targets else None
        """The tightest TTFT target of the protected classes, in seconds."""

    def deferrable(self, slo_class: str) -> bool:
        return self.config.enabled and slo_class in self.defer

    def gate(self, slo_class: str, waited_s: float = 0.0) -> Gate:
        """The gate a request of ``slo_class`` that has waited ``waited_s`` goes through."""
        c = self.config
        return Gate(slo_class=slo_class, waited_s=waited_s, target_s=self.target_s,
                    delay_at_requests=c.delay_at_requests, shed_at_requests=c.shed_at_requests,
                    delay_at_kv_usage=c.delay_at_kv_usage, shed_at_kv_usage=c.shed_at_kv_usage,
                    delay_at_ttft=c.delay_at_ttft, shed_at_ttft=c.shed_at_ttft,
                    delay_step=c.delay_step, max_delay=c.max_delay,
                    delay_at_prefills=c.delay_at_prefills)

    def decide(self, pressure: Pressure | None, slo_class: str, waited_s: float = 0.0
               ) -> Verdict:
        """What to do with a request of ``slo_class`` that has waited ``waited_s`` so far."""
        if not self.deferrable(slo_class):
            return Verdict(Action.ADMIT, "not deferrable")
        return self.gate(slo_class, waited_s).decide(pressure)
