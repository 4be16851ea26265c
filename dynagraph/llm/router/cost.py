"""The router's choice: a pure function of overlaps, loads, request length and an RNG.

Modes (``RouterMode``):

``kv``
    Dynamo's cost, lowest wins::

        prefill_blocks = request_blocks - overlap        # blocks this worker must compute
        decode_blocks  = active_blocks + request_blocks  # blocks it holds while decoding
        cost = overlap_weight * prefill_blocks + decode_blocks

    ``overlap_weight`` > 1 favours cache hits (TTFT), < 1 favours balance (ITL).
``kv-load``
    Load only: ``cost = active_blocks + request_blocks``; the cache is ignored.
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
from dynagraph.runtime.round_robin import RoundRobin


class RouterMode(StrEnum):
    KV = "kv"
    KV_LOAD = "kv-load"
    ROUND_ROBIN = "round-robin"
    RANDOM = "random"


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load as last reported by its metrics."""

    active_blocks: int = 0  # KV blocks referenced by running requests
    waiting_requests: int = 0  # informational; not part of the cost yet


@dataclass(frozen=True)
class Decision:
    worker_id: int
    overlap_blocks: int  # the chosen worker's cached prefix, in blocks
    costs: dict[int, float] = field(default_factory=dict)  # per candidate; kv modes only

    @property
    def cost(self) -> float | None:
        return self.costs.get(self.worker_id)


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
) -> Decision:
    """Pick the worker for one request. See the module docstring for each mode.

    ``overlaps`` comes from ``PrefixIndex.find_matches`` (absent = 0), ``loads`` has one
    entry per live worker, ``request_blocks`` is the prompt's number of full blocks.
    Side effects: draws from ``rng``; advances ``rr_state`` in round-robin mode.
    Raises ``NoInstancesError`` when ``loads`` is empty.
    """
    try:
        mode = RouterMode(mode)
    except ValueError:
        raise ConfigError(
            f"unknown router mode {mode!r}; use one of {[m.value for m in RouterMode]}",
            key="router-mode",
        ) from None
    if temperature < 0:
        raise ConfigError(f"temperature must be >= 0, got {temperature}", key="temperature")
    if not loads:
        raise NoInstancesError("no live worker to route to")
    candidates = sorted(loads)

    if mode is RouterMode.ROUND_ROBIN:
        if rr_state is None:
            raise ConfigError("round-robin mode needs an rr_state", key="router-mode")
        chosen = rr_state.pick(candidates)
        return Decision(chosen, min(overlaps.get(chosen, 0), request_blocks))
    if mode is RouterMode.RANDOM:
        chosen = rng.choice(candidates)
        return Decision(chosen, min(overlaps.get(chosen, 0), request_blocks))

    costs: dict[int, float] = {}
    for w in candidates:
        decode_blocks = loads[w].active_blocks + request_blocks
        if mode is RouterMode.KV:
            prefill_blocks = request_blocks - min(overlaps.get(w, 0), request_blocks)
            costs[w] = overlap_weight * prefill_blocks + decode_blocks
        else:
            costs[w] = float(decode_blocks)
    if temperature == 0:
        chosen = _argmin(costs, rng)
    else:
        chosen = _softmax_sample(costs, temperature, rng)
    return Decision(chosen, min(overlaps.get(chosen, 0), request_blocks), costs)
