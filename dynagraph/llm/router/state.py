"""What the Router knows about its workers, and the messages of its endpoint. No I/O.

``RouterState`` gathers ``choose_worker``'s inputs: the prefix index (fed by each
worker's KV events), the workers' reported load, each worker's learned speeds
(``RateLearner``, fed by the same reports), and the requests in flight that the Router
itself routed (``begin``/``end``): their blocks count as a *predicted* prefix and as
load before the worker's own events and metrics catch up, and their prompt tokens as a
forecast prefill queue (``WorkerQueue``). The component only feeds it and calls
``decide``; times are passed in (``now``, seconds on one monotonic clock).
"""

from __future__ import annotations

import random
from collections.abc import Collection

import msgspec

from dynagraph.llm.engines.base import EngineLoad
from dynagraph.llm.router.cost import CostModel, Decision, RouterMode, WorkerLoad, choose_worker
from dynagraph.llm.router.events import RelayBatch
from dynagraph.llm.router.index import PrefixIndex
from dynagraph.llm.router.pending import WorkerQueue
from dynagraph.llm.router.rates import RateLearner, RatePriors, WorkerRates, fleet_rates
from dynagraph.llm.router.rebalance import QueueView
from dynagraph.llm.tenants.identity import TenantToken
from dynagraph.llm.tenants.slo_admission import Gate, Pressure, Verdict
from dynagraph.runtime.round_robin import RoundRobin

POOL_TIER = "pool"
SHARED_TIER = "shared"
"""The tier under the pools that workers of a host share (``kv-offload-dir``)."""
NO_LOAD = EngineLoad()
"""The load of a worker that has not reported (shared: read only)."""
_UNKNOWN = WorkerLoad()
_MAX_SHARED_LOADS = 4096
RATES_REFRESH_S = 0.5
"""Learned speeds are recomputed at most this often while time is passed in. They move
slowly (half-lives of thousands of tokens), and recomputing the fleet's medians and every
worker's speeds for each decision and each load sample cost O(workers) each time: at 256
workers, 4.3 ms of a 2-core machine per decision and 0.8 ms per sample."""


class RouteRequest(msgspec.Struct, omit_defaults=True):
    """Processor -> Router: which worker for these prompt tokens?

    ``track``: keep the stream open until the caller closes it and count the request as
    in flight on the chosen worker meanwhile. ``mode``: the caller's default; a mode set
    live in etcd wins, then this, then the Router's config.
    """

    token_ids: list[int]
    track: bool = False
    mode: RouterMode | None = None
    workers: list[int] | None = None
    """Choose among these workers only (those serving the request's model); None: any."""
    tenant: TenantToken | None = None
    """The caller (signed): its prefix is looked up under its cache salt."""
    slo_class: str | None = None
    """The request's SLO class: scales the cost's overlap weight (``class-overlap-weights``)."""
    admission: Gate | None = None
    """A deferrable request's SLO-aware admission: the Router judges the candidates'
    pressure and counts the request (``track``) only if the verdict is admit."""


class RouteDecision(msgspec.Struct, omit_defaults=True):
    """Router -> Processor: the chosen worker (the stream's first and only item)."""

    worker_id: int
    overlap_blocks: int
    request_blocks: int
    mode: RouterMode
    pressure: Pressure | None = None
    """The candidates' load before this request (for SLO-aware admission)."""
    verdict: Verdict | None = None
    """The admission verdict, where the request came with a ``Gate``; when it is not
    admit the request is not counted and the stream ends after this decision."""


