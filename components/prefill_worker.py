"""PrefillWorker: pulls remote-prefill jobs and hands the KV over to the decode worker.

Embeds vLLM's ``AsyncLLM`` with the NixlConnector as KV *producer*. For each job from
the prefill queue (NATS JetStream) it prefills (``max_tokens=1``, remote decode), calls
the asking decode worker's ``prefill_done`` endpoint with the KV transfer parameters,
and acks the job only after that call returned (see ``dynagraph.llm.disagg.prefill``).

The callback goes straight to the instance named in the job's ``reply_to``, through
``self.runtime.client(component, endpoint)``: ``VllmWorker`` already declares
``depends(PrefillWorker)`` (that edge puts this component in the disagg graph), so the
way back is a call by name, not a second ``depends()``.

Its NIXL side channel (a free loopback port) and engine id are published under the
lease at ``/{namespace}/nixl/PrefillWorker/{instance_id:x}``.

Live setting (etcd, fault injection for tests): ``/{namespace}/settings/PrefillWorker/
hold-before-reply-s`` makes the worker hold each job that long between prefill and
hand-off. Delete the key (or set 0) for normal operation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from pydantic import Field

from dynagraph.aio import cancel_and_wait
from dynagraph.config import ConfigModel
from dynagraph.errors import RequestPlaneError
from dynagraph.llm.disagg import (
    DisaggWorkerKeys,
    JobOutcome,
    PrefillAck,
    PrefillJobHandler,
    PrefillResult,
    serve_queue,
)
from dynagraph.llm.engines.vllm_engine import VllmEngine, VllmEngineArgs
from dynagraph.llm.kv.nixl_side import nixl_key, prepare_nixl
from dynagraph.observability.disagg_metrics import PrefillQueueMetrics
from dynagraph.runtime.live_settings import LiveSettings
from dynagraph.runtime.queue import NatsPrefillQueue, ReplyTarget
from dynagraph.sdk import Component, async_on_shutdown, async_on_start, endpoint, service

log = logging.getLogger(__name__)


class PrefillWorkerConfig(VllmEngineArgs, DisaggWorkerKeys):
    """Engine settings (see ``VllmEngineArgs``), the keys shared with the decode workers
    (``DisaggWorkerKeys``) and the queue consumer's; kebab-case in YAML."""

    max_concurrent_prefills: int = Field(default=2, ge=1)
    """Jobs prefilled at once (vLLM batches them)."""
    reply_timeout: float = Field(default=10.0, gt=0)
    """Upper bound on the call to the decode worker's ``prefill_done``."""


class PrefillFaults(ConfigModel):
    """Fault injection for tests, live in etcd (``/{ns}/settings/PrefillWorker/...``)."""

    hold_before_reply_s: float = Field(default=0.0, ge=0.0)
    """Hold each job this long between its prefill and the hand-off."""


class PrefillStatus(msgspec.Struct, frozen=True, kw_only=True):
    """Request of the ``status`` endpoint (no fields)."""


@service(dynamo={"namespace": "dynamo"}, resources={"cpu": 1}, workers=1)
class PrefillWorker(Component):
    def __init__(self, config: PrefillWorkerConfig) -> None:
        self.config = config
        engine_id = f"{self.runtime.component}-{self.runtime.instance_id:x}"
        kv_cfg, self.nixl = prepare_nixl("kv_producer", engine_id=engine_id,
                                         base=config.kv_transfer_config,
                                         progress_delay_us=config.nixl_progress_delay_us)
        self.engine = VllmEngine(config.model_copy(update={"kv_transfer_config": kv_cfg}))
        self.queue: NatsPrefillQueue | None = None
        self.faults = LiveSettings(PrefillFaults(), prefix=self.runtime.settings_prefix(),
                                   live=["hold-before-reply-s"])
        self._tasks: list[asyncio.Task[None]] = []
        self.outcomes: dict[str, int] = {}

    @async_on_start
    async def start(self) -> None:
        rt = self.runtime
        if rt.nats_url is None:
            raise RuntimeError("PrefillWorker needs NATS (NATS_SERVER) for the prefill queue")
        await self.engine.start()
        await rt.discovery.put(nixl_key(rt.namespace, rt.component, rt.instance_id),
                               self.nixl.record(), lease=True)
        rt.metadata.update({"nixl": self.nixl.record()})
        for key, value in (await rt.discovery.get_prefix(self.faults.prefix)).items():
            self.faults.apply(key, value)
        self.queue = NatsPrefillQueue(
            rt.nats_url, rt.namespace, ack_wait=self.config.prefill_queue_ack_wait,
            max_deliver=self.config.prefill_queue_max_deliver,
        )
        await self.queue.connect()
        handler = PrefillJobHandler(
            self.engine, self._reply, instance_id=rt.instance_id,
            heartbeat_s=self.config.prefill_queue_ack_wait / 3,
            reply_timeout=self.config.reply_timeout,
            hold_s=lambda: self.faults.current.hold_before_reply_s,
            observer=PrefillQueueMetrics(rt.registry),
        )
        self._tasks = [
            asyncio.create_task(serve_queue(self.queue, handler,
                                            concurrency=self.config.max_concurrent_prefills,
                                            on_outcome=self._count), name="prefill-queue"),
            asyncio.create_task(self.faults.follow(rt.discovery.watch_prefix(self.faults.prefix)),
                                name="prefill-faults"),
        ]
        log.info("prefill worker ready: engine %s, NIXL side channel %s:%d",
                 self.nixl.engine_id, self.nixl.host, self.nixl.port)

    @async_on_shutdown
    async def stop(self) -> None:
        await cancel_and_wait(self._tasks, timeout=10)
        if self.queue is not None:
            await self.queue.close()
        await self.engine.shutdown()

    @endpoint()
    async def status(self, request: PrefillStatus) -> AsyncIterator[dict[str, Any]]:
        yield {"nixl": self.nixl.record(), "outcomes": dict(self.outcomes),
               "hold_before_reply_s": self.faults.current.hold_before_reply_s}

    def _count(self, outcome: JobOutcome) -> None:
        self.outcomes[outcome.status] = self.outcomes.get(outcome.status, 0) + 1

    async def _reply(self, target: ReplyTarget, result: PrefillResult) -> PrefillAck:
        client = await self.runtime.client(target.component, target.endpoint)
        stream = client.direct(msgspec.to_builtins(result), target.instance_id)
        async with contextlib.aclosing(stream):
            async for msg in stream:
                return msgspec.convert(msg, PrefillAck)
        raise RequestPlaneError(f"{target.component}.{target.endpoint} answered nothing")
