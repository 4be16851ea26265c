"""MockerPrefillWorker: a prefill worker on the simulated engine.

A drop-in for ``PrefillWorker`` (``@service(stands_in_for=PrefillWorker)``) in graphs
whose decode workers are ``MockerWorker``s (``graphs/mocker_disagg.py``). It runs the real
prefill path: jobs from the prefill queue (NATS JetStream, ``NatsPrefillQueue``), the
shared ``PrefillJobHandler`` (prefill with ``max_tokens=1`` and ``do_remote_decode``,
call the decode worker's ``prefill_done``, ack only after that) and ``serve_queue``.
The engine is a ``MockerEngine`` that holds a finished prefill's blocks for the decode
side, which waits out the simulated transfer and then calls ``kv_fetched`` here so the
blocks are freed (vLLM's NixlConnector frees them on the decode side's notification;
``kv-lease-seconds`` is the fallback).

``engines-per-process: N`` runs N prefill engines in one process, each its own instance
pulling from the shared queue.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator

import msgspec
from pydantic import Field

from components.prefill_worker import PrefillStatus, PrefillStatusReport, PrefillWorker
from dynagraph.aio import cancel_and_wait
from dynagraph.llm.disagg import (
    DisaggWorkerKeys,
    JobOutcome,
    PrefillAck,
    PrefillJobHandler,
    reply_through,
    serve_queue,
)
from dynagraph.llm.disagg.metrics import PrefillQueueMetrics
from dynagraph.llm.engines.mocker import MockerEngine, MockerEngineArgs
from dynagraph.llm.engines.mocker.serving import engine_args
from dynagraph.runtime.queue import NatsPrefillQueue, PrefillQueue
from dynagraph.sdk import Component, async_on_shutdown, async_on_start, endpoint, service

log = logging.getLogger(__name__)

DRAIN_S = 5.0
"""Upper bound on finishing the jobs in hand when stopping (within the shutdown hook's
10 s); a job not finished is delivered again to another prefill worker."""

KV_FETCHED_ENDPOINT = "kv_fetched"
"""The endpoint a decode worker calls once it has (simulated) read a prefill's blocks."""


class KvFetched(msgspec.Struct, frozen=True, kw_only=True):
    """Decode worker -> MockerPrefillWorker: the KV of ``request_id`` (the prefill
    engine's request id, ``remote_request_id`` in the transfer params) was read."""

    request_id: str


class MockerPrefillWorkerConfig(MockerEngineArgs, DisaggWorkerKeys):
    """The simulated engine's settings, the keys shared with the decode workers
    (``DisaggWorkerKeys``; ``nixl-progress-delay-us`` has no effect here) and the queue
    consumer's; kebab-case in YAML."""

    model: str | None = None
    """Model directory whose tokenizer gives the output vocabulary (see MockerWorker)."""
    max_concurrent_prefills: int = Field(default=2, ge=1)
    """Jobs prefilled at once (the engine batches them)."""
    reply_timeout: float = Field(default=10.0, gt=0)
    """Upper bound on the call to the decode worker's ``prefill_done``."""
    engines_per_process: int = Field(default=1, ge=1, le=1024)
    """Engines one process runs, each its own instance in discovery."""


@service(dynamo={"namespace": "dynamo"}, resources={"cpu": 1}, workers=1,
         stands_in_for=PrefillWorker, instances_key="engines-per-process")
class MockerPrefillWorker(Component):
    def __init__(self, config: MockerPrefillWorkerConfig) -> None:
        self.config = config
        rt = self.runtime
        self.engine = MockerEngine(engine_args(config, f"{rt.component}-{rt.instance_id:x}"))
        self.queue: PrefillQueue | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()
        self.outcomes: dict[str, int] = {}

    @async_on_start
    async def start(self) -> None:
        rt = self.runtime
        if self.queue is None:  # tests may set an in-memory one before start()
            if rt.nats_url is None:
                raise RuntimeError("MockerPrefillWorker needs NATS (NATS_SERVER) for the "
                                   "prefill queue")
            self.queue = NatsPrefillQueue(
                rt.nats_url, rt.namespace, ack_wait=self.config.prefill_queue_ack_wait,
                max_deliver=self.config.prefill_queue_max_deliver,
            )
        await self.engine.start()
        await self.queue.connect()
        handler = PrefillJobHandler(
            self.engine, reply_through(rt), instance_id=rt.instance_id,
            heartbeat_s=self.config.prefill_queue_ack_wait / 3,
            reply_timeout=self.config.reply_timeout, observer=PrefillQueueMetrics(rt.registry),
        )
        self._tasks = [asyncio.create_task(
            serve_queue(self.queue, handler, concurrency=self.config.max_concurrent_prefills,
                        on_outcome=self._count, stopping=self._stopping,
                        drain_s=DRAIN_S), name="prefill-queue")]
        rt.metadata.update({"engine": "mocker", "engine_id": self.engine.engine_id,
                            "profile": self.engine.profile.name})
        log.debug("mocker prefill engine %s serving the prefill queue", self.engine.engine_id)

    @async_on_shutdown
    async def stop(self) -> None:
        self._stopping.set()  # finish the jobs in hand (a scale-down), pull no more
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=DRAIN_S + 1)
        await cancel_and_wait(self._tasks, timeout=10)
        if self.queue is not None:
            await self.queue.close()
        await self.engine.shutdown()

    @endpoint()
    async def status(self, request: PrefillStatus
                     ) -> AsyncGenerator[PrefillStatusReport, None]:
        yield PrefillStatusReport(outcomes=dict(self.outcomes), engine_id=self.engine.engine_id,
                                  load=self.engine.load().model_dump())

    @endpoint()
    async def kv_fetched(self, request: KvFetched) -> AsyncGenerator[PrefillAck, None]:
        """The decode side read ``request.request_id``'s blocks: free them (``accepted``:
        they were this engine's and still held)."""
        yield PrefillAck(accepted=self.engine.release_transfer(request.request_id))

    def _count(self, outcome: JobOutcome) -> None:
        self.outcomes[outcome.status] = self.outcomes.get(outcome.status, 0) + 1
