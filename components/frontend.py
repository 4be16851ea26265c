"""Frontend: the OpenAI-compatible HTTP server (a plain ASGI app on uvicorn).

Validates requests and formats responses (``dynagraph.llm.http``); everything else
happens behind the Processor. ``/health`` is 200 only while a Processor and at least
one model worker are registered. ``/v1/models`` lists the models the live workers
publish (``dynagraph.llm.models``); a request for any other model is a 404. A client
that disconnects closes the stream, which cancels the request in every component down
to the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Generator
from typing import Any

import uvicorn
from pydantic import Field

from components.processor import Processor
from dynagraph.errors import ConfigError, DynagraphError, InstanceUnavailable, NoInstancesError
from dynagraph.llm.http import create_app
from dynagraph.llm.http.admission import Admission
from dynagraph.llm.http.backend import ModelInfo
from dynagraph.llm.http.limits import RequestLimits
from dynagraph.llm.http.metrics import FrontendMetrics
from dynagraph.llm.http.tenancy import TenantGate
from dynagraph.llm.migration import Attempt
from dynagraph.llm.models import ModelDirectory
from dynagraph.llm.protocol import (
    OpenAIRequest,
    OpenAIRequestEnvelope,
    TextChunk,
    TokenizeEnvelope,
    TokenizeKind,
)
from dynagraph.llm.resume import resuming
from dynagraph.llm.tenants import SECRET_ENV, Authenticator, Signer, TenantToken
from dynagraph.llm.tenants.slo import SloClass, default_slo_classes
from dynagraph.runtime.addresses import advertised
from dynagraph.runtime.discovery import InstanceWatch
from dynagraph.runtime.round_robin import RoundRobin
from dynagraph.sdk import (
    Component,
    async_on_shutdown,
    async_on_start,
    depends,
    direct,
    failover,
    instance_ids,
    instances,
    nearest,
    service,
    wait_for_instances,
)

log = logging.getLogger(__name__)


class FrontendConfig(RequestLimits):
    """The Frontend's keys; the request limits (``RequestLimits``: max-body-bytes,
    max-prompt-bytes, max-messages, max-stop, max-n, ...) are its keys too."""

    served_model_name: str = "tiny-llama"
    """Labels the metrics; also the model name of workers that publish none."""
    host: str = "127.0.0.1"
    """Where the HTTP server listens; 0.0.0.0 publishes this host's address (``--host``)."""
    port: int = Field(default=8000, ge=0, le=65535)
    """0 picks a free port (the URL is printed and published in discovery)."""
    max_model_len: int | None = None
    """Context length of models whose workers publish none."""
    worker_component: str = "VllmWorker"
    """Component whose ``generate`` instances make /health green."""
    max_inflight_requests: int = Field(default=256, ge=1)
    """Generation requests served at once; more wait in the admission queue."""
    max_queued_requests: int = Field(default=512, ge=0)
    """Requests waiting for a slot; past that, 429 with Retry-After at once."""
    reserved_inflight_requests: int = Field(default=32, ge=0)
    """With a tenants file: of ``max-inflight-requests``, this many only for the top SLO
    class (the lowest priority number), so batch work cannot hold every slot while
    interactive requests wait behind it (at most ``max-inflight-requests`` - 1)."""
    queue_timeout: float = Field(default=30.0, ge=0.0)
    """Seconds a request may wait for a slot before it gets a 429."""
    keep_alive_timeout: int = Field(default=75, gt=0)
    """Seconds an idle client connection stays open. Longer than clients keep theirs
    (aiohttp 15 s, browsers ~60 s), so a client never sends a request on a connection the
    server is closing that instant (uvicorn's 5 s default lost one request of a replayed
    trace that paused for ~5 s: "Can not write request body")."""
    migration_limit: int = Field(default=3, ge=0)
    """How many times one request may move to another Processor after its Processor failed
    mid-stream (``dynagraph.llm.resume``); 0 turns it off."""
    worker_wait: float = Field(default=10.0, ge=0.0)
    """Seconds a request waits while no model worker is registered, then 503."""
    tenants_file: str | None = None
    """YAML: API key -> tenant (``dynagraph.llm.tenants.registry``). Set: every API call
    needs ``Authorization: Bearer KEY``, each tenant has its own prefix cache and quotas.
    Unset: an open service."""
    slo_classes: dict[str, SloClass] = Field(default_factory=default_slo_classes)
    """SLO classes by name (a tenant's ``slo-class``, or the ``x-slo-class`` header)."""


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield  # the component process owns SIGINT/SIGTERM


