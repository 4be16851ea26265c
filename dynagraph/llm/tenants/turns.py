"""The Processor's side of SLO-aware admission: deferrable requests take turns asking the
Router, wait between asks, and are shed with 429 past their limit.

``SloAdmission`` (``slo_admission``) judges; this object keeps the order and the clock.
Deferrable requests (``batch``) ask in arrival order: only the first in line asks the
Router (with a ``Gate``), and a delayed one is not counted by the Router (a waiting
request is no load) and asks again every ``delay-step`` s. One asker at a time: with every
waiting request asking every ``delay-step`` s, a hundred of them under an overload kept
the Processor and the Router so busy that the Processor missed its stream heartbeats.
A Router that does not answer counts as pressure (the request waits too). Other classes
are never gated. Callers: ``take`` the turn, then ``wait_s`` for each answer until it is
0 (go on, and ``release`` the turn) or it raises ``RequestShed``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Protocol

from dynagraph.errors import RequestShed
from dynagraph.llm.tenants.slo import SloClass
from dynagraph.llm.tenants.slo_admission import (
    Action,
    Gate,
    Pressure,
    SloAdmission,
    SloAdmissionConfig,
    Verdict,
)

log = logging.getLogger(__name__)


class RouterAnswer(Protocol):
    """What the Router's decision says about admission (``RouteDecision``)."""

    @property
    def verdict(self) -> Verdict | None: ...

    @property
    def pressure(self) -> Pressure | None: ...


class AdmissionCounters(Protocol):
    """Where delays and sheds are counted (``ProcessorMetrics``)."""

    def slo_delayed(self, slo_class: str, seconds: float) -> None: ...

    def slo_shed(self, slo_class: str) -> None: ...


class AdmissionTurns:
    """Turn-taking and waiting of deferrable requests (one per Processor)."""

    def __init__(self, config: SloAdmissionConfig, classes: Mapping[str, SloClass],
                 counters: AdmissionCounters) -> None:
        self.config = config
        self.slo = SloAdmission(config, classes)  # ConfigError on a bad config
        self._counters = counters
        self._turn = asyncio.Lock()

    def deferrable(self, slo_class: str) -> bool:
        return self.slo.deferrable(slo_class)

    def gate(self, slo_class: str, waited_s: float) -> Gate:
        """What the route request carries after ``waited_s`` s of waiting."""
        return self.slo.gate(slo_class, waited_s)

    async def take(self, request_id: str, slo_class: str, began: float) -> None:
        """Wait, in arrival order, until no other deferrable request is asking the Router;
        ``RequestShed`` past ``max-delay`` (``began``: ``time.monotonic()`` at arrival)."""
        try:
            async with asyncio.timeout(self.config.max_delay):
                await self._turn.acquire()
        except TimeoutError:
            raise self._shed(request_id, slo_class, self.slo.gate(
                slo_class, time.monotonic() - began).gave_up("in line for admission")) from None

    def release(self) -> None:
        """Give the turn to the next in line (once the Router admitted, or on the way out)."""
        self._turn.release()

    def wait_s(self, request_id: str, slo_class: str, decision: RouterAnswer | None,
               waited: float) -> float:
        """0 to go on now, else the seconds to wait before asking again; ``RequestShed`` if
        the request is shed. The Router's verdict counts (judged where the request is
        counted); a Router that sent none is judged here from its pressure snapshot, and
        no decision at all (no answer in time) counts as pressure: a Router too busy to
        answer is a sign of it, and the untracked round-robin fallback would let a flood
        of deferrable work through uncounted."""
        if decision is None:
            verdict = self.slo.gate(slo_class, waited).unanswered()
        else:
            verdict = decision.verdict or self.slo.decide(decision.pressure, slo_class, waited)
        log.debug("request %s (%s): %s -> %s", request_id, slo_class,
                  decision.pressure if decision is not None else "no decision", verdict)
        if verdict.action is Action.ADMIT:
            if waited > 0:
                self._counters.slo_delayed(slo_class, waited)
            return 0.0
        if verdict.action is Action.SHED:
            raise self._shed(request_id, slo_class, verdict)
        if waited == 0:
            log.info("request %s delayed: %s", request_id, verdict.reason)
        return verdict.delay_s

    def _shed(self, request_id: str, slo_class: str, verdict: Verdict) -> RequestShed:
        """Count and log a shed request; the error to raise (429 with Retry-After)."""
        self._counters.slo_shed(slo_class)
        log.info("request %s shed: %s", request_id, verdict.reason)
        return RequestShed(verdict.reason, retry_after=verdict.retry_after, code="slo_shed")
