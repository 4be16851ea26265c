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

Fault injection for tests, off in production: only with ``DYNAGRAPH_FAULT_INJECTION=1``
in its environment does the worker follow ``/{namespace}/settings/PrefillWorker/
hold-before-reply-s``, holding each job that long between its prefill and the hand-off.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncGenerator
from typing import Any, ClassVar

import msgspec
from pydantic import Field

from dynagraph.aio import cancel_and_wait
from dynagraph.config import ConfigModel
from dynagraph.llm.disagg import (
    DisaggWorkerKeys,
    JobOutcome,
    PrefillJobHandler,
    reply_through,
    serve_queue,
)
from dynagraph.llm.disagg.metrics import PrefillQueueMetrics
from dynagraph.llm.engines.vllm.args import VllmEngineArgs
from dynagraph.llm.engines.vllm.engine import VllmEngine
from dynagraph.llm.engines.vllm.kv_config import block_hasher
from dynagraph.llm.kv.offload.tier_trim import TierJanitor, tier_janitor
from dynagraph.llm.kv.transfer.nixl_side import nixl_key, prepare_nixl
from dynagraph.llm.kv.transfer.tier_handoff import offer
from dynagraph.runtime.live_settings import LiveSpec
from dynagraph.runtime.queue import NatsPrefillQueue
from dynagraph.sdk import Component, async_on_shutdown, async_on_start, endpoint, service

log = logging.getLogger(__name__)


class PrefillWorkerConfig(VllmEngineArgs, DisaggWorkerKeys):
    """Engine settings (see ``VllmEngineArgs``), the keys shared with the decode workers
    (``DisaggWorkerKeys``) and the queue consumer's; kebab-case in YAML."""

    max_concurrent_prefills: int = Field(default=2, ge=1)
    """Jobs prefilled at once (vLLM batches them)."""
    reply_timeout: float = Field(default=10.0, gt=0)
    """Upper bound on the call to the decode worker's ``prefill_done``."""


FAULTS_ENV = "DYNAGRAPH_FAULT_INJECTION"
"""``1`` turns the ``PrefillFaults`` live settings on (tests only)."""


class PrefillFaults(ConfigModel):
    """Fault injection for tests, live in etcd (``/{ns}/settings/PrefillWorker/...``)."""

    hold_before_reply_s: float = Field(default=0.0, ge=0.0)
    """Hold each job this long between its prefill and the hand-off."""


FAULTS = LiveSpec(PrefillFaults, ("hold-before-reply-s",))


class PrefillStatus(msgspec.Struct, frozen=True, kw_only=True):
    """Request of the ``status`` endpoint (no fields)."""


class PrefillStatusReport(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Answer of the ``status`` endpoint (a diagnostic): the jobs' outcomes so far and,
    by kind of prefill worker, its NIXL record and fault settings or its engine and load."""

    outcomes: dict[str, int]
    nixl: dict[str, Any] | None = None
    hold_before_reply_s: float | None = None
    engine_id: str | None = None
    load: dict[str, Any] | None = None


@service(dynamo={"namespace": "dynamo"}, resources={"cpu": 1}, workers=1)
class PrefillWorker(Component):
    LIVE_SETTINGS: ClassVar[LiveSpec[PrefillFaults]] = FAULTS

    def __init__(self, config: PrefillWorkerConfig) -> None:
        self.config = config
        engine_id = f"{self.runtime.component}-{self.runtime.instance_id:x}"
        kv_cfg, self.nixl = prepare_nixl("kv_producer", engine_id=engine_id,
                                         base=config.kv_transfer_config,
                                         progress_delay_us=config.nixl_progress_delay_us,
                                         shared_memory=config.shared_kv_memory,
                                         wire_codec=config.kv_transfer_compression)
        self.engine = VllmEngine(config.model_copy(update={"kv_transfer_config": kv_cfg}))
        self.queue: NatsPrefillQueue | None = None
        self.faults = self.LIVE_SETTINGS.bind(PrefillFaults(), self.runtime.settings_prefix())
        self._tasks: list[asyncio.Task[None]] = []
        self.outcomes: dict[str, int] = {}
        self.hasher = block_hasher(config)
        self.tier_janitor: TierJanitor | None = None

    @async_on_start
    async def start(self) -> None:
        rt = self.runtime
        if rt.nats_url is None:
            raise RuntimeError("PrefillWorker needs NATS (NATS_SERVER) for the prefill queue")
        await self.engine.start()
        await rt.discovery.put(nixl_key(rt.namespace, rt.component, rt.instance_id),
                               self.nixl.record(), lease=True)
        rt.metadata.update({"nixl": self.nixl.record()})
        faults_on = os.environ.get(FAULTS_ENV) == "1"
        for key, value in (await rt.discovery.get_prefix(self.faults.prefix)).items():
            if faults_on:
                self.faults.apply(key, value)
            elif key.startswith(self.faults.prefix) and key[len(self.faults.prefix):] in (
                    self.faults.names):
                log.warning("ignoring %s: fault injection is off (%s=1 turns it on)",
                            key, FAULTS_ENV)
        self.queue = NatsPrefillQueue(
            rt.nats_url, rt.namespace, ack_wait=self.config.prefill_queue_ack_wait,
            max_deliver=self.config.prefill_queue_max_deliver,
        )
        await self.queue.connect()
        handler = PrefillJobHandler(
            self.engine, reply_through(rt), instance_id=rt.instance_id,
            heartbeat_s=self.config.prefill_queue_ack_wait / 3,
            reply_timeout=self.config.reply_timeout,
            hold_s=lambda: self.faults.current.hold_before_reply_s,
            observer=PrefillQueueMetrics(rt.registry),
            tier=(offer(self.config.kv_offload_dir, self.config.kv_compression)
                  if self.config.through_tier else None),
            hasher=self.hasher,
        )
        self._tasks = [
            asyncio.create_task(serve_queue(self.queue, handler,
                                            concurrency=self.config.max_concurrent_prefills,
                                            on_outcome=self._count), name="prefill-queue"),
        ]
        if faults_on:
            log.warning("fault injection is on (%s=1): %s", FAULTS_ENV,
                        ", ".join(self.faults.prefix + n for n in self.faults.names))
            self._tasks.append(asyncio.create_task(
                self.faults.follow(rt.discovery.watch_prefix(self.faults.prefix)),
                name="prefill-faults"))
        self.tier_janitor = tier_janitor(self.config.kv_offload_dir,
                                         self.config.kv_offload_dir_gib,
                                         worker=f"{rt.instance_id:x}", registry=rt.registry)
        if self.tier_janitor is not None:
            self.tier_janitor.start()
        log.info("prefill worker ready: engine %s, NIXL side channel %s:%d",
                 self.nixl.engine_id, self.nixl.host, self.nixl.port)

    @async_on_shutdown
    async def stop(self) -> None:
        if self.tier_janitor is not None:
            await self.tier_janitor.stop()
        await cancel_and_wait(self._tasks, timeout=10)
        if self.queue is not None:
            await self.queue.close()
        await self.engine.shutdown()

    @endpoint()
    async def status(self, request: PrefillStatus
                     ) -> AsyncGenerator[PrefillStatusReport, None]:
        yield PrefillStatusReport(outcomes=dict(self.outcomes), nixl=self.nixl.record(),
                                  hold_before_reply_s=self.faults.current.hold_before_reply_s)

    def _count(self, outcome: JobOutcome) -> None:
        self.outcomes[outcome.status] = self.outcomes.get(outcome.status, 0) + 1
