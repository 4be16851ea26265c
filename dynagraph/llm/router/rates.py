"""How fast each worker is, learned from what it publishes. Pure: no I/O, no clock.

The Router prices a request in seconds (``dynagraph.llm.router.cost``), so it needs each
worker's speeds:

``prefill_s_per_token``
    seconds of engine time per prompt token computed (a cache miss). Observed from the
    ``EngineLoad`` counters ``prefill_tokens_total`` / ``prefill_seconds_total``: the
    engine steps that computed prompt tokens and how long they took (a mixed step's
    decodes included, as they slow the prefill down too).
``decode_step_s``
    seconds of one engine step that only decodes, from ``decode_steps_total`` /
    ``decode_seconds_total``: each step of a new prefill also runs the worker's decodes.
``chunk_tokens``
    the most prompt tokens one step computes (``max_num_batched_tokens``, published as
    is): a long prompt is prefilled over several steps.

Each speed is a :class:`RobustEwma` of the ratio of the counters' increases between two
samples, weighted by what the increase covers (tokens, steps). Before any data it holds
a prior: the worker's own nominal speed when it publishes one (the simulated engine
derives it from its timing profile), else :class:`RatePriors`. A worker whose counters
go backwards restarted: the learner takes the new values as its baseline.

A worker without data yet takes the fleet's speeds (:func:`fleet_rates`: the geometric
median of the workers with data) rather than the prior: a worker that joins a running
fleet is then priced like its peers, not like a guess.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from dynagraph.llm.engines.base import EngineLoad


@dataclass(frozen=True, slots=True)
class WorkerRates:
    """A worker's speeds, as :func:`~dynagraph.llm.router.cost.choose_worker` uses them."""

    prefill_s_per_token: float
    decode_step_s: float
    chunk_tokens: int
    """Prompt tokens per step at most; 0 = unknown (the prefill counts as one step)."""
    request_s: float = 2.0
    """Seconds a request stays on the worker, from routing to its end (how often a full
    batch frees a place)."""


@dataclass(frozen=True, slots=True)
class RatePriors:
    """Speeds assumed before a worker has published any (and no nominal ones).

    The defaults are the order of the tiny CPU model here (cpu-tiny profile: ~20k prompt
    tokens/s for a 2048-token chunk, ~4 ms per decode step); the learned values replace
    them within a few requests. Workers that all start from the same prior are compared
    fairly anyway: only the queue and the cache tell them apart.
    """

    prefill_s_per_token: float = 1e-4
    decode_step_s: float = 0.005
    chunk_tokens: int = 2048
    request_s: float = 2.0


class RobustEwma:
    """An exponentially weighted mean of positive observations, robust to outliers.

    Works on logarithms (speeds are ratios; a step twice as slow and one twice as fast
    balance). Each observation moves the estimate by ``alpha * clamp(log(x) - log(est))``
    where the clamp is ``+-log(max_ratio)``: one outlier, however wild, moves the
    estimate by at most that factor to the power ``alpha``. ``alpha`` is
    ``weight / (seen + weight)`` while less than ``half_life`` of weight has been seen
    (with the prior counted as ``prior_weight``: a plain mean of the data so far, so the
    prior fades fast), then ``1 - 0.5 ** (weight / half_life)``: data ``half_life``
    (in weight units) old counts half as much as new data.
    """

    __slots__ = ("_log", "_prior", "_seen", "half_life", "max_ratio", "prior_weight")

    def __init__(self, prior: float, half_life: float, *, prior_weight: float | None = None,
                 max_ratio: float = 3.0) -> None:
        if not (prior > 0 and math.isfinite(prior)):
            raise ValueError(f"prior must be a positive number, got {prior}")
        if half_life <= 0 or max_ratio <= 1:
            raise ValueError("half_life must be > 0 and max_ratio > 1")
        self.half_life = half_life
        self.prior_weight = half_life / 10 if prior_weight is None else prior_weight
        self.max_ratio = max_ratio
        self._prior = prior
        self._log = math.log(prior)
        self._seen = 0.0

    @property
    def value(self) -> float:
        return self._prior if self._seen == 0 else math.exp(self._log)

    @property
    def seen(self) -> float:
        """The total weight of the observations taken so far (0: still the prior)."""
        return self._seen

    def set_prior(self, prior: float) -> None:
        """Replace the prior; ignored once data has been observed or if not positive."""
        if self._seen == 0 and prior > 0 and math.isfinite(prior):
            self._prior = prior
            self._log = math.log(prior)

    def observe(self, value: float, weight: float = 1.0) -> None:
        """Take one observation; non-positive or non-finite values and weights are ignored."""
        if not (value > 0 and weight > 0 and math.isfinite(value) and math.isfinite(weight)):
            return
        if self._seen < self.half_life:
            alpha = weight / (self.prior_weight + self._seen + weight)
        else:
            alpha = 1.0 - 0.5 ** (weight / self.half_life)
        bound = math.log(self.max_ratio)
        step = min(max(math.log(value) - self._log, -bound), bound)
        self._log += alpha * step
        self._seen += weight


