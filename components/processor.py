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
import functools
import logging
from collections.abc import AsyncIterator
from typing import Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field

from components.kv_router import Router, RouteRequest
from components.worker import VllmWorker
from dynagraph.errors import (
    InstanceUnavailable,
    NoInstancesError,
    RequestPlaneError,
    StreamBroken,
)
from dynagraph.llm.detokenize import detokenize_stream
from dynagraph.llm.preprocess import Preprocessor
from dynagraph.llm.protocol import OpenAIRequestEnvelope
from dynagraph.llm.router import RouterMode
from dynagraph.llm.tokenizer import Tokenizer
from dynagraph.observability.processor_metrics import ProcessorMetrics
from dynagraph.sdk import depends, endpoint, service

log = logging.getLogger(__name__)


@functools.cache
def _metrics() -> ProcessorMetrics:
    """One set per process: the default registry refuses a second registration."""
    return ProcessorMetrics()


def _kebab(name: str) -> str:
    return name.replace("_", "-")


class ProcessorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", alias_generator=_kebab, validate_by_name=True,
                              validate_by_alias=True)

    model: str
    """Model directory: the tokenizer and chat template come from here."""
    max_model_len: int | None = Field(default=None, ge=16)
    """Context length (prompt + completion); longer prompts are refused with 400."""
    router_mode: Literal["round-robin", "random", "kv", "kv-load"] = "round-robin"
    router_timeout: float = Field(default=2.0, gt=0.0)
    """Seconds to wait for the Router's decision before falling back to round robin."""


@service(dynamo={"namespace": "dynamo"}, resources={"cpu": 1}, workers=1)
class Processor:
    router = depends(Router)
    worker = depends(VllmWorker)

    def __init__(self, config: ProcessorConfig) -> None:
        self.config = config
        self.preprocessor = Preprocessor(Tokenizer.from_dir(config.model),
                                         max_model_len=config.max_model_len)
        self._rr = 0
        self.metrics = _metrics()
        self.use_router = config.router_mode in ("kv", "kv-load")
        if self.use_router and getattr(self, "router", None) is None:
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
        try:
            chosen: int | None = None
            try:
                async with asyncio.timeout(self.config.router_timeout):
                    chosen = int((await anext(route))["worker_id"])
            except (RequestPlaneError, TimeoutError, StopAsyncIteration, KeyError) as exc:
                log.warning("Router gave no decision (%s: %s); routing round robin",
                            type(exc).__name__, exc)
            async for item in self._first_reachable(wire, chosen):
                yield item
        finally:
            await route.aclose()  # type: ignore[attr-defined]

    async def _first_reachable(self, wire: dict[str, Any], chosen: int | None
                               ) -> AsyncIterator[Any]:
        """Stream from ``chosen``; if it fails before its first output, from the others.

        Retrying is safe then: nothing reached the client yet, and a prompt's output does
        not depend on which worker computes it. A failure after the first output is
        raised as is.
        """
        self._rr += 1
        live = self.worker.instance_ids()
        others = live[self._rr % len(live):] + live[:self._rr % len(live)] if live else []
        order = ([chosen] if chosen is not None else []) + [w for w in others if w != chosen]
        last: Exception | None = None
        for w in order:
            stream = self.worker.direct(wire, w)
            try:
                try:
                    first = await anext(stream)
                except StopAsyncIteration:
                    return
                except (InstanceUnavailable, NoInstancesError, StreamBroken) as exc:
                    log.warning("worker %x failed before its first output (%s); trying "
                                "another", w, exc)
                    last = exc
                    continue
                yield first
                async for item in stream:
                    yield item
                return
            finally:
                await stream.aclose()  # type: ignore[attr-defined]
        raise last or NoInstancesError("no live VllmWorker to route to")
