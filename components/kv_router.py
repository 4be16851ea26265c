"""Router: picks the decode worker for each request (KV-aware or not).

Inputs, per live ``VllmWorker`` instance (or instance of the component linked in its
place, e.g. ``MockerWorker``; from discovery; an instance whose lease expires is dropped
from the index and the load table at once):

- its ``kv_events`` stream (a snapshot, then net deltas; see ``dynagraph.llm.kv.events.relay``)
  mirrored into one ``PrefixIndex`` under the worker's instance id;
- its ``load_metrics`` stream (``EngineLoad`` about 10 times a second). A worker
  whose load stream is down (crashed, lease not yet expired) is not chosen while
  another worker is healthy.

``generate(RouteRequest)`` yields one ``RouteDecision``; the Processor then calls that
worker with ``direct()``. With ``track=True`` the stream stays open (yielding nothing
more) until the caller closes it, and the request counts as in flight on the chosen
worker meanwhile (see ``dynagraph.llm.router.state``).

Modes (``RouterMode``: ``kv``, ``kv-load``, ``round-robin``, ``random``): a mode set
live in etcd at ``/{ns}/settings/Router/mode`` (a JSON string) wins; else the
request's ``mode`` (the Processor's ``router-mode``); else ``mode:`` in the config.
``cost-model`` (``time``: predicted time to first token from each worker's learned
speeds, the default; ``blocks``: Dynamo's block count), ``overlap-weight`` and
``temperature`` are live settings too. The choice itself is the pure
``choose_worker``; ``RouterState`` gathers its inputs (each load sample also teaches it
the worker's speeds). Block hashes come from the one ``BlockHasher`` with the block
size, hash algorithm and seed that the workers publish in their discovery metadata.

SLO classes (``RouteRequest.slo_class``): ``class-overlap-weights`` scales the overlap
weight per class (``interactive`` weighs queueing more than a cache hit, ``batch`` less);
a request that comes with an admission ``Gate`` (the Processor's SLO-aware admission) is
judged against the candidates' pressure (``dynagraph.llm.router.pressure``, carried back
in its decision; placed on the least pressured candidate if the cost's choice is over
its thresholds) and counted only if admitted, in the same step, so the check and the
count cannot be raced (``dynagraph.llm.tenants.slo_admission``).

Replicas (``ServiceArgs.workers: N``): each Router replica follows every worker's two
streams itself, so each builds the same index (a snapshot, then deltas); the replicas
share what they route through their ``inflight`` streams (``dynagraph.llm.router.
replicas``): each Router serves its tracked requests there (a snapshot, then begins and
ends as they happen) and follows every other Router's (found in discovery, itself
left out), so what one replica routed, the others count as in flight within one
request-plane hop (``share-inflight``). A Router that starts (or restarts) registers
its endpoints only once every live worker's KV snapshot has reached its index (and every
peer's in-flight snapshot), or after ``sync-timeout`` seconds: until then the Processors
route through the other replicas; the time it took is logged (``index full``).

Rebalancing (``rebalance-wait``): on load reports, at most every ``REBALANCE_EVERY_S``,
workers whose waiting requests would wait for a place longer than ``rebalance-wait``
seconds while places are free elsewhere are asked (their ``release`` endpoint) to hand
the newest of them back; the Processor places them again (``dynagraph.llm.router.
rebalance``). A burst's requests no longer stay queued on the workers that were there
when new ones come up.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import math
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Collection
from typing import Any, ClassVar, TypeVar

from pydantic import Field, field_validator

from components.worker import VllmWorker
from dynagraph.aio import cancel_and_wait
from dynagraph.config import ConfigModel
from dynagraph.errors import DynagraphError
from dynagraph.llm.engines.base import EngineLoad
from dynagraph.llm.protocol import Release, Subscribe
from dynagraph.llm.router import (
    BlockHasher,
    CostModel,
    Decision,
    RelayBatch,
    RouteDecision,
    RouteRequest,
    RouterMode,
    RouterState,
)
from dynagraph.llm.router.metrics import RouterMetrics
from dynagraph.llm.router.pressure import (
    DEFAULT_CLASS_OVERLAP_WEIGHTS,
    PressureView,
    class_overlap_weight,
)
from dynagraph.llm.router.rebalance import releases
from dynagraph.llm.router.replicas import InflightFeed, InflightUpdate, PeerInflight, Tracked
from dynagraph.llm.tenants import Signer, cache_salt_of
from dynagraph.llm.tenants.slo_admission import Action
from dynagraph.runtime.live_settings import LiveSpec
from dynagraph.sdk import (
    Component,
    async_on_shutdown,
    async_on_start,
    depends,
    direct,
    endpoint,
    endpoint_client,
    service,
    spec_of,
)

log = logging.getLogger(__name__)

REBALANCE_EVERY_S = 0.25
"""Rebalancing is judged at most this often (on load reports)."""
REASK_AFTER_S = 1.0
"""A worker asked to hand requests back is not asked again for this long."""
DEFAULT_POOL_BLOCK_SECONDS = 0.0001
"""Seconds to load one 32-token block of the tiny model from the host pool (from
``benchmarks/kv_offload.py``'s result); a larger model's block costs more, but so does
computing it."""

DEFAULT_TIER_BLOCK_SECONDS = 0.0002
"""Seconds to load one such block from the tier under the pools (``kv-offload-dir``): a
file read into the pool, then the pool's load (from ``benchmarks/disagg_served.py
--transports shm``'s result, rounded up: dearer than the pool)."""


class RouterConfig(ConfigModel):
    mode: RouterMode = RouterMode.KV
    cost_model: CostModel = CostModel.TIME
    """``time``: seconds to first token, from speeds learned at run time (no tuning);
    ``blocks``: Dynamo's ``overlap-weight * prefill_blocks + decode_blocks``."""
    overlap_weight: float = Field(default=1.0, ge=0.0)
    """Weight of the request's own prefill against the rest of the cost; 1 (the
    default) prices it at its time under the ``time`` model."""
    temperature: float = Field(default=0.0, ge=0.0)
    block_size: int | None = Field(default=None, ge=1)
    """None: use the block size the workers publish (they must all agree)."""
    seed: int | None = None
    """Seeds the tie-breaking RNG (for reproducible studies)."""
    reconnect_delay: float = Field(default=0.5, gt=0.0)
    track_timeout: float = Field(default=600.0, gt=0.0)
    """Longest a tracked request counts as in flight."""
    pool_block_seconds: float | None = Field(default=DEFAULT_POOL_BLOCK_SECONDS, ge=0.0)
    """Seconds to load one block from a worker's host KV pool (``kv-offload-gib``), the
    price of a pooled block in the ``time`` cost (cheaper than computing it, dearer than
    one already on the engine); null: pooled blocks count as uncached."""
    tier_block_seconds: float | None = Field(default=DEFAULT_TIER_BLOCK_SECONDS, ge=0.0)
    """The same for a block in the tier under the pools that the workers of a host share
    (``kv-offload-dir``): any worker naming that tier can load what another wrote there.
    null: such blocks count as uncached."""
    class_overlap_weights: dict[str, float] = Field(
        default_factory=lambda: dict(DEFAULT_CLASS_OVERLAP_WEIGHTS))
    """SLO class -> factor on ``overlap-weight`` for its requests (unlisted: 1)."""
    rebalance_wait: float | None = Field(default=1.0, gt=0.0)
    """Seconds a request may be expected to wait for a place in its worker's batch while
    places are free on others; those that would wait longer are handed back and placed
    again (``dynagraph.llm.router.rebalance``). null: never."""
    share_inflight: bool = True
    """Follow the other Router replicas' ``inflight`` streams and count what they routed
    (``dynagraph.llm.router.replicas``); false: each replica counts only its own."""
    sync_timeout: float = Field(default=3.0, ge=0.0)
    """At start, longest wait for every live worker's KV snapshot (and every peer's
    in-flight snapshot) before the Router takes requests."""

    @field_validator("class_overlap_weights")
    @classmethod
    def _non_negative(cls, v: dict[str, float]) -> dict[str, float]:
        if any(f < 0 for f in v.values()):
            raise ValueError("class overlap weights must be >= 0")
        return v


LIVE = LiveSpec(RouterConfig, ("mode", "cost-model", "overlap-weight", "temperature"))
"""Router settings that can change at run time (``/{ns}/settings/Router/<name>``)."""


T = TypeVar("T")


def _label(worker_id: int) -> str:
    return f"{worker_id:x}"


@service(dynamo={"namespace": "dynamo"}, resources={"cpu": 1}, workers=1)
class Router(Component):
    LIVE_SETTINGS: ClassVar[LiveSpec[RouterConfig]] = LIVE
    worker = depends(VllmWorker)

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.state = RouterState(random.Random(config.seed))
        self.pressure = PressureView()
        self.settings = self.LIVE_SETTINGS.bind(config, self.runtime.settings_prefix())
        self.metrics = RouterMetrics(self.runtime.registry)
        self.signer = Signer.from_env()
        self.hasher: BlockHasher | None = (
            BlockHasher(config.block_size) if config.block_size is not None else None)
        self._tasks: dict[int, list[asyncio.Task[None]]] = {}
        self._keys = itertools.count()
        self._watch: Any = None
        self._settings_task: asyncio.Task[None] | None = None
        self._rebalanced_at = -math.inf
        self._asked: dict[int, float] = {}  # worker -> when it was last asked to hand back
        self._releases: set[asyncio.Task[None]] = set()
        self.feed = InflightFeed()
        self.peers = PeerInflight(self.state, self.pressure)
        self._peer_tasks: dict[int, asyncio.Task[None]] = {}
        self._peer_watch: Any = None
        self._peer_client: Any = None
        self._synced: set[int] = set()  # workers whose KV snapshot reached the index
        self._synced_peers: set[int] = set()  # peers whose first update was applied
        self._sync_event = asyncio.Event()
        self._sync_armed = False  # set once start() has seen every worker and peer
        self.synced_in_s: float | None = None
        """Seconds from ``start`` until the index was full (None: not yet, or timed out)."""

    def mode_for(self, requested: RouterMode | None) -> RouterMode:
        """A live etcd mode wins, then the request's, then the config's."""
        if self.settings.is_set("mode") or requested is None:
            return self.settings.current.mode
        return requested

    # --- workers ------------------------------------------------------------------

    def _on_instances(self, instances: list[Any]) -> None:
        live = {i.instance_id: i for i in instances}
        for w in list(self._tasks):
            if w not in live:
                log.info("worker %x gone (lease expired or closed): dropped from the index", w)
                for t in self._tasks.pop(w):
                    t.cancel()
                self.state.remove_worker(w)
                # its in-flight count stays: a lease that lapsed under load comes back with
                # the same id at once, and its requests still run (each ends when its
                # caller closes the route stream, migrated or done); forgetting them let
                # admission fill the worker again
                self.metrics.forget_worker(_label(w))
                self._synced.discard(w)
        for w, info in live.items():
            if w in self._tasks:
                continue
            self._check_hashing(w, info.metadata)
            self.state.add_worker(w)
            tier = info.metadata.get("kv_tier")
            self.state.set_tier(w, tier if isinstance(tier, str) else None)
            self._tasks[w] = [
                asyncio.create_task(self._follow(w, self.worker.kv_events, self._on_kv),
                                    name=f"kv-{w:x}"),
                asyncio.create_task(self._follow(w, self.worker.load_metrics, self._on_load),
                                    name=f"load-{w:x}"),
            ]
            log.info("worker %x joined", w)
        self._check_synced()

    def _check_hashing(self, w: int, meta: dict[str, Any]) -> None:
        size = meta.get("block_size")
        if not isinstance(size, int):
            return
        algo = meta.get("kv_hash_algo", "sha256")
        seed = meta.get("kv_hash_seed")
        if self.hasher is None:
            kw = {"seed": seed} if isinstance(seed, str) else {}
            self.hasher = BlockHasher(size, algo, **kw)
            log.info("hashing blocks of %d tokens (%s) as worker %x does", size, algo, w)
        elif (size, algo) != (self.hasher.block_size, self.hasher.algo) or (
                isinstance(seed, str) and seed != self.hasher.seed):
            log.error("worker %x hashes blocks differently (block size %s, %s) from the "
                      "Router (%d, %s): its cache hits will not be seen",
                      w, size, algo, self.hasher.block_size, self.hasher.algo)

    def _on_kv(self, w: int, batch: RelayBatch) -> None:
        self.state.apply(w, batch)
        if w not in self._synced:
            self._worker_synced(w)
        self.metrics.kv_event_batch(_label(w))
        self.metrics.index_blocks(_label(w), self.state.index.num_blocks(w),
                                  self.state.pooled.num_blocks(w),
                                  self.state.tiered.num_blocks(w))

    def _on_load(self, w: int, load: EngineLoad) -> None:
        now = time.monotonic()
        self.state.set_load(w, load, now)
        self.metrics.prefill_tokens_per_second(
            _label(w), 1.0 / self.state.rates(w, now).prefill_s_per_token)
        self._rebalance(now)

    def _rebalance(self, now: float) -> None:
        """At most every ``REBALANCE_EVERY_S``: have workers hand back the requests that
        would wait for a place longer than ``rebalance-wait`` while places are free
        elsewhere. A worker asked is not asked again for ``REASK_AFTER_S`` (its reports
        must first show what it handed back)."""
        wait = self.config.rebalance_wait
        if wait is None or now - self._rebalanced_at < REBALANCE_EVERY_S:
            return
        self._rebalanced_at = now
        views = [v if now - self._asked.get(v.worker_id, -math.inf) >= REASK_AFTER_S
                 else dataclasses.replace(v, waiting=0)
                 for v in self.state.queue_views(now)]
        for w, count in releases(views, min_wait_s=wait).items():
            self._asked[w] = now
            self.metrics.rebalanced(_label(w), count)
            task = asyncio.create_task(self._release(w, count), name=f"release-{w:x}")
            self._releases.add(task)
            task.add_done_callback(self._releases.discard)

    async def _release(self, w: int, count: int) -> None:
        try:
            async with asyncio.timeout(5):
                async for reply in direct(self.worker.release, Release(count=count), w):
                    log.debug("worker %x handed back %s of %d waiting requests", w,
                              reply.released, count)
        except (DynagraphError, TimeoutError) as exc:  # an older worker, or it just left
            log.debug("worker %x release: %s", w, exc)

    async def _follow(self, w: int, subscription: Callable[[Subscribe], AsyncIterator[T]],
                      handle: Callable[[int, T], None]) -> None:
        """Keep one stream of worker ``w`` open until ``w`` leaves (this task is cancelled)."""
        name = endpoint_client(subscription).endpoint
        while True:
            try:
                stream = direct(subscription, Subscribe(), w)
                async with contextlib.aclosing(stream):
                    async for item in stream:
                        handle(w, item)
            except (DynagraphError, ValueError) as exc:
                log.debug("worker %x %s stream: %s", w, name, exc)
            if name == "load_metrics":
                self.state.set_load(w, None)
            elif w not in self._synced:  # unreachable (gone, lease not yet expired): no wait
                self._worker_synced(w)
            await asyncio.sleep(self.config.reconnect_delay)

    # --- the other Router replicas -------------------------------------------------

    def _on_peers(self, instances: list[Any]) -> None:
        live = {i.instance_id for i in instances} - {self.runtime.instance_id}
        for p in list(self._peer_tasks):
            if p not in live:
                self._peer_tasks.pop(p).cancel()
                dropped = self.peers.drop(p)
                self._synced_peers.discard(p)
                log.info("Router replica %x gone: %d of its requests no longer counted",
                         p, dropped)
        for p in live - self._peer_tasks.keys():
            self._peer_tasks[p] = asyncio.create_task(self._follow_peer(p),
                                                      name=f"peer-{p:x}")
            log.info("following Router replica %x", p)
        self._check_synced()

    async def _follow_peer(self, p: int) -> None:
        """Keep replica ``p``'s ``inflight`` stream open until ``p`` leaves (this task is
        cancelled); a broken stream drops what ``p`` had in flight until its next
        snapshot."""
        while True:
            try:
                stream = self._peer_client.direct(Subscribe(), p)
                async with contextlib.aclosing(stream):
                    async for update in stream:
                        self.peers.apply(p, update, time.monotonic())
                        if p not in self._synced_peers:
                            self._synced_peers.add(p)
                            self._check_synced()
            except (DynagraphError, ValueError) as exc:
                log.debug("Router replica %x inflight stream: %s", p, exc)
            self.peers.drop(p)
            if p not in self._synced_peers:  # unreachable (a replica that just died): no wait
                self._synced_peers.add(p)
                self._check_synced()
            await asyncio.sleep(self.config.reconnect_delay)

    def _worker_synced(self, w: int) -> None:
        self._synced.add(w)
        self._check_synced()

    def _check_synced(self) -> None:
        """Set ``_sync_event`` once every live worker's snapshot and every peer's first
        update have been applied."""
        if self._sync_armed and not self._sync_event.is_set() and (
                self._tasks.keys() <= self._synced) and (
                self._peer_tasks.keys() <= self._synced_peers):
            self._sync_event.set()

    @endpoint(drain=False)
    async def inflight(self, request: Subscribe) -> AsyncGenerator[InflightUpdate, None]:
        """What this replica has in flight: a snapshot, then its begins and ends as they
        happen (coalesced per read), until closed; for the other Router replicas."""
        ready = asyncio.Event()
        sub = self.feed.subscribe(ready.set)
        try:
            while True:
                update = sub.take()
                if update is None:
                    ready.clear()
                    await ready.wait()
                    continue
                yield update
        finally:
            self.feed.unsubscribe(sub)

    # --- lifecycle ----------------------------------------------------------------

    @async_on_start
    async def start(self) -> None:
        # The linked worker component (VllmWorker, or a stand-in such as MockerWorker);
        # a test's fake client need not name it.
        spec = spec_of(VllmWorker)
        namespace = getattr(self.worker, "namespace", spec.namespace)
        component = getattr(self.worker, "component", spec.name)
        disc = self.runtime.discovery
        t0 = time.monotonic()
        self._watch = await disc.watch_instances(namespace, component, "kv_events")
        self._watch.subscribe(self._on_instances)
        self._on_instances(self._watch.instances())
        self._settings_task = asyncio.create_task(
            self.settings.follow(disc.watch_prefix(self.settings.prefix)), name="router-settings")
        if self.config.share_inflight and self.runtime.clients is not None:
            ns, me = self.runtime.namespace, self.runtime.component
            self._peer_client = await self.runtime.client(me, "inflight",
                                                          response_type=InflightUpdate)
            self._peer_watch = await disc.watch_instances(ns, me, "inflight")
            self._peer_watch.subscribe(self._on_peers)
            self._on_peers(self._peer_watch.instances())
        self._sync_armed = True
        self._check_synced()
        try:
            async with asyncio.timeout(self.config.sync_timeout):
                await self._sync_event.wait()
            self.synced_in_s = time.monotonic() - t0
            log.info("index full: KV snapshots of %d workers and in-flight snapshots of %d "
                     "Router replicas in %.3f s (%d blocks)", len(self._synced),
                     len(self._synced_peers), self.synced_in_s,
                     sum(self.state.index.num_blocks(w) for w in self._synced))
        except TimeoutError:
            log.warning("index not full after %.1f s (KV snapshots of %d of %d workers, "
                        "%d of %d Router replicas): taking requests anyway",
                        self.config.sync_timeout, len(self._synced), len(self._tasks),
                        len(self._synced_peers), len(self._peer_tasks))
        log.info("Router mode %s (live: %smode)", self.settings.current.mode,
                 self.settings.prefix)

    @async_on_shutdown
    async def stop(self) -> None:
        await cancel_and_wait([t for ts in self._tasks.values() for t in ts]
                              + [self._settings_task, *self._releases,
                                 *self._peer_tasks.values()])
        self._tasks.clear()
        self._peer_tasks.clear()
        for watch in (self._watch, self._peer_watch):
            if watch is not None:
                await watch.close()

    # --- the endpoint -------------------------------------------------------------

    def route(self, token_ids: list[int], mode: RouterMode | None = None,
              allowed: Collection[int] | None = None, cache_salt: str | None = None,
              now: float | None = None, slo_class: str | None = None,
              ) -> tuple[Decision, list[int], RouterMode]:
        """Decide for one prompt (synchronous: no other decision interleaves)."""
        mode = self.mode_for(mode)
        hashes = (self.hasher.block_hashes(token_ids, cache_salt=cache_salt)
                  if self.hasher is not None else [])
        live = self.settings.current
        weight = class_overlap_weight(live.overlap_weight, slo_class,
                                      self.config.class_overlap_weights)
        decision = self.state.decide(
            mode, hashes, overlap_weight=weight, temperature=live.temperature,
            cost_model=live.cost_model, prompt_tokens=len(token_ids),
            block_size=self.hasher.block_size if self.hasher is not None else 1,
            now=time.monotonic() if now is None else now, allowed=allowed,
            pool_block_seconds=self.config.pool_block_seconds,
            tier_block_seconds=self.config.tier_block_seconds)
        return decision, hashes, mode

    @endpoint()
    async def generate(self, request: RouteRequest) -> AsyncGenerator[RouteDecision, None]:
        t0 = time.perf_counter()
        now = time.monotonic()
        decision, hashes, mode = self.route(request.token_ids, request.mode, request.workers,
                                            cache_salt_of(self.signer, request.tenant), now,
                                            request.slo_class)
        # judged and counted in this one synchronous step: no other request sees the
        # pressure between this verdict and this request's begin()
        w, overlap, verdict, pressure = decision.worker_id, decision.overlap_blocks, None, None
        if request.admission is not None:  # only a gated request needs the pressure (O(workers))
            pressure = self.pressure.summary(self.state, request.workers,  # before begin()
                                             predicted_ttft_s=decision.ttft_s)
            w, verdict = request.admission.place(pressure, w)
            if w != decision.worker_id:  # the cost's choice was over the thresholds
                overlap = self.state.index.find_matches(hashes).get(w, 0)
        track = request.track and (verdict is None or verdict.action is Action.ADMIT)
        self.metrics.decision(mode=mode.value, worker=_label(w), request_blocks=len(hashes),
                              overlap_blocks=overlap,
                              seconds=time.perf_counter() - t0,
                              predicted_ttft=decision.ttft_s.get(w))
        if log.isEnabledFor(logging.DEBUG):
            log.debug("route %d blocks -> %x (overlap %d, mode %s); costs %s; queues %s; "
                      "learned s/token %s", len(hashes), w, decision.overlap_blocks, mode,
                      {f"{k:x}": round(v, 4) for k, v in decision.costs.items()},
                      {f"{k:x}": (round(q.queued_tokens), q.decoding)
                       for k, q in self.state.queues.items()},
                      {f"{k:x}": f"{x.prefill.value:.2e}"
                       for k, x in self.state.learners.items()})
        key = next(self._keys)
        if track:
            block_size = self.hasher.block_size if self.hasher is not None else 1
            uncached = max(len(request.token_ids) - overlap * block_size, 1)
            self.state.begin(w, hashes, key=key, uncached_tokens=uncached, now=now)
            self.pressure.begin(w)
            self.feed.begin(Tracked(key, w, hashes, uncached))
        try:
            yield RouteDecision(
                worker_id=w, overlap_blocks=overlap,
                request_blocks=len(hashes), mode=mode, pressure=pressure, verdict=verdict)
            if track:
                await asyncio.sleep(self.config.track_timeout)
        finally:
            if track:
                self.state.end(w, hashes, key, now=time.monotonic())
                self.pressure.end(w)
                self.feed.end(key)
