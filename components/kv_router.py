"""Router: picks the decode worker for each request (KV-aware or not).

Inputs, per live ``VllmWorker`` instance (from discovery; an instance whose lease
expires is dropped from the index and the load table at once):

- its ``kv_events`` stream (a snapshot, then net deltas; see ``dynagraph.llm.kv_relay``)
  mirrored into one ``PrefixIndex`` under the worker's instance id;
- its ``load_metrics`` stream (``EngineLoad`` about 10 times a second). A worker
  whose load stream is down (crashed, lease not yet expired) is not chosen while
  another worker is healthy.

``generate(RouteRequest)`` (``token_ids``, ``track``, ``mode``) yields one ``{"worker_id", "overlap_blocks",
"request_blocks", "mode"}``. The Processor then calls that worker with ``direct()``.
With ``track=True`` the stream stays open (yielding nothing more) until the caller
closes it, and the request counts as in flight on the chosen worker meanwhile: its
block hashes are a *predicted* prefix for later requests (before the worker's events
arrive) and its unshared blocks count as that worker's load, so a burst of requests
sharing a prefix sticks to one worker without overloading it.

Modes (``RouterMode``: ``kv``, ``kv-load``, ``round-robin``, ``random``): a mode set
live in etcd at ``/{ns}/settings/Router/mode`` (a JSON string) wins; else the
request's ``mode`` (the Processor's ``router-mode``); else ``mode:`` in the config.
Deleting the etcd key restores the others. ``overlap-weight`` and
``temperature`` can be tuned the same way. The choice itself is the pure
``choose_worker``; ``RouterState`` only gathers its inputs. Block hashes come from the
one ``BlockHasher`` with the block size, hash algorithm and seed that the workers
publish in their discovery metadata.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from prometheus_client import Counter, Gauge, Histogram
from pydantic import BaseModel, ConfigDict, Field

from components.worker import VllmWorker
from dynagraph.errors import DynagraphError
from dynagraph.llm.engines.base import EngineLoad
from dynagraph.llm.kv_relay import RelayBatch
from dynagraph.llm.router import (
    BlockHasher,
    Decision,
    PrefixIndex,
    RoundRobinState,
    RouterMode,
    WorkerLoad,
    choose_worker,
)
from dynagraph.observability._build import LATENCY_BUCKETS
from dynagraph.sdk import async_on_shutdown, async_on_start, depends, endpoint, service, spec_of

log = logging.getLogger(__name__)

DECISIONS = Counter("dynamo_router_decisions", "Routing decisions by chosen worker and mode.",
                    ["worker", "mode"])
OVERLAP_BLOCKS = Counter("dynamo_router_overlap_blocks",
                         "Cached prefix blocks on the chosen worker, summed over decisions.",
                         ["worker"])
REQUEST_BLOCKS = Counter("dynamo_router_request_blocks",
                         "Full prompt blocks of routed requests.", ["worker"])
INDEX_BLOCKS = Gauge("dynamo_router_index_blocks", "Blocks the index holds per worker.",
                     ["worker"])
KV_BATCHES = Counter("dynamo_router_kv_event_batches", "KV event batches applied.", ["worker"])
DECISION_SECONDS = Histogram("dynamo_router_decision_seconds",
                             "Time to choose a worker for one request (index lookup + cost)",
                             buckets=LATENCY_BUCKETS)


def _kebab(name: str) -> str:
    return name.replace("_", "-")


class RouterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", alias_generator=_kebab, validate_by_name=True,
                              validate_by_alias=True)

    mode: RouterMode = RouterMode.KV
    overlap_weight: float = Field(default=1.0, ge=0.0)
    temperature: float = Field(default=0.0, ge=0.0)
    block_size: int | None = Field(default=None, ge=1)
    """None: use the block size the workers publish (they must all agree)."""
    seed: int | None = None
    """Seeds the tie-breaking RNG (for reproducible studies)."""
    reconnect_delay: float = Field(default=0.5, gt=0.0)
    track_timeout: float = Field(default=600.0, gt=0.0)
    """Longest a tracked request counts as in flight."""


class RouteRequest(msgspec.Struct):
    """``mode``: the caller's default; a mode set in etcd wins, then this, then the config."""

    token_ids: list[int]
    track: bool = False
    mode: RouterMode | None = None


