"""A generation's response once the backend is streaming, and its accounting at the end.

:class:`ResponseWriter` (mixed into ``dynagraph.llm.http.routes.Routes``, which provides
its attributes) turns the backend's :class:`TextChunk` stream into the response body:
one JSON body (``_collect``), or SSE events (``_events``) through byte templates for
plain requests (one choice, text only) and :class:`ChoiceStreamEncoder` for the others.
An error after the first token becomes an SSE ``error`` event, not a status.

Whatever way a request ends (complete, failed, client gone), ``_finish`` runs exactly
once: it releases the admission slot, settles the tenant's token budget with the tokens
used and records the request's metrics. :class:`RequestState` carries what it needs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from dynagraph.errors import EngineError
from dynagraph.llm.http.asgi import Response
from dynagraph.llm.http.collect import ResponseCollector, expected_choices
from dynagraph.llm.http.errors import from_exception
from dynagraph.llm.http.metrics import ERROR, SUCCESS, FrontendMetrics, TenantMetrics
from dynagraph.llm.http.sse import (
    DONE,
    ChatStreamEncoder,
    ChoiceStreamEncoder,
    CompletionStreamEncoder,
    sse_error,
)
from dynagraph.llm.http.tenancy import TenantGate
from dynagraph.llm.protocol import (
    ChatCompletionRequest,
    Endpoint,
    ErrorResponse,
    OpenAIRequest,
    TextChunk,
    Usage,
)
from dynagraph.llm.tenants import TenantEntry

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class RequestState:
    """One generation request's bookkeeping, from its admission to ``_finish``."""

    request_id: str
    endpoint: Endpoint
    request_type: str
    start: float
    release: Callable[[], None] | None
    tenant: TenantEntry
    expected: int
    status: str = ERROR
    last: TextChunk | None = None


class ResponseWriter:
    """The response side of ``Routes`` (which provides these attributes)."""

    metrics: FrontendMetrics
    gate: TenantGate
    tenant_metrics: TenantMetrics | None

    async def _collect(
        self,
        stream: AsyncIterator[TextChunk],
        req: OpenAIRequest,
        request_id: str,
        state: RequestState,
    ) -> bytes:
        collector = ResponseCollector(req)
        async for chunk in stream:
            if state.last is None:
                self.metrics.ttft.observe(time.monotonic() - state.start)
            state.last = chunk
            collector.add(chunk)
            if collector.done:
                break
        return collector.encode(request_id, req.model)

    async def _events(
        self,
        stream: AsyncIterator[TextChunk],
        first: TextChunk,
        req: OpenAIRequest,
        request_id: str,
        state: RequestState,
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        include_usage = req.include_usage()
        chat = isinstance(req, ChatCompletionRequest)
        response_id = f"chatcmpl-{request_id}" if chat else f"cmpl-{request_id}"
        encoder: ChatStreamEncoder | CompletionStreamEncoder | None = None
        general: ChoiceStreamEncoder | None = None
        if not req.is_plain():
            general = ChoiceStreamEncoder("chat" if chat else "completion", response_id,
                                          req.model, created, include_usage=include_usage,
                                          continuous_usage=req.continuous_usage())
        elif chat:
            encoder = ChatStreamEncoder(response_id, req.model, created,
                                        include_usage=include_usage)
        else:
            encoder = CompletionStreamEncoder(response_id, req.model, created,
                                              include_usage=include_usage)
        itl = self.metrics.itl
        chunk = state.last = first
        remaining = expected_choices(req)
        last_at = time.monotonic()
        try:
            while True:
                if encoder is not None:
                    yield encoder.chunk(chunk.text, chunk.finish_reason)
                else:
                    assert general is not None
                    yield general.chunk(chunk)
                if chunk.finish_reason is not None:
                    remaining -= 1
                    if remaining == 0:
                        break
                next_chunk = await anext(stream, None)
                if next_chunk is None:
                    raise EngineError("the backend stream ended without a finish reason")
                now = time.monotonic()
                new_tokens = next_chunk.completion_tokens - chunk.completion_tokens
                if new_tokens > 0:
                    itl.observe((now - last_at) / new_tokens)
                    last_at = now
                chunk = state.last = next_chunk
            if include_usage:
                usage = Usage.of(chunk.prompt_tokens, chunk.completion_tokens, chunk.cached_tokens)
                yield (encoder or general).usage(usage)  # type: ignore[union-attr]
            yield DONE
            state.status = SUCCESS
        except Exception as exc:
            err = from_exception(exc)
            log.info("request %s failed mid-stream: %s", request_id, err.info.message)
            yield sse_error(ErrorResponse(error=err.info))

    async def _close_stream(
        self, stream: AsyncIterator[TextChunk], state: RequestState, disconnected: bool
    ) -> None:
        if disconnected:
            log.info("request %s: client disconnected mid-stream", state.request_id)
            self.metrics.disconnects.inc()
        await _aclose(stream)
        self._finish(state)

    async def _settle(
        self, stream: AsyncIterator[TextChunk] | None, state: RequestState, response: Response
    ) -> Response:
        """Close the backend stream, record the request's metrics, return ``response``."""
        await _aclose(stream)
        self._finish(state)
        return response

    def _finish(self, state: RequestState) -> None:
        if state.release is not None:
            state.release()
        last = state.last
        used = last.prompt_tokens + last.completion_tokens if last is not None else 0
        self.gate.settle(state.tenant, state.expected, used)
        if self.tenant_metrics is not None:
            self.tenant_metrics.finished(state.tenant.tenant, state.status, last)
        metrics = self.metrics
        metrics.inflight.dec()
        metrics.count_request(state.endpoint, state.request_type, state.status)
        metrics.duration.observe(time.monotonic() - state.start)
        if state.last is not None:
            metrics.input_tokens.observe(state.last.prompt_tokens)
            metrics.output_tokens.observe(state.last.completion_tokens)


async def _aclose(stream: AsyncIterator[TextChunk] | None) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()

