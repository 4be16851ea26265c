"""The router's choice: a pure function of overlaps, loads, request length, speeds and an RNG.

Modes (``RouterMode``) and, for the KV modes, cost models (``CostModel``):

``kv`` with the ``time`` cost model (the default): the predicted time to first token,
in seconds, lowest wins. For worker ``w`` with learned speeds
(``dynagraph.llm.router.rates``: ``p`` seconds per prompt token computed, ``d``
seconds per decode step, ``C`` prompt tokens per step at most)::

    cached  = min(overlap_blocks, request_blocks) * block_size
    uncached = max(prompt_tokens - cached, 1)      # vLLM always computes the last token
    own     = uncached * p                         # this request's prefill
    queue   = queued_tokens * p                    # prompt tokens the worker computes first
    steps   = ceil((queued_tokens + uncached) / C)
    decode  = steps * d  if the worker is decoding anything, else 0
    slot    = max(active - S + 1, 0) * r / S       # waiting for a place in a full batch
    cost    = overlap_weight * own + queue + decode + slot

  ``slot``: a worker that runs at most ``S`` requests at once (its ``max_num_seqs``; 0 =
  unknown, no term) and has ``active`` requests (running and waiting) starts a new one
  only when enough of them end; with ``r`` the learned seconds a request stays there,
  one place frees every ``r / S`` s on average. Without it a worker whose batch was full
  but whose prefill queue was empty looked free: a request routed there for its cached
  prefix waited seconds for a place while new workers stood idle (the Planner's bursts).

  Every term is in seconds, so nothing needs tuning: a cached prefix is worth exactly
  the prefill time it saves, against the time spent waiting behind other work.
  ``overlap_weight`` (default 1) stays as an override: > 1 favours cache hits more than
  their time is worth (e.g. to keep a prefix on one worker), < 1 favours spreading.

  KV held outside the engine: ``tiers`` gives, per worker, blocks *beyond* its
  on-engine prefix that it can load from a named tier instead of computing them, and
  ``tier_prices`` the seconds to load one block from that tier; such blocks cost their
  price instead of ``block_size * p`` in ``own``. The Router passes a worker's host KV
  pool as tier ``pool`` (``RouterState.decide``, priced by its ``pool-block-seconds``).
  Tenants' salted prefixes need no tier: their hashes carry the salt, so they match
  only the same tenant's blocks (``RouterState`` looks a caller up under its salt).

``kv`` with the ``blocks`` cost model: Dynamo's block count, lowest wins::

    prefill_blocks = request_blocks - overlap        # blocks this worker must compute
    decode_blocks  = active_blocks + request_blocks  # blocks it holds while decoding
    cost = overlap_weight * prefill_blocks + decode_blocks

``kv-load``
    The cache is ignored: the ``time`` cost with no cached tokens, or, with ``blocks``,
    ``active_blocks + request_blocks``.
``round-robin``
    Live workers in ascending id order, one after the other (``RoundRobin``).
``random``
    Uniform over live workers, drawn from the injected ``rng``.

In ``kv`` and ``kv-load`` with ``temperature == 0`` the lowest cost wins and ties are
broken uniformly at random by ``rng``. With ``temperature > 0`` the worker is sampled
with probability proportional to ``exp(-norm_cost / temperature)``, where
``norm_cost`` maps the candidates' costs linearly onto [0, 1] (Dynamo's softmax).

Candidates are exactly the workers in ``loads`` (the live ones); overlaps of workers
not in ``loads`` are ignored. Sorting candidates by id makes every result a function
of the inputs and the RNG's state.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from dynagraph.errors import ConfigError, NoInstancesError
from dynagraph.llm.router.rates import RatePriors, WorkerRates
from dynagraph.runtime.round_robin import RoundRobin


class RouterMode(StrEnum):
    KV = "kv"
    KV_LOAD = "kv-load"
    ROUND_ROBIN = "round-robin"
    RANDOM = "random"


class CostModel(StrEnum):
    TIME = "time"
    BLOCKS = "blocks"


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load: as reported by its metrics and forecast by the Router."""

    active_blocks: int = 0  # KV blocks referenced by running requests (``blocks`` model)
    waiting_requests: int = 0  # informational
    queued_tokens: float = 0.0  # prompt tokens it computes before a new request's (``time``)
    decoding: int = 0  # sequences decoding: each prefill step also runs them (``time``)
    active: int = 0  # requests running or waiting there (``time``)
    slots: int = 0  # requests it runs at once (``max_num_seqs``); 0 = unknown (``time``)