@service(dynamo={"namespace": "dynamo"}, resources={"cpu": 1}, workers=1)
class Frontend(Component):
    processor = depends(Processor)

    def __init__(self, config: FrontendConfig) -> None:
        self.config = config
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None
        self._workers: InstanceWatch | None = None
        self._models = ModelDirectory(config.served_model_name)
        self._rr = RoundRobin()
        self._metrics: FrontendMetrics | None = None

    def ready(self) -> bool:
        workers = self._workers.instances() if self._workers is not None else []
        return bool(workers) and bool(instance_ids(self.processor.generate))

    def models(self) -> list[ModelInfo]:
        workers = self._workers.instances() if self._workers is not None else []
        return [ModelInfo(m.name, m.max_model_len)
                for m in self._models.models(workers).values()]

    async def tokenize(self, kind: TokenizeKind, model: str, body: dict[str, Any]
                       ) -> dict[str, Any]:
        envelope = TokenizeEnvelope(kind=kind, model=model, body=body)
        stream = self.processor.tokenize(envelope)
        async with contextlib.aclosing(stream):
            async for answer in stream:
                return answer.body()
        raise DynagraphError("the Processor gave no tokenize answer")

    async def generate(self, request: OpenAIRequest, request_id: str,
                       tenant: TenantToken | None = None) -> AsyncIterator[TextChunk]:
        envelope = OpenAIRequestEnvelope.wrap(request, request_id, tenant)
        stream = resuming(envelope, self._on_processor, limit=self.config.migration_limit,
                          on_migrate=self._migrated)
        async with contextlib.aclosing(stream):
            async for chunk in stream:
                yield chunk

    def _on_processor(self, envelope: OpenAIRequestEnvelope, attempt: Attempt
                      ) -> AsyncGenerator[TextChunk, None]:
        """``envelope``'s stream from a Processor ``attempt`` allows (one in this process
        first, else the next in turn), or from the others if it fails before its first
        chunk. The one in use is ``attempt.worker``."""
        endpoint = self.processor.generate
        order = iter(attempt.allowed(self._rr.order(
            [i.instance_id for i in nearest(instances(endpoint))])))

        async def next_processor(failed: list[int]) -> int | None:
            if not failed and not instances(endpoint):
                await wait_for_instances(endpoint)  # right after start-up
                nonlocal order
                order = iter(attempt.allowed(self._rr.order(
                    [i.instance_id for i in nearest(instances(endpoint))])))
            attempt.worker = next(order, None)
            return attempt.worker

        def retrying(p: int, exc: Exception) -> None:
            attempt.failed(p)
            log.warning("Processor %x could not take request %s (%s); trying another", p,
                        envelope.request_id, exc)

        def exhausted(last: Exception | None) -> Exception:
            return last or NoInstancesError("no live Processor to send the request to")

        headers = {"x-request-id": envelope.request_id}
        return failover(next_processor, lambda p: direct(endpoint, envelope, p, headers=headers),
                        retry_on=(InstanceUnavailable, NoInstancesError), exhausted=exhausted,
                        on_retry=retrying)

    def _migrated(self, processor: int | None, failure: Exception) -> None:
        if self._metrics is not None:
            self._metrics.migrated(processor, failure)

    @async_on_start
    async def start(self) -> None:
        self._workers = await self.runtime.discovery.watch_instances(
            self.runtime.namespace, self.config.worker_component, "generate")
        cfg_ = self.config
        app = create_app(self, served_model_name=cfg_.served_model_name,
                         max_model_len=cfg_.max_model_len, registry=self.runtime.registry,
                         limits=RequestLimits.model_validate(
                             cfg_.model_dump(include=set(RequestLimits.model_fields))),
                         admission=self._admission(),
                         worker_wait_s=cfg_.worker_wait, tenants=self._tenant_gate())
        self._metrics = app.state.metrics
        cfg = uvicorn.Config(app, host=self.config.host, port=self.config.port,
                             log_level="warning", access_log=False, lifespan="off",
                             timeout_keep_alive=self.config.keep_alive_timeout)
        self._server = _Server(cfg)
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                raise DynagraphError(
                    f"Frontend could not listen on {self.config.host}:{self.config.port} "
                    "(port in use? set Frontend.port)")
            await asyncio.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        url = f"http://{advertised(self.config.host)}:{port}"
        self.runtime.metadata.update({"url": url, "model": self.config.served_model_name})
        log.info("OpenAI API at %s/v1 (model %s)", url, self.config.served_model_name)

    def _admission(self) -> Admission:
        cfg = self.config
        reserved = 0
        if cfg.tenants_file is not None:  # an open service's requests are all one class
            reserved = min(cfg.reserved_inflight_requests, cfg.max_inflight_requests - 1)
        return Admission(max_inflight=cfg.max_inflight_requests,
                         max_queued=cfg.max_queued_requests, queue_timeout=cfg.queue_timeout,
                         reserved=reserved,
                         top_priority=min((c.priority for c in cfg.slo_classes.values()),
                                          default=0))

    def _tenant_gate(self) -> TenantGate:
        signer = Signer.from_env()
        auth = None
        if self.config.tenants_file is not None:
            if signer is None:
                raise ConfigError(f"tenants need the graph secret ({SECRET_ENV}; dynamo serve "
                                  "sets one)", component="Frontend", key="tenants-file")
            try:
                auth = Authenticator(self.config.tenants_file)
            except ConfigError as exc:
                raise ConfigError(str(exc), component="Frontend", key="tenants-file") from None
            log.info("tenants: %s (API keys required)", ", ".join(auth.tenants))
        return TenantGate(auth, signer,
                          {name: c.priority for name, c in self.config.slo_classes.items()})

    @async_on_shutdown
    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._task, 5)
        if self._workers is not None:
            await self._workers.close()