PREFILL_HALF_LIFE_TOKENS = 16384.0
"""About 5-10 long prompts: quick to follow a machine that slows down, slow to be fooled."""
DECODE_HALF_LIFE_STEPS = 200.0
REQUEST_HALF_LIFE = 32.0
"""Requests: the time a request stays follows the workload's output lengths."""


class RateLearner:
    """One worker's speeds, fed with each ``EngineLoad`` sample it publishes."""

    def __init__(self, priors: RatePriors | None = None) -> None:
        p = priors or RatePriors()
        self.priors = p
        self.prefill = RobustEwma(p.prefill_s_per_token, PREFILL_HALF_LIFE_TOKENS)
        self.decode = RobustEwma(p.decode_step_s, DECODE_HALF_LIFE_STEPS)
        self.request = RobustEwma(p.request_s, REQUEST_HALF_LIFE, max_ratio=10.0)
        self.chunk_tokens = p.chunk_tokens
        self._prev: EngineLoad | None = None

    def request_ended(self, seconds: float) -> None:
        """A request routed here ended after ``seconds`` (routing to its end)."""
        self.request.observe(seconds)

    def observe(self, load: EngineLoad) -> None:
        """Learn from the counters' increase since the previous sample (the first sample
        counts from zero: the worker's whole history as one observation)."""
        if load.nominal_prefill_tokens_per_s:
            self.prefill.set_prior(1.0 / load.nominal_prefill_tokens_per_s)
        if load.nominal_decode_step_s:
            self.decode.set_prior(load.nominal_decode_step_s)
        if load.max_num_batched_tokens > 0:
            self.chunk_tokens = load.max_num_batched_tokens
        prev = self._prev or EngineLoad()
        self._prev = load
        d_tokens = load.prefill_tokens_total - prev.prefill_tokens_total
        d_prefill_s = load.prefill_seconds_total - prev.prefill_seconds_total
        d_steps = load.decode_steps_total - prev.decode_steps_total
        d_decode_s = load.decode_seconds_total - prev.decode_seconds_total
        if min(d_tokens, d_prefill_s, d_steps, d_decode_s) < 0:
            return  # counters went back: the worker restarted; this sample is the baseline
        if d_tokens > 0 and d_prefill_s > 0:
            self.prefill.observe(d_prefill_s / d_tokens, d_tokens)
        if d_steps > 0 and d_decode_s > 0:
            self.decode.observe(d_decode_s / d_steps, d_steps)

    def rates(self) -> WorkerRates:
        return WorkerRates(prefill_s_per_token=self.prefill.value,
                           decode_step_s=self.decode.value, chunk_tokens=self.chunk_tokens,
                           request_s=self.request.value)


def _median(values: list[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


@dataclass(frozen=True, slots=True)
class FleetRates:
    """The fleet's speeds (geometric medians of the workers with data; None: nobody has
    any yet), which a worker without data of its own takes."""

    prefill_s_per_token: float | None = None
    decode_step_s: float | None = None
    request_s: float | None = None

    def of(self, x: RateLearner) -> WorkerRates:
        """``x``'s speeds: its own where it has data, else the fleet's, else its prior."""
        return WorkerRates(
            prefill_s_per_token=_own_or(x.prefill, self.prefill_s_per_token),
            decode_step_s=_own_or(x.decode, self.decode_step_s),
            chunk_tokens=x.chunk_tokens,
            request_s=_own_or(x.request, self.request_s))


def _own_or(own: RobustEwma, fleet: float | None) -> float:
    return own.value if own.seen > 0 or fleet is None else fleet


def _geometric_median(values: Iterable[RobustEwma]) -> float | None:
    logs = [math.log(e.value) for e in values if e.seen > 0]
    return math.exp(_median(logs)) if logs else None


def fleet_medians(learners: Iterable[RateLearner]) -> FleetRates:
    """The geometric medians of the learned speeds."""
    fleet = list(learners)
    return FleetRates(_geometric_median(x.prefill for x in fleet),
                      _geometric_median(x.decode for x in fleet),
                      _geometric_median(x.request for x in fleet))


def fleet_rates(learners: dict[int, RateLearner]) -> dict[int, WorkerRates]:
    """Each worker's speeds; a worker without data takes the fleet's (module docstring).
    Equal speeds are one shared object (``choose_worker`` prices each distinct pair of
    load and speeds once: most of a large fleet has learned nothing yet)."""
    fleet = fleet_medians(learners.values())
    shared: dict[WorkerRates, WorkerRates] = {}
    out: dict[int, WorkerRates] = {}
    for w, x in learners.items():
        rates = fleet.of(x)
        out[w] = shared.setdefault(rates, rates)
    return out