@dataclass(frozen=True)
class Decision:
    worker_id: int
    overlap_blocks: int  # the chosen worker's cached prefix, in blocks
    costs: dict[int, float] = field(default_factory=dict)  # per candidate; kv modes only
    ttft_s: dict[int, float] = field(default_factory=dict)
    """Predicted seconds to the first token per candidate (``time`` model only)."""

    @property
    def cost(self) -> float | None:
        return self.costs.get(self.worker_id)


_PRIORS = RatePriors()
DEFAULT_RATES = WorkerRates(_PRIORS.prefill_s_per_token, _PRIORS.decode_step_s,
                            _PRIORS.chunk_tokens)
"""Speeds of a worker nothing is known about."""


def predicted_ttft(load: WorkerLoad, rates: WorkerRates, *, uncached_tokens: int,
                   tier_seconds: float = 0.0, overlap_weight: float = 1.0) -> tuple[float, float]:
    """(cost, predicted seconds to first token) of one worker under the ``time`` model.

    ``uncached_tokens`` are the prompt tokens the worker must compute; ``tier_seconds``
    the time to load the blocks it takes from other tiers instead.
    """
    p = rates.prefill_s_per_token
    own = uncached_tokens * p + tier_seconds
    queue = load.queued_tokens * p
    work = load.queued_tokens + uncached_tokens
    steps = math.ceil(work / rates.chunk_tokens) if rates.chunk_tokens > 0 else 1
    decode = max(steps, 1) * rates.decode_step_s if load.decoding > 0 else 0.0
    ahead = load.active - load.slots + 1
    slot = ahead * rates.request_s / load.slots if load.slots > 0 and ahead > 0 else 0.0
    wait = queue + decode + slot
    return overlap_weight * own + wait, own + wait


def _argmin(costs: dict[int, float], rng: random.Random) -> int:
    best = min(costs.values())
    ties = [w for w, c in costs.items() if c == best]
    return ties[0] if len(ties) == 1 else rng.choice(ties)


def _softmax_sample(costs: dict[int, float], temperature: float, rng: random.Random) -> int:
    lo, hi = min(costs.values()), max(costs.values())
    span = hi - lo
    ids = list(costs)
    if span == 0:
        return rng.choice(ids)
    weights = [math.exp(-((costs[w] - lo) / span) / temperature) for w in ids]
    return rng.choices(ids, weights=weights, k=1)[0]


def _tier_cost(blocks_by_tier: Mapping[str, int], prices: Mapping[str, float],
               max_blocks: int) -> tuple[int, float]:
    """(blocks taken from tiers, seconds to load them), at most ``max_blocks``, cheapest
    tier first; tiers without a price are ignored."""
    taken, seconds = 0, 0.0
    for tier in sorted(blocks_by_tier, key=lambda t: (prices.get(t, math.inf), t)):
        price = prices.get(tier)
        if price is None or taken >= max_blocks:
            continue
        n = min(max(blocks_by_tier[tier], 0), max_blocks - taken)
        taken += n
        seconds += n * price
    return taken, seconds