def _label(worker_id: int) -> str:
    return f"{worker_id:x}"


class RouterState:
    """Everything a decision depends on, kept up to date by the component. No I/O.

    ``live`` workers are the candidates; ``healthy`` ones (load stream up) are
    preferred. ``inflight[w]`` counts the block hashes of tracked requests on ``w``.
    """

    def __init__(self, rng: random.Random | None = None) -> None:
        self.index = PrefixIndex()
        self.rng = rng or random.Random()
        self.rr = RoundRobinState()
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


@service(dynamo={"namespace": "dynamo"}, resources={"cpu": 1}, workers=1)
class Router:
    worker = depends(VllmWorker)

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.state = RouterState(random.Random(config.seed))
        self.settings: dict[str, Any] = {}
        self.hasher: BlockHasher | None = (
            BlockHasher(config.block_size) if config.block_size is not None else None)
        self._tasks: dict[int, list[asyncio.Task[None]]] = {}
        self._watch: Any = None
        self._settings_task: asyncio.Task[None] | None = None

    # --- settings -----------------------------------------------------------------

    @property
    def mode(self) -> RouterMode:
        """The mode for a request that names none."""
        return self.settings.get("mode", self.config.mode)  # type: ignore[no-any-return]

    def mode_for(self, requested: RouterMode | None) -> RouterMode:
        if "mode" in self.settings or requested is None:
            return self.mode
        return requested

    def apply_setting(self, name: str, value: Any | None) -> None:
        """One etcd setting changed (``None``: deleted, back to the config's value)."""
        parse: dict[str, Callable[[Any], Any]] = {
            "mode": RouterMode, "overlap-weight": float, "temperature": float}
        if name not in parse:
            log.warning("ignoring unknown Router setting %r", name)
            return
        if value is None:
            self.settings.pop(name, None)
            log.info("Router setting %s reset to the config's value", name)
            return
        try:
            parsed = parse[name](value)
            if name != "mode" and parsed < 0:
                raise ValueError("must be >= 0")
        except (ValueError, TypeError) as exc:
            log.warning("ignoring Router setting %s=%r: %s", name, value, exc)
            return
        self.settings[name] = parsed
        log.info("Router setting %s = %s", name, parsed)

    async def _watch_settings(self) -> None:
        prefix = self.runtime.settings_prefix()  # type: ignore[attr-defined]
        gen = self.runtime.discovery.watch_prefix(prefix)  # type: ignore[attr-defined]
        async with contextlib.aclosing(gen):
            async for key, value in gen:
                self.apply_setting(key[len(prefix):], value)

    # --- workers ------------------------------------------------------------------

    def _on_instances(self, instances: list[Any]) -> None:
        live = {i.instance_id: i for i in instances}
        for w in list(self._tasks):
            if w not in live:
                log.info("worker %x gone (lease expired or closed): dropped from the index", w)
                for t in self._tasks.pop(w):
                    t.cancel()
                self.state.remove_worker(w)
                INDEX_BLOCKS.labels(_label(w)).set(0)
        for w, info in live.items():
            if w in self._tasks:
                continue
            self._check_hashing(w, info.metadata)
            self.state.add_worker(w)
            self._tasks[w] = [
                asyncio.create_task(self._follow(w, "kv_events", self._on_kv), name=f"kv-{w:x}"),
                asyncio.create_task(self._follow(w, "load_metrics", self._on_load),
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
            self.hasher = BlockHasher(size, algo, **kw)
            log.info("hashing blocks of %d tokens (%s) as worker %x does", size, algo, w)
        elif (size, algo) != (self.hasher.block_size, self.hasher.algo) or (
                isinstance(seed, str) and seed != self.hasher.seed):
            log.error("worker %x hashes blocks differently (block size %s, %s) from the "
                      "Router (%d, %s): its cache hits will not be seen",
                      w, size, algo, self.hasher.block_size, self.hasher.algo)

    def _on_kv(self, w: int, item: Any) -> None:
        self.state.apply(w, RelayBatch.from_wire(item))
        KV_BATCHES.labels(_label(w)).inc()
        INDEX_BLOCKS.labels(_label(w)).set(self.state.index.num_blocks(w))

    def _on_load(self, w: int, item: Any) -> None:
        self.state.set_load(w, EngineLoad.model_validate(item))

    async def _follow(self, w: int, endpoint_name: str,
                      handle: Callable[[int, Any], None]) -> None:
        """Keep one stream of worker ``w`` open until ``w`` leaves (this task is cancelled)."""
        while True:
            try:
                stream = self.worker.direct({}, w, endpoint=endpoint_name)
                async with contextlib.aclosing(stream):
                    async for item in stream:
                        handle(w, item)
            except (DynagraphError, msgspec.ValidationError, ValueError) as exc:
                log.debug("worker %x %s stream: %s", w, endpoint_name, exc)
            if endpoint_name == "load_metrics":
                self.state.set_load(w, None)
            await asyncio.sleep(self.config.reconnect_delay)

    # --- lifecycle ----------------------------------------------------------------

    @async_on_start
    async def start(self) -> None:
        spec = spec_of(VllmWorker)
        disc = self.runtime.discovery  # type: ignore[attr-defined]
        self._watch = await disc.watch_instances(spec.namespace, spec.name, "kv_events")
        self._watch.subscribe(self._on_instances)
        self._on_instances(self._watch.instances())
        self._settings_task = asyncio.create_task(self._watch_settings(), name="router-settings")
        log.info("Router mode %s (live: /%s/settings/Router/mode)", self.mode,
                 self.runtime.namespace)  # type: ignore[attr-defined]

    @async_on_shutdown
    async def stop(self) -> None:
        tasks = [t for ts in self._tasks.values() for t in ts]
        if self._settings_task is not None:
            tasks.append(self._settings_task)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5)
        self._tasks.clear()
        if self._watch is not None:
            await self._watch.close()

    # --- the endpoint -------------------------------------------------------------

    def route(self, token_ids: list[int], mode: RouterMode | None = None
              ) -> tuple[Decision, list[int], RouterMode]:
        """Decide for one prompt (synchronous: no other decision interleaves)."""
        mode = self.mode_for(mode)
        hashes = self.hasher.block_hashes(token_ids) if self.hasher is not None else []
        decision = self.state.decide(
            mode, hashes,
            overlap_weight=self.settings.get("overlap-weight", self.config.overlap_weight),
            temperature=self.settings.get("temperature", self.config.temperature))
        label = _label(decision.worker_id)
        DECISIONS.labels(label, mode.value).inc()
        OVERLAP_BLOCKS.labels(label).inc(decision.overlap_blocks)
        REQUEST_BLOCKS.labels(label).inc(len(hashes))
        return decision, hashes, mode

    @endpoint()
    async def generate(self, request: RouteRequest) -> AsyncIterator[dict[str, Any]]:
        t0 = time.perf_counter()
        decision, hashes, mode = self.route(request.token_ids, request.mode)
        DECISION_SECONDS.observe(time.perf_counter() - t0)
        w = decision.worker_id
        log.debug("route %d blocks -> %x (overlap %d, mode %s)", len(hashes), w,
                  decision.overlap_blocks, mode)
        if request.track:
            self.state.begin(w, hashes)
        try:
            yield {"worker_id": w, "overlap_blocks": decision.overlap_blocks,
                   "request_blocks": len(hashes), "mode": mode.value}
            if request.track:
                await asyncio.sleep(self.config.track_timeout)
        finally:
            if request.track:
                self.state.end(w, hashes)
