"""Picking a worker as the served Processor and Router do, on simulated time.

``kv`` / ``kv-load``: the Router's own state and decision code. ``RouterState`` is fed
what the served Router's streams bring it (``components/kv_router.py``): each worker's
KV changes (``_on_kv``: ``state.apply``) and load reports (``_on_load``:
``state.set_load``), with simulated seconds as its clock; each request is decided
(``Router.route``: ``state.decide`` with the config's mode-independent keys) and, as the
Processor asks with ``track=True``, counted in flight from its decision (``state.begin``
with its uncached prompt tokens) to its end (``state.end``). The prompt's block hashes are
the engines' (same block size, algorithm and seed), as the Router's hasher computes them.

``round-robin`` / ``random``: the Processor's own pick among the live workers (its
``RoundRobin``, its shuffled order), without the Router.

Not simulated: the Router's rebalancing (``rebalance-wait``: it acts only when a worker's
batch is full), SLO classes (every trace request is of the default class), replicas.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

from dynagraph.llm.engines.base import EngineLoad
from dynagraph.llm.router import RelayBatch, RouterMode, RouterState
from dynagraph.llm.router.config import RouterConfig
from dynagraph.llm.router.pressure import class_overlap_weight
from dynagraph.runtime.round_robin import RoundRobin

KV_MODES = ("kv", "kv-load")


class Routing:
    """The routing policy of the simulated graph for one ``mode``.

    ``router`` is the Router's config (None: no Router; only round-robin and random);
    ``seed`` seeds the Router's tie-breaking (when its config sets no ``seed``) and the
    Processor's ``random`` order. Worker ids are small ints.
    """

    def __init__(self, mode: str, workers: Sequence[int], router: RouterConfig | None, *,
                 block_size: int, seed: int) -> None:
        if mode in KV_MODES and router is None:
            raise ValueError(f"mode {mode} needs a Router config")
        self.mode = mode
        self.workers = list(workers)
        self.block_size = block_size
        self.config = router
        self.uses_router = mode in KV_MODES
        rng_seed = router.seed if router is not None and router.seed is not None else seed
        self.state = RouterState(random.Random(rng_seed))
        self._rr = RoundRobin()
        self._rng = random.Random(seed)
        self._keys = itertools.count()
        self._weight = (class_overlap_weight(router.overlap_weight, None,
                                             router.class_overlap_weights)
                        if router is not None else 1.0)
        for w in self.workers:
            self.state.add_worker(w)
            self.state.apply(w, RelayBatch(seq=0, snapshot=True))

    # -- what the Router's streams bring --------------------------------------------------

    def on_kv(self, w: int, batch: RelayBatch) -> None:
        self.state.apply(w, batch)

    def on_load(self, w: int, load: EngineLoad, now: float) -> None:
        self.state.set_load(w, load, now)

    def settle(self) -> None:
        """The first reports of every worker are in: price the workers by them now. (A
        served Router has them well before traffic comes; the Router recomputes the
        fleet's speeds at most every ``RATES_REFRESH_S``, so without this the first
        requests of a simulation would see only the first worker's report.)"""
        self.state.all_rates()

    # -- one request ----------------------------------------------------------------------

    def choose(self, hashes: list[int], prompt_tokens: int, now: float
               ) -> tuple[int, int | None]:
        """(worker, key of the in-flight entry to :meth:`end`, None when not tracked)."""
        if not self.uses_router:
            if self.mode == "random":
                order = list(self.workers)
                self._rng.shuffle(order)
                return order[0], None
            return self._rr.pick(self.workers), None
        cfg = self.config
        assert cfg is not None
        decision = self.state.decide(
            RouterMode(self.mode), hashes, overlap_weight=self._weight,
            temperature=cfg.temperature, cost_model=cfg.cost_model,
            prompt_tokens=prompt_tokens, block_size=self.block_size, now=now,
            pool_block_seconds=cfg.pool_block_seconds,
            tier_block_seconds=cfg.tier_block_seconds)
        w = decision.worker_id
        key = next(self._keys)
        uncached = max(prompt_tokens - decision.overlap_blocks * self.block_size, 1)
        self.state.begin(w, hashes, key=key, uncached_tokens=uncached, now=now)
        return w, key

    def end(self, w: int, hashes: list[int], key: int | None, now: float) -> None:
        """The request's stream closed (done): the Router stops counting it."""
        if key is not None:
            self.state.end(w, hashes, key, now=now)