class RouterState:
    """Everything a decision depends on, kept up to date by the component.

    ``live`` workers are the candidates; ``healthy`` ones (load stream up) are
    preferred. ``inflight[w]`` counts the block hashes of tracked requests on ``w``;
    ``queues[w]`` forecasts their prefill; ``learners[w]`` learns ``w``'s speeds.
    """

    def __init__(self, rng: random.Random | None = None,
                 priors: RatePriors | None = None) -> None:
        self.index = PrefixIndex()
        self.pooled = PrefixIndex()
        """Blocks in each worker's host KV pool: loadable, not computed, not on-engine."""
        self._pooling = False  # any worker ever reported a pooled block
        self.tiered = PrefixIndex()
        """Blocks each worker wrote to its shared tier; every worker of that tier
        (``tier_of``) can load them."""
        self.tier_of: dict[int, str] = {}
        """Worker -> the shared tier it names (published as ``kv_tier``)."""
        self.rng = rng or random.Random()
        self.rr = RoundRobin()
        self.priors = priors or RatePriors()
        self.reported: dict[int, EngineLoad] = {}
        self.inflight: dict[int, dict[int, int]] = {}
        self.queues: dict[int, WorkerQueue] = {}
        self.learners: dict[int, RateLearner] = {}
        self.live: set[int] = set()
        self.healthy: set[int] = set()
        self._quiet: dict[int, tuple[EngineLoad, WorkerLoad]] = {}
        """Per worker: its load when none of this Router's requests is there, for the
        report it was made from (``inputs``: most of a large fleet, most of the time)."""
        self._loads: dict[WorkerLoad, WorkerLoad] = {}  # equal loads: one shared object
        self._rates: dict[int, WorkerRates] | None = None  # None: recompute
        self._rates_at = 0.0
        self._rates_stale = False  # a learner has learned since

    def add_worker(self, w: int) -> None:
        self.live.add(w)
        self.index.add_worker(w)
        self.pooled.add_worker(w)
        self.inflight.setdefault(w, {})
        self.queues.setdefault(w, WorkerQueue())
        self.learners.setdefault(w, RateLearner(self.priors))
        self._rates = None

    def set_tier(self, w: int, tier: str | None) -> None:
        """``w`` loads blocks from the shared tier ``tier`` (None: it has none)."""
        if tier:
            self.tier_of[w] = tier
        else:
            self.tier_of.pop(w, None)

    def remove_worker(self, w: int) -> None:
        self.live.discard(w)
        self.healthy.discard(w)
        self.index.remove_worker(w)
        self.pooled.remove_worker(w)
        self.tiered.remove_worker(w)
        self.tier_of.pop(w, None)
        self.reported.pop(w, None)
        self.inflight.pop(w, None)
        self.queues.pop(w, None)
        self.learners.pop(w, None)
        self._quiet.pop(w, None)
        self._rates = None

    def rates(self, w: int, now: float | None = None) -> WorkerRates:
        """``w``'s speeds as the cost uses them (compared with the fleet's)."""
        got = self.all_rates(now).get(w)
        return got if got is not None else RateLearner(self.priors).rates()

    def all_rates(self, now: float | None = None) -> dict[int, WorkerRates]:
        """Every live worker's speeds: as learned by ``now`` give or take
        ``RATES_REFRESH_S`` (``now`` None: exactly as learned so far)."""
        if self._rates is None or self._rates_stale and (
                now is None or now - self._rates_at >= RATES_REFRESH_S):
            self._rates = fleet_rates(self.learners)
            self._rates_stale = False
            if now is not None:
                self._rates_at = now
        return self._rates

    def set_load(self, w: int, load: EngineLoad | None, now: float | None = None) -> None:
        """A fresh load sample (``None``: the worker's load stream is down), received at
        ``now``: it teaches ``w``'s speeds and corrects the forecast of its queue."""
        if w not in self.live:
            return
        if load is None:
            self.healthy.discard(w)
            return
        self.reported[w] = load
        self.healthy.add(w)
        self.learners[w].observe(load)
        self._rates_stale = True
        queue = self.queues[w]
        if now is not None:
            queue.advance(now, self.rates(w, now).prefill_s_per_token)
        queue.reconcile(load.requests_total, load.prefilling)

    def apply(self, w: int, batch: RelayBatch) -> None:
        if w in self.live:
            batch.apply_to(self.index, w, self.pooled, self.tiered)
            self._pooling = self._pooling or bool(batch.pooled_stored or batch.tiered_stored)
            if batch.tiered_removed:
                self._untier(w, batch.tiered_removed)

    def _untier(self, w: int, hashes: list[int]) -> None:
        """Blocks gone from ``w``'s shared tier are gone for every worker of that tier
        (a trimmer deletes the files whoever wrote them)."""
        tier = self.tier_of.get(w)
        if tier is None:
            return
        for other, t in self.tier_of.items():
            if t == tier and other != w:
                self.tiered.apply_removed(other, hashes)

    def pooled_beyond(self, hashes: list[int], overlaps: dict[int, int]) -> dict[int, int]:
        """Per worker: the blocks of this prompt it can load from its host KV pool past
        its on-engine prefix (its pool's leading run minus ``overlaps``), where > 0."""
        if not self._pooling:
            return {}
        found = self.pooled.find_matches(hashes)
        return {w: n - overlaps.get(w, 0) for w, n in found.items() if n > overlaps.get(w, 0)}

    def offloaded(self, hashes: list[int], overlaps: dict[int, int]
                  ) -> dict[int, dict[str, int]]:
        """Per worker: the blocks of this prompt past its on-engine prefix that it can
        load from its pool (``pool``), and past that from its shared tier (``shared``:
        the longest run any worker of that tier wrote there)."""
        pooled = self.pooled_beyond(hashes, overlaps)
        out: dict[int, dict[str, int]] = {w: {POOL_TIER: n} for w, n in pooled.items()}
        if not self._pooling or not self.tier_of:
            return out
        runs: dict[str, int] = {}
        for writer, n in self.tiered.find_matches(hashes).items():
            tier = self.tier_of.get(writer)
            if tier is not None and n > runs.get(tier, 0):
                runs[tier] = n
        for w, tier in self.tier_of.items():
            past = runs.get(tier, 0) - overlaps.get(w, 0) - pooled.get(w, 0)
            if past > 0 and w in self.live:
                out.setdefault(w, {})[SHARED_TIER] = past
        return out

    def begin(self, w: int, hashes: list[int], *, key: int | None = None,
              uncached_tokens: float = 0.0, now: float = 0.0) -> None:
        """A tracked request went to ``w``; with a ``key``, its ``uncached_tokens`` join
        ``w``'s forecast prefill queue at ``now``."""
        counts = self.inflight.get(w)
        if counts is not None:
            for h in hashes:
                counts[h] = counts.get(h, 0) + 1
        queue = self.queues.get(w)
        if key is not None and queue is not None:
            queue.add(key, uncached_tokens, now)

    def end(self, w: int, hashes: list[int], key: int | None = None,
            now: float | None = None) -> None:
        """A tracked request on ``w`` ended at ``now``: its time there teaches how long
        ``w``'s requests stay (``WorkerRates.request_s``)."""
        counts = self.inflight.get(w)
        if counts is not None:
            for h in hashes:
                n = counts.get(h, 0)
                if n <= 1:
                    counts.pop(h, None)
                else:
                    counts[h] = n - 1
        queue = self.queues.get(w)
        if key is not None and queue is not None:
            began = queue.finish(key)
            learner = self.learners.get(w)
            if began is not None and now is not None and learner is not None:
                learner.request_ended(now - began)
                self._rates_stale = True

    def inputs(self, hashes: list[int], now: float | None = None,
               rates: dict[int, WorkerRates] | None = None, *,
               allowed: Collection[int] | None = None, costed: bool = True,
               blocks: bool = True) -> tuple[dict[int, int], dict[int, WorkerLoad]]:
        """``choose_worker``'s overlaps and loads for a request with these block hashes.

        Overlap: the longer of the indexed prefix and the in-flight (predicted) one.
        Active blocks: the larger of the reported and the in-flight count, minus the
        request's blocks already active there, so ``active + request_blocks`` is the
        worker's block count *after* taking the request (shared blocks once).
        Queued tokens: the forecast (advanced to ``now`` when given). Decoding: the
        larger of the forecast's and the report's (running requests past their first
        token). ``allowed`` limits the candidates (the workers of the request's model).
        ``costed`` False (modes that ignore loads): the indexed overlaps, and every
        candidate with an empty ``WorkerLoad`` (O(1) per worker, nothing forecast).
        ``blocks`` False (the ``time`` cost model, which does not read active blocks): the
        request's blocks already active on a worker are not counted out of its
        ``active_blocks`` (a set intersection per worker with requests of this Router).
        """
        overlaps = self.index.find_matches(hashes)
        live = self.live if allowed is None else self.live & set(allowed)
        candidates = (self.healthy & live) or live
        if allowed is not None:
            overlaps = {w: n for w, n in overlaps.items() if w in live}
        if not costed:
            return overlaps, dict.fromkeys(candidates, _UNKNOWN)
        if rates is None:
            rates = self.all_rates(now)
        loads: dict[int, WorkerLoad] = {}
        wanted: set[int] | None = None
        quiet = self._quiet
        for w in candidates:
            counts = self.inflight.get(w)
            queue = self.queues.get(w)
            rep = self.reported.get(w, NO_LOAD)
            if not counts and (queue is None or queue.idle):
                known = quiet.get(w)
                if known is not None and known[0] is rep:
                    loads[w] = known[1]
                    continue
            shared = 0
            if counts:  # most workers of a large fleet have none of this Router's requests
                predicted = 0
                for h in hashes:
                    if h not in counts:
                        break
                    predicted += 1
                if predicted > overlaps.get(w, 0):
                    overlaps[w] = predicted
                if blocks:
                    if wanted is None:
                        wanted = set(hashes)
                    shared = len(wanted & counts.keys())
            active = max(rep.kv_blocks_used, len(counts) if counts else 0)
            queued, decoding, routed = 0.0, 0, 0
            if queue is not None and not queue.idle:
                if now is not None and w in rates:
                    queue.advance(now, rates[w].prefill_s_per_token)
                queued, decoding, routed = queue.queued_tokens, queue.decoding, queue.size
            reported_decoding = rep.running - max(rep.prefilling - rep.waiting, 0)
            load = WorkerLoad(active_blocks=max(active - shared, 0),
                              waiting_requests=rep.waiting, queued_tokens=queued,
                              decoding=max(decoding, reported_decoding, 0),
                              active=max(rep.running + rep.waiting, routed),
                              slots=rep.max_num_seqs)
            if not counts and (queue is None or queue.idle):
                if len(self._loads) > _MAX_SHARED_LOADS:
                    self._loads.clear()
                load = self._loads.setdefault(load, load)
                quiet[w] = (rep, load)
            loads[w] = load
        return overlaps, loads

    def queue_views(self, now: float | None = None) -> list[QueueView]:
        """The healthy workers' queues as rebalancing sees them (``releases``)."""
        views = []
        for w in sorted(self.healthy & self.live):
            rep = self.reported.get(w, NO_LOAD)
            queue = self.queues.get(w)
            routed = queue.size if queue is not None else 0
            views.append(QueueView(w, active=max(rep.running + rep.waiting, routed),
                                   waiting=rep.waiting, slots=rep.max_num_seqs,
                                   request_s=self.rates(w, now).request_s))
        return views

    def decide(self, mode: RouterMode, hashes: list[int], *, overlap_weight: float = 1.0,
               temperature: float = 0.0, cost_model: CostModel = CostModel.TIME,
               prompt_tokens: int | None = None, block_size: int = 1,
               now: float | None = None, allowed: Collection[int] | None = None,
               pool_block_seconds: float | None = None,
               tier_block_seconds: float | None = None) -> Decision:
        """``pool_block_seconds``: the time to load one block from a worker's host KV
        pool (None: pooled blocks are not priced, as if they had to be computed);
        ``tier_block_seconds`` the same for its shared tier."""
        costed = mode in (RouterMode.KV, RouterMode.KV_LOAD)
        rates = self.all_rates(now) if costed else None
        overlaps, loads = self.inputs(hashes, now, rates, allowed=allowed, costed=costed,
                                      blocks=cost_model == CostModel.BLOCKS)
        tiers: dict[int, dict[str, int]] | None = None
        prices: dict[str, float] | None = None
        if pool_block_seconds is not None or tier_block_seconds is not None:
            tiers = self.offloaded(hashes, overlaps)
            prices = {t: s for t, s in ((POOL_TIER, pool_block_seconds),
                                        (SHARED_TIER, tier_block_seconds)) if s is not None}
        return choose_worker(mode, overlaps, loads, len(hashes), self.rng,
                             overlap_weight=overlap_weight, temperature=temperature,
                             rr_state=self.rr, cost_model=cost_model,
                             prompt_tokens=prompt_tokens, block_size=block_size,
                             rates=rates, tiers=tiers, tier_prices=prices)