def choose_worker(
    mode: RouterMode | str,
    overlaps: Mapping[int, int],
    loads: Mapping[int, WorkerLoad],
    request_blocks: int,
    rng: random.Random,
    *,
    overlap_weight: float = 1.0,
    temperature: float = 0.0,
    rr_state: RoundRobin | None = None,
    cost_model: CostModel | str = CostModel.TIME,
    prompt_tokens: int | None = None,
    block_size: int = 1,
    rates: Mapping[int, WorkerRates] | None = None,
    tiers: Mapping[int, Mapping[str, int]] | None = None,
    tier_prices: Mapping[str, float] | None = None,
) -> Decision:
    """Pick the worker for one request. See the module docstring for each mode.

    ``overlaps`` comes from ``PrefixIndex.find_matches`` (absent = 0), ``loads`` has one
    entry per live worker, ``request_blocks`` is the prompt's number of full blocks of
    ``block_size`` tokens and ``prompt_tokens`` its length (default: the full blocks).
    ``rates`` gives each worker's speeds (absent: ``DEFAULT_RATES``); ``tiers`` and
    ``tier_prices`` price blocks held outside the engine (``time`` model only).
    Side effects: draws from ``rng``; advances ``rr_state`` in round-robin mode.
    Raises ``NoInstancesError`` when ``loads`` is empty.
    """
    try:
        mode = RouterMode(mode)
        cost_model = CostModel(cost_model)
    except ValueError:
        raise ConfigError(
            f"unknown router mode {mode!r} or cost model {cost_model!r}; use one of "
            f"{[m.value for m in RouterMode]} and {[c.value for c in CostModel]}",
            key="router-mode",
        ) from None
    if temperature < 0:
        raise ConfigError(f"temperature must be >= 0, got {temperature}", key="temperature")
    if not loads:
        raise NoInstancesError("no live worker to route to")
    candidates = sorted(loads)

    def overlap(w: int) -> int:
        return min(overlaps.get(w, 0), request_blocks)

    if mode is RouterMode.ROUND_ROBIN:
        if rr_state is None:
            raise ConfigError("round-robin mode needs an rr_state", key="router-mode")
        chosen = rr_state.pick(candidates)
        return Decision(chosen, overlap(chosen))
    if mode is RouterMode.RANDOM:
        chosen = rng.choice(candidates)
        return Decision(chosen, overlap(chosen))

    costs: dict[int, float] = {}
    ttft: dict[int, float] = {}
    use_cache = mode is RouterMode.KV
    if cost_model is CostModel.TIME:
        tokens = request_blocks * block_size if prompt_tokens is None else prompt_tokens
        rates = rates or {}
        # priced once per distinct (load, speeds, cached prefix): the loads and speeds of
        # a fleet's quiet workers are shared objects (RouterState, fleet_rates), so 256
        # mostly idle workers cost a handful of predictions, not 256
        priced: dict[tuple[int, int, int], tuple[float, float]] = {}
        weight = overlap_weight if use_cache else 1.0
        for w in candidates:
            cached = min(overlaps.get(w, 0), request_blocks) if use_cache else 0
            load, speeds = loads[w], rates.get(w, DEFAULT_RATES)
            if use_cache and tiers and tier_prices and w in tiers:
                tier_blocks, tier_s = _tier_cost(tiers[w], tier_prices, request_blocks - cached)
                uncached = max(tokens - (cached + tier_blocks) * block_size, 1)
                costs[w], ttft[w] = predicted_ttft(load, speeds, uncached_tokens=uncached,
                                                   tier_seconds=tier_s, overlap_weight=weight)
                continue
            key = (id(load), id(speeds), cached)
            got = priced.get(key)
            if got is None:
                got = priced[key] = predicted_ttft(
                    load, speeds, uncached_tokens=max(tokens - cached * block_size, 1),
                    overlap_weight=weight)
            costs[w], ttft[w] = got
    else:
        for w in candidates:
            decode_blocks = loads[w].active_blocks + request_blocks
            if use_cache:
                costs[w] = overlap_weight * (request_blocks - overlap(w)) + decode_blocks
            else:
                costs[w] = float(decode_blocks)
    if temperature == 0:
        chosen = _argmin(costs, rng)
    else:
        chosen = _softmax_sample(costs, temperature, rng)
    return Decision(chosen, overlap(chosen), costs, ttft)
