"""Everything a decode worker adds for disaggregated prefill, behind one small object.

``components/worker.py`` (``VllmWorker``) stays thin: its config includes
:class:`DecodeDisaggKeys`, it calls :meth:`DecodeDisagg.create` in ``__init__`` (None
unless the graph links a ``PrefillWorker`` *and* ``remote-prefill`` is true), and then
per request ``plan()`` -> ``engine.generate(..., kv_transfer_params=plan.kv_transfer_params)``;
its ``prefill_done`` endpoint calls ``deliver()``.

What it owns: the engine's NIXL consumer set-up (``dynagraph.llm.kv.nixl_side``), the
prefill-queue producer (``NatsPrefillQueue``), the live thresholds
(``LiveDisaggSettings`` fed by an etcd watch on ``/{namespace}/settings/{component}/``),
the NIXL record under the lease, and the :class:`RemotePrefillCoordinator`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, TypeVar

from dynagraph.aio import cancel_and_wait
from dynagraph.llm.disagg.coordinator import (
    PREFILL_DONE_ENDPOINT,
    PrefillPlan,
    PrefillResult,
    PrefixCacheEstimate,
    RemotePrefillCoordinator,
)
from dynagraph.llm.disagg.keys import DecodeDisaggKeys
from dynagraph.llm.disagg.policy import LiveDisaggSettings
from dynagraph.llm.engines.vllm_engine import VllmEngine, VllmEngineArgs
from dynagraph.llm.kv.nixl_side import NixlEndpoint, nixl_key, prepare_nixl
from dynagraph.llm.router.hashing import BlockHasher
from dynagraph.observability.disagg_metrics import DecodeMetrics, PrefillMetrics
from dynagraph.runtime.queue import (
    NatsPrefillQueue,
    PrefillQueueError,
    PrefillSampling,
    ReplyTarget,
)
from dynagraph.sdk import RuntimeContext

log = logging.getLogger(__name__)

A = TypeVar("A", bound=VllmEngineArgs)

QUEUE_DEPTH_INTERVAL_S = 1.0
"""How often the exported prefill queue depth (``dynamo_prefill_queue_depth``) is refreshed."""


class DecodeDisagg:
    """Remote-prefill support of one decode worker process. Build with :meth:`create`."""

    def __init__(self, keys: DecodeDisaggKeys, runtime: RuntimeContext, prefill: Any,
                 kv_transfer_config: dict[str, Any], nixl: NixlEndpoint) -> None:
        self.keys = keys
        self.runtime = runtime
        self.prefill = prefill
        self.kv_transfer_config = kv_transfer_config
        self.nixl = nixl
        self.settings = LiveDisaggSettings(keys.disagg_config(), namespace=runtime.namespace,
                                           component=runtime.component)
        self.queue: NatsPrefillQueue | None = None
        self.coordinator: RemotePrefillCoordinator | None = None
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    def create(cls, keys: DecodeDisaggKeys, runtime: RuntimeContext, prefill: Any,
               base_kv_config: dict[str, Any] | None = None) -> DecodeDisagg | None:
        """None when the graph has no PrefillWorker (``prefill is None``) or remote-prefill is off.

        Side effect: sets the NIXL side-channel environment for the engine to come.
        """
        if prefill is None or not keys.remote_prefill:
            return None
        engine_id = f"{runtime.component}-{runtime.instance_id:x}"
        kv_cfg, nixl = prepare_nixl("kv_consumer", engine_id=engine_id, base=base_kv_config,
                                    progress_delay_us=keys.nixl_progress_delay_us)
        return cls(keys, runtime, prefill, kv_cfg, nixl)

    def engine_args(self, args: A) -> A:
        return args.model_copy(update={"kv_transfer_config": self.kv_transfer_config})

    async def start(self, engine: VllmEngine, hasher: BlockHasher) -> None:
        """Connect the queue, follow the live settings, publish the NIXL record.

        ``hasher`` hashes blocks as the engine does (the prefix-cache estimate).
        """
        rt = self.runtime
        if rt.nats_url is None:
            raise RuntimeError("remote prefill needs NATS (NATS_SERVER) for the prefill queue")
        for key, value in (await rt.discovery.get_prefix(self.settings.prefix)).items():
            self.settings.apply(key, value)
        transfers = DecodeMetrics(worker=f"{rt.instance_id:x}", registry=rt.registry)
        engine.observe_kv_transfers(transfers.kv_transfer)
        self._tasks.append(asyncio.create_task(
            self.settings.follow(rt.discovery.watch_prefix(self.settings.prefix)),
            name="disagg-settings"))
        self.queue = NatsPrefillQueue(rt.nats_url, rt.namespace,
                                      ack_wait=self.keys.prefill_queue_ack_wait,
                                      max_deliver=self.keys.prefill_queue_max_deliver)
        await self.queue.connect()
        await rt.discovery.put(nixl_key(rt.namespace, rt.component, rt.instance_id),
                               self.nixl.record(), lease=True)
        rt.metadata["nixl"] = self.nixl.record()
        self._tasks.append(asyncio.create_task(self._export_queue_depth(transfers),
                                               name="prefill-queue-depth"))
        self.coordinator = RemotePrefillCoordinator(
            settings=self.settings, queue=self.queue,
            reply_to=ReplyTarget(component=rt.component, endpoint=PREFILL_DONE_ENDPOINT,
                                 instance_id=rt.instance_id),
            prefix=PrefixCacheEstimate(hasher, engine.load().kv_blocks_total),
            prefill_workers=self._prefill_workers, metrics=PrefillMetrics(rt.registry),
        )
        log.info("remote prefill on: NIXL consumer %s at %s:%d; settings %s",
                 self.nixl.engine_id, self.nixl.host, self.nixl.port,
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
        return len(self.prefill.instance_ids("status"))

    async def plan(self, request_id: str, prompt: list[int], temperature: float,
                   seed: int | None) -> PrefillPlan:
        assert self.coordinator is not None, "start() first"
        return await self.coordinator.plan(
            request_id, prompt, PrefillSampling(temperature=temperature, seed=seed))

    def deliver(self, result: PrefillResult) -> bool:
        return self.coordinator is not None and self.coordinator.deliver(result)

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        if self.queue is not None:
            await self.queue.close()
