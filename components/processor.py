"""Processor: OpenAI request in, text chunks out.

Applies the chat template and tokenizes (``Preprocessor``), picks a worker, streams
the worker's token ids back through the incremental detokenizer (stop strings, finish
reason, usage) and yields ``TextChunk``s to the Frontend.

Picking a worker (``router-mode``):

- ``round-robin`` / ``random``: among live workers, here in the Processor.
- ``kv`` / ``kv-load``: ask the Router (``components/kv_router.py``, linked in the
  ``*_router`` graphs) with the prompt's token ids, then call the chosen worker with
  ``direct()``. The Router's stream stays open until the request ends, so the Router
  counts it as in flight. The mode is passed as a default: a mode set live in etcd
  (``/{ns}/settings/Router/mode``) wins. If the Router is not linked, fails or does
  not answer within ``router-timeout`` s, the request goes round robin; if the chosen
  worker fails before its first output (dead, unreachable), the next live worker is
  tried (logged; the client sees no error).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from typing import Any, Literal

import msgspec
from pydantic import Field

from components.kv_router import Router
from components.worker import VllmWorker
from dynagraph.config import ConfigModel
from dynagraph.errors import (
    InstanceUnavailable,
    NoInstancesError,
    RequestPlaneError,
    StreamBroken,
)
from dynagraph.llm.detokenize import detokenize_stream
from dynagraph.llm.preprocess import Preprocessor
from dynagraph.llm.protocol import OpenAIRequestEnvelope
from dynagraph.llm.router import RouteDecision, RouteRequest, RouterMode
from dynagraph.llm.tokenizer import Tokenizer
from dynagraph.observability.processor_metrics import ProcessorMetrics
from dynagraph.runtime.round_robin import RoundRobin
from dynagraph.sdk import Component, depends, endpoint, failover, service

log = logging.getLogger(__name__)


class ProcessorConfig(ConfigModel):
    model: str
    """Model directory: the tokenizer and chat template come from here."""
    max_model_len: int | None = Field(default=None, ge=16)
    """Context length (prompt + completion); longer prompts are refused with 400."""
    router_mode: Literal["round-robin", "random", "kv", "kv-load"] = "round-robin"
    router_timeout: float = Field(default=2.0, gt=0.0)
    """Seconds to wait for the Router's decision before falling back to round robin."""


@service(dynamo={"namespace": "dynamo"}, resources={"cpu": 1}, workers=1)
class Processor(Component):
    router = depends(Router)
    worker = depends(VllmWorker)

    def __init__(self, config: ProcessorConfig) -> None:
        self.config = config
        self.preprocessor = Preprocessor(Tokenizer.from_dir(config.model),
                                         max_model_len=config.max_model_len)
        self._rr = RoundRobin()
        self.metrics = ProcessorMetrics(self.runtime.registry)
        self.use_router = config.router_mode in ("kv", "kv-load")
        if self.use_router and self.router is None:
            log.warning("router-mode %s needs a Router in the graph; routing round robin",
                        config.router_mode)
            self.use_router = False

    @endpoint()
    async def generate(self, request: OpenAIRequestEnvelope) -> AsyncIterator[dict[str, Any]]:
        timer = self.metrics.request()
        try:
            with timer.tokenizing():
                pre = self.preprocessor.preprocess(request.unwrap(), request.request_id)
            detok = timer.timed(self.preprocessor.detokenizer(pre))
            timer.dispatched()
            if self.use_router:
                stream = self._routed(pre.to_wire(), pre.token_ids)
            elif self.config.router_mode == "random":
                stream = self.worker.random(pre.to_wire())
            else:
                stream = self.worker.generate(pre.to_wire())
            async with contextlib.aclosing(detokenize_stream(detok, stream)) as chunks:
                async for chunk in chunks:
                    yield chunk.to_wire()
        finally:
            timer.finished()

    async def _routed(self, wire: dict[str, Any], token_ids: list[int]) -> AsyncIterator[Any]:
        """The worker's stream for ``wire``, on the worker the Router picks."""
        ask = RouteRequest(token_ids, track=True, mode=RouterMode(self.config.router_mode))
        route = self.router.generate(msgspec.to_builtins(ask))
        async with contextlib.aclosing(route):
            chosen: int | None = None
            try:
                async with asyncio.timeout(self.config.router_timeout):
                    chosen = msgspec.convert(await anext(route), RouteDecision).worker_id
            except (RequestPlaneError, TimeoutError, StopAsyncIteration,
                    msgspec.ValidationError) as exc:
                log.warning("Router gave no decision (%s: %s); routing round robin",
                            type(exc).__name__, exc)
            stream = self._first_reachable(wire, chosen)
            async with contextlib.aclosing(stream):
                async for item in stream:
                    yield item

    def _first_reachable(self, wire: dict[str, Any], chosen: int | None
                         ) -> AsyncGenerator[Any, None]:
        """Stream from ``chosen``; if it fails before its first output, from the others
        (round robin). A failure after the first output is raised as is."""
        others = [w for w in self._rr.order(self.worker.instance_ids()) if w != chosen]
        order: Iterator[int] = iter(([chosen] if chosen is not None else []) + others)

        async def next_worker(failed: list[int]) -> int | None:
            return next(order, None)

        def retrying(w: int, exc: Exception) -> None:
            log.warning("worker %x failed before its first output (%s); trying another", w, exc)

        def exhausted(last: Exception | None) -> Exception:
            return last or NoInstancesError("no live VllmWorker to route to")

        return failover(next_worker, lambda w: self.worker.direct(wire, w),
                        retry_on=(InstanceUnavailable, NoInstancesError, StreamBroken),
                        exhausted=exhausted, on_retry=retrying)
