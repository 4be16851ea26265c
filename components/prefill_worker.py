"""PrefillWorker: pulls remote-prefill jobs and hands the KV over to the decode worker.

Embeds vLLM's ``AsyncLLM`` with the NixlConnector as KV *producer*. For each job from
the prefill queue (NATS JetStream) it prefills (``max_tokens=1``, remote decode), calls
the asking decode worker's ``prefill_done`` endpoint with the KV transfer parameters,
and acks the job only after that call returned (see ``dynagraph.llm.prefill_handler``).

The callback goes straight to the instance named in the job's ``reply_to``. It does not
use ``depends(VllmWorker)``: ``VllmWorker`` already declares ``depends(PrefillWorker)``
(that edge puts this component in the disagg graph), and a back edge would be an
import cycle. The client is built from discovery the same way the SDK builds one.

Its NIXL side channel (a free loopback port) and engine id are published under the
lease at ``/{namespace}/nixl/PrefillWorker/{instance_id:x}``.

Live setting (etcd, fault injection for tests): ``/{namespace}/settings/PrefillWorker/
hold-before-reply-s`` makes the worker hold each job that long between prefill and
hand-off. Delete the key (or set 0) for normal operation.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from pydantic import Field

from dynagraph.errors import RequestPlaneError
from dynagraph.llm.engines.vllm_engine import VllmEngine, VllmEngineArgs
from dynagraph.llm.nixl_side import (
    DisaggWorkerKeys,
    nixl_key,
    prepare_nixl,
)
from dynagraph.llm.prefill_handler import JobOutcome, PrefillJobHandler, serve_queue
from dynagraph.llm.remote_prefill import PrefillAck, PrefillResult
from dynagraph.observability.disagg_metrics import PrefillQueueMetrics
from dynagraph.runtime.queue import NatsPrefillQueue, ReplyTarget
from dynagraph.runtime.rpc import RpcClient
from dynagraph.sdk import (
    EndpointClient,
    RuntimeContext,
    async_on_shutdown,
    async_on_start,
    endpoint,
    service,
)

log = logging.getLogger(__name__)

HOLD_KEY = "hold-before-reply-s"


class PrefillWorkerConfig(VllmEngineArgs, DisaggWorkerKeys):
    """Engine settings (see ``VllmEngineArgs``), the keys shared with the decode workers
    (``DisaggWorkerKeys``) and the queue consumer's; kebab-case in YAML."""

    max_concurrent_prefills: int = Field(default=2, ge=1)
    """Jobs prefilled at once (vLLM batches them)."""
    reply_timeout: float = Field(default=10.0, gt=0)
    """Upper bound on the call to the decode worker's ``prefill_done``."""


@functools.cache
def _queue_metrics() -> PrefillQueueMetrics:
    """One set per process: the default registry refuses a second registration."""
    return PrefillQueueMetrics()


class PrefillStatus(msgspec.Struct, frozen=True, kw_only=True):
    """Request of the ``status`` endpoint (no fields)."""


@service(dynamo={"namespace": "dynamo"}, resources={"cpu": 1}, workers=1)
class PrefillWorker:
    runtime: RuntimeContext  # set by the SDK before __init__

    def __init__(self, config: PrefillWorkerConfig) -> None:
        self.config = config
        engine_id = f"{self.runtime.component}-{self.runtime.instance_id:x}"
        kv_cfg, self.nixl = prepare_nixl("kv_producer", engine_id=engine_id,
                                         base=config.kv_transfer_config,
                                         progress_delay_us=config.nixl_progress_delay_us)
        self.engine = VllmEngine(config.model_copy(update={"kv_transfer_config": kv_cfg}))
        self.queue: NatsPrefillQueue | None = None
        self.rpc = RpcClient()
        self._callbacks: dict[tuple[str, str], EndpointClient] = {}
        self._watches: list[Any] = []
        self._tasks: list[asyncio.Task[None]] = []
        self.hold_s = 0.0
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
        settings = await rt.discovery.get_prefix(rt.settings_prefix())
        for key, value in settings.items():
            self._apply_setting(key, value)
        self.queue = NatsPrefillQueue(
            rt.nats_url, rt.namespace, ack_wait=self.config.prefill_queue_ack_wait,
            max_deliver=self.config.prefill_queue_max_deliver,
        )
        await self.queue.connect()
        handler = PrefillJobHandler(
            self.engine, self._reply, instance_id=rt.instance_id,
            heartbeat_s=self.config.prefill_queue_ack_wait / 3,
            reply_timeout=self.config.reply_timeout, hold_s=lambda: self.hold_s,
            observer=_queue_metrics(),
        )
        self._tasks = [
            asyncio.create_task(serve_queue(self.queue, handler,
                                            concurrency=self.config.max_concurrent_prefills,
                                            on_outcome=self._count)),
            asyncio.create_task(self._follow_settings()),
        ]
        log.info("prefill worker ready: engine %s, NIXL side channel %s:%d",
                 self.nixl.engine_id, self.nixl.host, self.nixl.port)

    @async_on_shutdown
    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(task, timeout=10)
        if self.queue is not None:
            await self.queue.close()
        for watch in self._watches:
            await watch.close()
        await self.rpc.close()
        await self.engine.shutdown()

    @endpoint()
    async def status(self, request: PrefillStatus) -> AsyncIterator[dict[str, Any]]:
        yield {"nixl": self.nixl.record(), "outcomes": dict(self.outcomes),
               "hold_before_reply_s": self.hold_s}

    def _count(self, outcome: JobOutcome) -> None:
        self.outcomes[outcome.status] = self.outcomes.get(outcome.status, 0) + 1

    async def _reply(self, target: ReplyTarget, result: PrefillResult) -> PrefillAck:
        client = await self._callback(target.component, target.endpoint)
        stream = client.direct(msgspec.to_builtins(result), target.instance_id)
        try:
            async for msg in stream:
                return msgspec.convert(msg, PrefillAck)
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
        raise RequestPlaneError(f"{target.component}.{target.endpoint} answered nothing")

    async def _callback(self, component: str, name: str) -> EndpointClient:
        client = self._callbacks.get((component, name))
        if client is None:
            watch = await self.runtime.discovery.watch_instances(self.runtime.namespace,
                                                                 component, name)
            self._watches.append(watch)
            with contextlib.suppress(Exception):  # the target registered before enqueueing
                await watch.wait_for(1, timeout=2.0)
            client = self._callbacks[(component, name)] = EndpointClient(
                self.rpc, watch, component, name)
        return client

    async def _follow_settings(self) -> None:
        async for key, value in self.runtime.discovery.watch_prefix(self.runtime.settings_prefix()):
            self._apply_setting(key, value)

    def _apply_setting(self, key: str, value: Any | None) -> None:
        if not key.endswith("/" + HOLD_KEY):
            return
        try:
            self.hold_s = max(float(value), 0.0) if value is not None else 0.0
        except (TypeError, ValueError):
            log.warning("ignoring bad %s value %r", HOLD_KEY, value)
            return
        log.info("%s = %.1f", HOLD_KEY, self.hold_s)
