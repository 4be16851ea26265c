"""Frontend: the OpenAI-compatible HTTP server (FastAPI on uvicorn).

Validates requests and formats responses (``dynagraph.llm.http``); everything else
happens behind the Processor. ``/health`` is 200 only while a Processor and at least
one model worker are registered. A client that disconnects closes the stream, which
cancels the request in every component down to the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Generator

import uvicorn
from pydantic import Field

from components.processor import Processor
from dynagraph.config import ConfigModel
from dynagraph.errors import DynagraphError
from dynagraph.llm.http import create_app
from dynagraph.llm.protocol import OpenAIRequest, OpenAIRequestEnvelope, TextChunk
from dynagraph.runtime.discovery import InstanceWatch
from dynagraph.sdk import Component, async_on_shutdown, async_on_start, depends, service

log = logging.getLogger(__name__)


class FrontendConfig(ConfigModel):
    served_model_name: str = "tiny-llama"
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    """0 picks a free port (the URL is printed and published in discovery)."""
    max_model_len: int | None = None
    worker_component: str = "VllmWorker"
    """Component whose ``generate`` instances make /health green."""


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

    def ready(self) -> bool:
        workers = self._workers.instances() if self._workers is not None else []
        return bool(workers) and bool(self.processor.instance_ids())

    async def generate(self, request: OpenAIRequest, request_id: str) -> AsyncIterator[TextChunk]:
        envelope = OpenAIRequestEnvelope.wrap(request, request_id)
        stream = self.processor.generate(envelope.to_wire(),
                                         headers={"x-request-id": request_id})
        async with contextlib.aclosing(stream):
            async for raw in stream:
                yield TextChunk.from_wire(raw)

    @async_on_start
    async def start(self) -> None:
        self._workers = await self.runtime.discovery.watch_instances(
            self.runtime.namespace, self.config.worker_component, "generate")
        app = create_app(self, served_model_name=self.config.served_model_name,
                         max_model_len=self.config.max_model_len,
                         registry=self.runtime.registry)
        cfg = uvicorn.Config(app, host=self.config.host, port=self.config.port,
                             log_level="warning", access_log=False, lifespan="off")
        self._server = _Server(cfg)
        self._task = asyncio.create_task(self._server.serve())
        while not self._server.started:
            if self._task.done():
                raise DynagraphError(
                    f"Frontend could not listen on {self.config.host}:{self.config.port} "
                    "(port in use? set Frontend.port)")
            await asyncio.sleep(0.01)
        port = self._server.servers[0].sockets[0].getsockname()[1]
        url = f"http://{self.config.host}:{port}"
        self.runtime.metadata.update({"url": url, "model": self.config.served_model_name})
        log.info("OpenAI API at %s/v1 (model %s)", url, self.config.served_model_name)

    @async_on_shutdown
    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._task, 5)
        if self._workers is not None:
            await self._workers.close()
