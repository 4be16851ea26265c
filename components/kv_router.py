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

from components.worker import VllmWorker
from dynagraph.aio import cancel_and_wait
from dynagraph.errors import DynagraphError
from dynagraph.llm.engines.base import EngineLoad
from dynagraph.llm.protocol import Release, Subscribe
from dynagraph.llm.router import (
    BlockHasher,
    Decision,
    RelayBatch,
    RouteDecision,
    RouteRequest,
    RouterMode,
    RouterState,
)
from dynagraph.llm.router.config import LIVE, RouterConfig
from dynagraph.llm.router.metrics import RouterMetrics
from dynagraph.llm.router.peers import ReplicaLink, StartupSync
from dynagraph.llm.router.pressure import (
    PressureView,
    class_overlap_weight,
)
from dynagraph.llm.router.rebalance import releases
from dynagraph.llm.router.replicas import InflightUpdate, Tracked
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
HASH_CACHE_BLOCKS = 16384
"""Digests of this many recent blocks are kept (``BlockHasher.cached_blocks``; ~1.4 KB
each): a prefix seen again is looked up instead of hashed again."""
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
            BlockHasher(config.block_size, cached_blocks=HASH_CACHE_BLOCKS)
            if config.block_size is not None else None)
        self._tasks: dict[int, list[asyncio.Task[None]]] = {}
        self._keys = itertools.count()
        self._watch: Any = None
        self._settings_task: asyncio.Task[None] | None = None
        self._rebalanced_at = -math.inf
        self._asked: dict[int, float] = {}  # worker -> when it was last asked to hand back
        self._releases: set[asyncio.Task[None]] = set()
        self.sync = StartupSync()
        self.replicas = ReplicaLink(self.state, self.pressure, self.sync,
                                    reconnect_delay=config.reconnect_delay)
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
                self.sync.forget_worker(w)
        for w, info in live.items():
            if w in self._tasks:
                continue
            self._check_hashing(w, info.metadata)
            self.state.add_worker(w)
            tier = info.metadata.get("kv_tier")
            self.state.set_tier(w, tier if isinstance(tier, str) else None)
            self.sync.expect_worker(w)
            self._tasks[w] = [
                asyncio.create_task(self._follow(w, self.worker.kv_events, self._on_kv),
                                    name=f"kv-{w:x}"),
                asyncio.create_task(self._follow(w, self.worker.load_metrics, self._on_load),
                                    name=f"load-{w:x}"),
            ]
            log.info("worker %x joined", w)

    def _check_hashing(self, w: int, meta: dict[str, Any]) -> None:
        size = meta.get("block_size")
        if not isinstance(size, int):
            return
        algo = meta.get("kv_hash_algo", "sha256")
        seed = meta.get("kv_hash_seed")
        if self.hasher is None:
            kw = {"seed": seed} if isinstance(seed, str) else {}
            self.hasher = BlockHasher(size, algo, cached_blocks=HASH_CACHE_BLOCKS, **kw)
            log.info("hashing blocks of %d tokens (%s) as worker %x does", size, algo, w)
        elif (size, algo) != (self.hasher.block_size, self.hasher.algo) or (
                isinstance(seed, str) and seed != self.hasher.seed):
            log.error("worker %x hashes blocks differently (block size %s, %s) from the "
                      "Router (%d, %s): its cache hits will not be seen",
                      w, size, algo, self.hasher.block_size, self.hasher.algo)

    def _on_kv(self, w: int, batch: RelayBatch) -> None:
        self.state.apply(w, batch)
        self.sync.worker_done(w)
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
            else:  # unreachable (gone, lease not yet expired): no wait
                self.sync.worker_done(w)
            await asyncio.sleep(self.config.reconnect_delay)

    @endpoint(drain=False)
    async def inflight(self, request: Subscribe) -> AsyncGenerator[InflightUpdate, None]:
        """What this replica has in flight: a snapshot, then its begins and ends as they
        happen (coalesced per read), until closed; for the other Router replicas."""
        updates = self.replicas.serve()
        async with contextlib.aclosing(updates):
            async for update in updates:
                yield update

    # --- lifecycle ----------------------------------------------------------------

    @async_on_start
    async def start(self) -> None:
        # The linked worker component (VllmWorker, or a stand-in such as MockerWorker);
        # a test's fake client need not name it.
        spec = spec_of(VllmWorker)
        namespace = getattr(self.worker, "namespace", spec.namespace)
        component = getattr(self.worker, "component", spec.name)
        disc = self.runtime.discovery
        self._watch = await disc.watch_instances(namespace, component, "kv_events")
        self._watch.subscribe(self._on_instances)
        self._on_instances(self._watch.instances())
        self._settings_task = asyncio.create_task(
            self.settings.follow(disc.watch_prefix(self.settings.prefix)), name="router-settings")
        if self.config.share_inflight and self.runtime.clients is not None:
            await self.replicas.start(self.runtime)
        sync = self.sync
        self.synced_in_s = await sync.wait(self.config.sync_timeout)
        if self.synced_in_s is not None:
            log.info("index full: KV snapshots of %d workers and in-flight snapshots of %d "
                     "Router replicas in %.3f s (%d blocks)", len(sync.workers_done),
                     len(sync.peers_done), self.synced_in_s,
                     sum(self.state.index.num_blocks(w) for w in sync.workers_done))
        else:
            log.warning("index not full after %.1f s (KV snapshots of %d of %d workers, "
                        "%d of %d Router replicas): taking requests anyway",
                        self.config.sync_timeout, len(sync.workers_done), len(sync.workers),
                        len(sync.peers_done), len(sync.peers))
        log.info("Router mode %s (live: %smode)", self.settings.current.mode,
                 self.settings.prefix)

    @async_on_shutdown
    async def stop(self) -> None:
        await cancel_and_wait([t for ts in self._tasks.values() for t in ts]
                              + [self._settings_task, *self._releases])
        self._tasks.clear()
        await self.replicas.stop()
        if self._watch is not None:
            await self._watch.close()

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
            self.replicas.begin(Tracked(key, w, hashes, uncached))
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
                self.replicas.end(key)
