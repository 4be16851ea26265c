"""Everything a decode worker adds for disaggregated prefill, behind one small object.

``components/worker.py`` (``VllmWorker``) stays thin: its config includes
:class:`DecodeDisaggKeys`, it calls :meth:`DecodeDisagg.create` in ``__init__`` (None
unless the graph links a ``PrefillWorker`` *and* ``remote-prefill`` is true), and then
per request ``plan()`` -> ``engine.generate(..., kv_transfer_params=plan.kv_transfer_params)``;
its ``prefill_done`` endpoint calls ``deliver()``, which points the prefill engine's
transfer parameters at the side channel that prefill instance published in etcd
(``dynagraph.llm.kv.transfer.nixl_peers``) before the coordinator hands them to the engine.

What it owns: the engine's NIXL consumer set-up (``dynagraph.llm.kv.transfer.nixl_side``), the
prefill-queue producer (``NatsPrefillQueue``), the live thresholds
(``LiveDisaggSettings`` fed by an etcd watch on ``/{namespace}/settings/{component}/``),
the NIXL record under the lease, the mirror of the other engines' NIXL records
(``NixlPeers``), and the :class:`RemotePrefillCoordinator`.

``MockerWorker`` uses the same object built by :meth:`DecodeDisagg.create_simulated`:
the same queue, settings and coordinator, no NIXL (its engine simulates the transfer).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import msgspec

from dynagraph.aio import cancel_and_wait
from dynagraph.errors import DiscoveryError
from dynagraph.llm.disagg.coordinator import (
    PREFILL_DONE_ENDPOINT,
    PrefillPlan,
    PrefillResult,
    PrefixCacheEstimate,
    RemotePrefillCoordinator,
)
from dynagraph.llm.disagg.keys import DecodeDisaggKeys
from dynagraph.llm.disagg.metrics import DecodeMetrics, PrefillMetrics
from dynagraph.llm.disagg.policy import LiveDisaggSettings
from dynagraph.llm.engines.base import EngineLoad
from dynagraph.llm.engines.vllm.args import VllmEngineArgs
from dynagraph.llm.kv.transfer.nixl_peers import NixlPeerError, NixlPeers
from dynagraph.llm.kv.transfer.nixl_side import NixlEndpoint, nixl_key, prepare_nixl
from dynagraph.llm.kv.transfer.tier_handoff import TIER_KEY, is_shm, offer
from dynagraph.llm.router.hashing import BlockHasher
from dynagraph.runtime.queue import (
    NatsPrefillQueue,
    PrefillQueue,
    PrefillQueueError,
    PrefillSampling,
    ReplyTarget,
)
from dynagraph.sdk import RuntimeContext, instance_ids

log = logging.getLogger(__name__)

A = TypeVar("A", bound=VllmEngineArgs)


class TransferringEngine(Protocol):
    """What the decode side needs of its engine (``VllmEngine``, ``MockerEngine``)."""

    def load(self) -> EngineLoad: ...

    def observe_kv_transfers(self, listener: Callable[[int, float], None] | None) -> None: ...

QUEUE_DEPTH_INTERVAL_S = 1.0
"""How often the exported prefill queue depth (``dynamo_prefill_queue_depth``) is refreshed."""


class DecodeDisagg:
    """Remote-prefill support of one decode worker process. Build with :meth:`create`."""

    def __init__(self, keys: DecodeDisaggKeys, runtime: RuntimeContext, prefill: Any,
                 kv_transfer_config: dict[str, Any], nixl: NixlEndpoint | None) -> None:
        self.keys = keys
        self.runtime = runtime
        self.prefill = prefill
        self.kv_transfer_config = kv_transfer_config
        self.nixl = nixl
        self.settings = LiveDisaggSettings(keys.disagg_config(), namespace=runtime.namespace,
                                           component=runtime.component)
        self.queue: PrefillQueue | None = None
        self.coordinator: RemotePrefillCoordinator | None = None
        self.peers: NixlPeers | None = None
        self.tier: dict[str, str] | None = None
        """The shared KV tier this worker offers prefill workers (``kv-transport``)."""
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    def create(cls, keys: DecodeDisaggKeys, runtime: RuntimeContext, prefill: Any,
               base_kv_config: dict[str, Any] | None = None, wire_codec: str = "none"
               ) -> DecodeDisagg | None:
        """None when the graph has no PrefillWorker (``prefill is None``) or remote-prefill is off.

        Side effect: sets the NIXL side-channel environment for the engine to come.
        """
        if prefill is None or not keys.remote_prefill:
            return None
        engine_id = f"{runtime.component}-{runtime.instance_id:x}"
        kv_cfg, nixl = prepare_nixl("kv_consumer", engine_id=engine_id, base=base_kv_config,
                                    progress_delay_us=keys.nixl_progress_delay_us,
                                    settle_us=keys.nixl_settle_us,
                                    shared_memory=keys.shared_kv_memory,
                                    wire_codec=wire_codec)
        return cls(keys, runtime, prefill, kv_cfg, nixl)

    @classmethod
    def create_simulated(cls, keys: DecodeDisaggKeys, runtime: RuntimeContext,
                         prefill: Any) -> DecodeDisagg | None:
        """As :meth:`create`, for an engine that simulates KV transfers (no NIXL)."""
        if prefill is None or not keys.remote_prefill:
            return None
        return cls(keys, runtime, prefill, {}, None)

    def engine_args(self, args: A) -> A:
        if self.keys.through_tier:
            self.tier = offer(args.kv_offload_dir, args.kv_compression)
        return args.model_copy(update={"kv_transfer_config": self.kv_transfer_config})

    async def start(self, engine: TransferringEngine, hasher: BlockHasher) -> None:
        """Connect the queue, follow the live settings, publish the NIXL record.

        ``hasher`` hashes blocks as the engine does (the prefix-cache estimate). The queue
        is NATS (``NATS_SERVER``) unless ``self.queue`` was set before (tests set an
        in-memory one).
        """
        rt = self.runtime
        if self.queue is None and rt.nats_url is None:
            raise RuntimeError("remote prefill needs NATS (NATS_SERVER) for the prefill queue")
        for key, value in (await rt.discovery.get_prefix(self.settings.prefix)).items():
            self.settings.apply(key, value)
        transfers = DecodeMetrics(worker=f"{rt.instance_id:x}", registry=rt.registry)
        engine.observe_kv_transfers(transfers.kv_transfer)
        self._tasks.append(asyncio.create_task(
            self.settings.follow(rt.discovery.watch_prefix(self.settings.prefix)),
            name="disagg-settings"))
        if self.queue is None:
            assert rt.nats_url is not None
            self.queue = NatsPrefillQueue(rt.nats_url, rt.namespace,
                                          ack_wait=self.keys.prefill_queue_ack_wait,
                                          max_deliver=self.keys.prefill_queue_max_deliver)
        await self.queue.connect()
        if self.nixl is not None:
            await rt.discovery.put(nixl_key(rt.namespace, rt.component, rt.instance_id),
                                   self.nixl.record(), lease=True)
            rt.metadata["nixl"] = self.nixl.record()
            self.peers = NixlPeers(rt.discovery, rt.namespace)
            await self.peers.start()
        self._tasks.append(asyncio.create_task(self._export_queue_depth(transfers),
                                               name="prefill-queue-depth"))
        self.coordinator = RemotePrefillCoordinator(
            settings=self.settings, queue=self.queue,
            reply_to=ReplyTarget(component=rt.component, endpoint=PREFILL_DONE_ENDPOINT,
                                 instance_id=rt.instance_id),
            prefix=PrefixCacheEstimate(hasher, engine.load().kv_blocks_total),
            prefill_workers=self._prefill_workers, metrics=PrefillMetrics(rt.registry),
            engine_params={TIER_KEY: self.tier} if self.tier is not None else {},
        )
        where = (f"NIXL consumer {self.nixl.engine_id} at {self.nixl.host}:{self.nixl.port}"
                 if self.nixl is not None else "simulated KV transfers")
        if self.tier is not None:
            where += f", or the shared KV tier {self.tier['dir']} on this host"
        log.info("remote prefill on: %s; settings %s", where,
                 self.settings.current.model_dump(by_alias=True))

    async def _export_queue_depth(self, metrics: DecodeMetrics) -> None:
        assert self.queue is not None
        while True:
            try:
                metrics.queue_depth(await self.queue.depth())
            except PrefillQueueError as e:
                log.debug("prefill queue depth unavailable: %s", e)
            await asyncio.sleep(QUEUE_DEPTH_INTERVAL_S)

    def _prefill_workers(self) -> int:
        return len(instance_ids(self.prefill.status))

    async def plan(self, request_id: str, prompt: list[int], temperature: float,
                   seed: int | None, cache_salt: str | None = None) -> PrefillPlan:
        assert self.coordinator is not None, "start() first"
        return await self.coordinator.plan(
            request_id, prompt,
            PrefillSampling(temperature=temperature, seed=seed, cache_salt=cache_salt))

    async def deliver(self, result: PrefillResult) -> bool:
        """Hand ``result`` to the request waiting for it, its transfer parameters pointed
        at the side channel in the prefill instance's NIXL record. False if nobody waits,
        or the record is missing or names another engine (not used: the request
        prefills locally after ``remote-prefill-timeout``), or etcd could not be read."""
        if self.coordinator is None:
            return False
        if self.nixl is None or is_shm(result.kv_transfer_params):
            # simulated transfers, or the KV is in the shared tier: no side channel
            return self.coordinator.deliver(result)
        if self.peers is None:
            return False
        try:
            params = await self.peers.resolve(result.prefill_instance, result.kv_transfer_params)
        except (NixlPeerError, DiscoveryError) as exc:
            log.warning("prefill result for %s from instance %x not used: %s",
                        result.request_id, result.prefill_instance, exc)
            return False
        return self.coordinator.deliver(
            msgspec.structs.replace(result, kv_transfer_params=params))

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        if self.peers is not None:
            await self.peers.close()
        if self.queue is not None:
            await self.queue.close()
