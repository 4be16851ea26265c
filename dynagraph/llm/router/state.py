"""What the Router knows about its workers, and the messages of its endpoint. No I/O.

``RouterState`` gathers ``choose_worker``'s inputs: the prefix index (fed by each
worker's KV events), the workers' reported load, and the requests in flight that the
Router itself routed (``begin``/``end``), whose blocks count as a *predicted* prefix and
as load before the worker's own events and metrics catch up. The Router component only
feeds it and calls ``decide``.
"""

from __future__ import annotations

import random

import msgspec

from dynagraph.llm.engines.base import EngineLoad
from dynagraph.llm.router.cost import Decision, RouterMode, WorkerLoad, choose_worker
from dynagraph.llm.router.events import RelayBatch
from dynagraph.llm.router.index import PrefixIndex
from dynagraph.runtime.round_robin import RoundRobin


class RouteRequest(msgspec.Struct):
    """Processor -> Router: which worker for these prompt tokens?

    ``track``: keep the stream open until the caller closes it and count the request as
    in flight on the chosen worker meanwhile. ``mode``: the caller's default; a mode set
    live in etcd wins, then this, then the Router's config.
    """

    token_ids: list[int]
    track: bool = False
    mode: RouterMode | None = None


class RouteDecision(msgspec.Struct):
    """Router -> Processor: the chosen worker (the stream's first and only item)."""

    worker_id: int
    overlap_blocks: int
    request_blocks: int
    mode: RouterMode


class RouterState:
    """Everything a decision depends on, kept up to date by the component.

    ``live`` workers are the candidates; ``healthy`` ones (load stream up) are
    preferred. ``inflight[w]`` counts the block hashes of tracked requests on ``w``.
    """

    def __init__(self, rng: random.Random | None = None) -> None:
        self.index = PrefixIndex()
        self.rng = rng or random.Random()
        self.rr = RoundRobin()
        self.reported: dict[int, EngineLoad] = {}
        self.inflight: dict[int, dict[int, int]] = {}
        self.live: set[int] = set()
        self.healthy: set[int] = set()

    def add_worker(self, w: int) -> None:
        self.live.add(w)
        self.index.add_worker(w)
        self.inflight.setdefault(w, {})

    def remove_worker(self, w: int) -> None:
        self.live.discard(w)
        self.healthy.discard(w)
        self.index.remove_worker(w)
        self.reported.pop(w, None)
        self.inflight.pop(w, None)

    def set_load(self, w: int, load: EngineLoad | None) -> None:
        """A fresh load sample (``None``: the worker's load stream is down)."""
        if w not in self.live:
            return
        if load is None:
            self.healthy.discard(w)
        else:
            self.reported[w] = load
            self.healthy.add(w)

    def apply(self, w: int, batch: RelayBatch) -> None:
        if w in self.live:
            batch.apply_to(self.index, w)

    def begin(self, w: int, hashes: list[int]) -> None:
        counts = self.inflight.get(w)
        if counts is not None:
            for h in hashes:
                counts[h] = counts.get(h, 0) + 1

    def end(self, w: int, hashes: list[int]) -> None:
        counts = self.inflight.get(w)
        if counts is not None:
            for h in hashes:
                n = counts.get(h, 0)
                if n <= 1:
                    counts.pop(h, None)
                else:
                    counts[h] = n - 1

    def inputs(self, hashes: list[int]) -> tuple[dict[int, int], dict[int, WorkerLoad]]:
        """``choose_worker``'s overlaps and loads for a request with these block hashes.

        Overlap: the longer of the indexed prefix and the in-flight (predicted) one.
        Load: active blocks (the larger of the reported and the in-flight count) minus
        the request's blocks already active there, so ``active + request_blocks`` is
        the worker's block count *after* taking the request (shared blocks once).
        """
        overlaps = self.index.find_matches(hashes)
        candidates = (self.healthy & self.live) or self.live
        loads: dict[int, WorkerLoad] = {}
        for w in candidates:
            counts = self.inflight.get(w, {})
            predicted = 0
            for h in hashes:
                if h not in counts:
                    break
                predicted += 1
            if predicted > overlaps.get(w, 0):
                overlaps[w] = predicted
            shared = sum(1 for h in hashes if h in counts)
            rep = self.reported.get(w, EngineLoad())
            active = max(rep.kv_blocks_used, len(counts))
            loads[w] = WorkerLoad(active_blocks=max(active - shared, 0),
                                  waiting_requests=rep.waiting)
        return overlaps, loads

    def decide(self, mode: RouterMode, hashes: list[int], *, overlap_weight: float = 1.0,
               temperature: float = 0.0) -> Decision:
        overlaps, loads = self.inputs(hashes)
        return choose_worker(mode, overlaps, loads, len(hashes), self.rng,
                             overlap_weight=overlap_weight, temperature=temperature,
                             rr_state=self.rr)
