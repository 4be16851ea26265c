"""Router: picks the decode worker for each request (KV-aware or not).

Inputs, per live ``VllmWorker`` instance (from discovery; an instance whose lease
expires is dropped from the index and the load table at once):

- its ``kv_events`` stream (a snapshot, then net deltas; see ``dynagraph.llm.kv.relay``)
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
``overlap-weight`` and ``temperature`` are live settings too. The choice itself is the
pure ``choose_worker``; ``RouterState`` gathers its inputs. Block hashes come from the
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
from pydantic import Field

from components.worker import VllmWorker
from dynagraph.aio import cancel_and_wait
from dynagraph.config import ConfigModel
from dynagraph.errors import DynagraphError
from dynagraph.llm.engines.base import EngineLoad
from dynagraph.llm.router import (
    BlockHasher,
    Decision,
    RelayBatch,
    RouteDecision,
    RouteRequest,
    RouterMode,
    RouterState,
)
from dynagraph.observability.router_metrics import RouterMetrics
from dynagraph.runtime.live_settings import LiveSettings
from dynagraph.sdk import (
    Component,
    async_on_shutdown,
    async_on_start,
    depends,
    endpoint,
    service,
    spec_of,
)

log = logging.getLogger(__name__)

LIVE = ("mode", "overlap-weight", "temperature")
"""Router settings that can change at run time (``/{ns}/settings/Router/<name>``)."""


class RouterConfig(ConfigModel):
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


def _label(worker_id: int) -> str:
    return f"{worker_id:x}"


@service(dynamo={"namespace": "dynamo"}, resources={"cpu": 1}, workers=1)
class Router(Component):
    worker = depends(VllmWorker)

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.state = RouterState(random.Random(config.seed))
        self.settings = LiveSettings(config, prefix=self.runtime.settings_prefix(), live=LIVE)
        self.metrics = RouterMetrics(self.runtime.registry)
        self.hasher: BlockHasher | None = (
            BlockHasher(config.block_size) if config.block_size is not None else None)
        self._tasks: dict[int, list[asyncio.Task[None]]] = {}
        self._watch: Any = None
        self._settings_task: asyncio.Task[None] | None = None

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
                self.metrics.forget_worker(_label(w))
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
        self.metrics.kv_event_batch(_label(w))
        self.metrics.index_blocks(_label(w), self.state.index.num_blocks(w))

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
        disc = self.runtime.discovery
        self._watch = await disc.watch_instances(spec.namespace, spec.name, "kv_events")
        self._watch.subscribe(self._on_instances)
        self._on_instances(self._watch.instances())
        self._settings_task = asyncio.create_task(
            self.settings.follow(disc.watch_prefix(self.settings.prefix)), name="router-settings")
        log.info("Router mode %s (live: %smode)", self.settings.current.mode,
                 self.settings.prefix)

    @async_on_shutdown
    async def stop(self) -> None:
        await cancel_and_wait([t for ts in self._tasks.values() for t in ts]
                              + [self._settings_task])
        self._tasks.clear()
        if self._watch is not None:
            await self._watch.close()

    # --- the endpoint -------------------------------------------------------------

    def route(self, token_ids: list[int], mode: RouterMode | None = None
              ) -> tuple[Decision, list[int], RouterMode]:
        """Decide for one prompt (synchronous: no other decision interleaves)."""
        mode = self.mode_for(mode)
        hashes = self.hasher.block_hashes(token_ids) if self.hasher is not None else []
        live = self.settings.current
        decision = self.state.decide(mode, hashes, overlap_weight=live.overlap_weight,
                                     temperature=live.temperature)
        return decision, hashes, mode

    @endpoint()
    async def generate(self, request: RouteRequest) -> AsyncIterator[dict[str, Any]]:
        t0 = time.perf_counter()
        decision, hashes, mode = self.route(request.token_ids, request.mode)
        w = decision.worker_id
        self.metrics.decision(mode=mode.value, worker=_label(w), request_blocks=len(hashes),
                              overlap_blocks=decision.overlap_blocks,
                              seconds=time.perf_counter() - t0)
        log.debug("route %d blocks -> %x (overlap %d, mode %s)", len(hashes), w,
                  decision.overlap_blocks, mode)
        if request.track:
            self.state.begin(w, hashes)
        try:
            yield msgspec.to_builtins(RouteDecision(
                worker_id=w, overlap_blocks=decision.overlap_blocks,
                request_blocks=len(hashes), mode=mode))
            if request.track:
                await asyncio.sleep(self.config.track_timeout)
        finally:
            if request.track:
                self.state.end(w, hashes)
