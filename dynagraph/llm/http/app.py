"""The OpenAI-compatible HTTP app: routes, SSE streaming, errors and frontend metrics.

The app only validates and formats. Everything model-specific (templating,
tokenization, detokenization, stop strings) happens behind :class:`Backend`, which the
Frontend component implements by calling the Processor.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from functools import partial
from typing import Protocol

import msgspec
from fastapi import FastAPI, Request
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from dynagraph.errors import EngineError
from dynagraph.llm.http.errors import (
    HTTPError,
    error_response,
    from_exception,
    from_validation_error,
    json_response,
)
from dynagraph.llm.http.sse import (
    DONE,
    ChatStreamEncoder,
    ClientDisconnected,
    CompletionStreamEncoder,
    DisconnectWatch,
    SSEResponse,
    sse_error,
)
from dynagraph.llm.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Endpoint,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    OpenAIRequest,
    TextChunk,
    Usage,
)
from dynagraph.observability.frontend_metrics import ERROR, STREAM, SUCCESS, UNARY, FrontendMetrics

log = logging.getLogger(__name__)

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


class Backend(Protocol):
    """What the HTTP app needs from the serving graph (the Frontend implements it)."""

    def ready(self) -> bool:
        """True when at least one model worker can take requests (drives ``/health``)."""
        ...

    def generate(self, request: OpenAIRequest, request_id: str) -> AsyncIterator[TextChunk]:
        """Stream the response text for one validated request.

        The last chunk has ``finish_reason`` set and the final usage counts. Errors are
        raised from the iterator: ``InvalidRequest``/``PromptTooLong`` become 400,
        ``NoInstancesError`` 503, anything else 500. The app closes the iterator
        (``aclose``) early when the client disconnects, cancelling the request.
        """
        ...


def create_app(
    backend: Backend,
    *,
    served_model_name: str,
    max_model_len: int | None = None,
    registry: CollectorRegistry | None = None,
) -> FastAPI:
    """Build the app. Metrics go into ``registry`` (a fresh one if None), served at
    ``/metrics``; ``app.state.registry`` and ``app.state.metrics`` expose them."""
    registry = registry if registry is not None else CollectorRegistry()
    metrics = FrontendMetrics(registry, served_model_name)
    routes = _Routes(backend, metrics, served_model_name, max_model_len)
    app = FastAPI(title="dynagraph", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.registry = registry
    app.state.metrics = metrics

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await routes.generate(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await routes.generate(request, "completion")

    @app.get("/v1/models")
    async def models() -> Response:
        card = ModelCard(id=served_model_name, created=routes.created, max_model_len=max_model_len)
        return json_response(200, ModelList(data=[card]))

    @app.get("/health")
    async def health() -> Response:
        if backend.ready():
            return Response(b'{"status":"healthy"}', media_type="application/json")
        info = ErrorInfo(
            message="no model worker is ready", type="service_unavailable", code="no_instances"
        )
        return error_response(503, info)

    @app.get("/metrics")
    async def metrics_route() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_PLAIN_0_0_4)

    @app.exception_handler(StarletteHTTPException)
    async def http_exception(request: Request, exc: StarletteHTTPException) -> Response:
        info = ErrorInfo(
            message=f"{request.method} {request.url.path}: {exc.detail}",
            type="invalid_request_error",
            code="not_found" if exc.status_code == 404 else None,
        )
        return error_response(exc.status_code, info, exc.headers)

    return app


class _RequestState:
    __slots__ = ("request_id", "endpoint", "request_type", "start", "status", "last")

    def __init__(
        self, request_id: str, endpoint: Endpoint, request_type: str, start: float
    ) -> None:
        self.request_id = request_id
        self.endpoint = endpoint
        self.request_type = request_type
        self.start = start
        self.status = ERROR
        self.last: TextChunk | None = None


class _Routes:
    def __init__(
        self,
        backend: Backend,
        metrics: FrontendMetrics,
        model: str,
        max_model_len: int | None,
    ) -> None:
        self.backend = backend
        self.metrics = metrics
        self.model = model
        self.max_model_len = max_model_len
        self.created = int(time.time())

    async def generate(self, request: Request, endpoint: Endpoint) -> Response:
        start = time.monotonic()
        header_id = request.headers.get("x-request-id")
        request_id = header_id if header_id and _REQUEST_ID.fullmatch(header_id) else _new_id()
        headers = {"x-request-id": request_id}
        try:
            parsed = self._parse(await request.body(), endpoint)
        except HTTPError as err:
            self.metrics.count_request(endpoint, UNARY, ERROR)
            return error_response(err.status, err.info, headers)

        state = _RequestState(request_id, endpoint, STREAM if parsed.stream else UNARY, start)
        self.metrics.inflight.inc()
        stream: AsyncIterator[TextChunk] | None = None
        try:
            stream = self.backend.generate(parsed, request_id)
            if parsed.stream:
                async with DisconnectWatch(request.receive):
                    first = await _first(stream)
                self.metrics.ttft.observe(time.monotonic() - start)
                return SSEResponse(
                    self._events(stream, first, parsed, request_id, state),
                    headers=headers,
                    on_close=partial(self._close_stream, stream, state),
                )
            async with DisconnectWatch(request.receive):
                body = await self._collect(stream, parsed, request_id, state)
            state.status = SUCCESS
            return await self._settle(
                stream, state, Response(body, headers=headers, media_type="application/json")
            )
        except ClientDisconnected:
            log.info("request %s: client disconnected before the first token", request_id)
            self.metrics.disconnects.inc()
            return await self._settle(stream, state, Response(status_code=499, headers=headers))
        except Exception as exc:
            failure = from_exception(exc)
            log.info(
                "request %s failed with %d: %s", request_id, failure.status, failure.info.message
            )
            response = error_response(failure.status, failure.info, headers)
            return await self._settle(stream, state, response)

    def _parse(self, body: bytes, endpoint: Endpoint) -> OpenAIRequest:
        model_cls = ChatCompletionRequest if endpoint == "chat" else CompletionRequest
        try:
            parsed: OpenAIRequest = model_cls.model_validate_json(body)
        except ValidationError as exc:
            raise from_validation_error(exc) from exc
        if parsed.model != self.model:
            raise HTTPError(
                404,
                f"the model {parsed.model!r} does not exist; this server serves {self.model!r}",
                param="model",
                code="model_not_found",
            )
        requested = parsed.requested_max_tokens()
        if self.max_model_len is not None and requested is not None:
            if requested >= self.max_model_len:
                raise HTTPError(
                    400,
                    f"max_tokens ({requested}) must be smaller than the model's context "
                    f"length ({self.max_model_len})",
                    param="max_tokens",
                    code="context_length_exceeded",
                )
        return parsed

    async def _collect(
        self,
        stream: AsyncIterator[TextChunk],
        req: OpenAIRequest,
        request_id: str,
        state: _RequestState,
    ) -> bytes:
        parts: list[str] = []
        async for chunk in stream:
            if state.last is None:
                self.metrics.ttft.observe(time.monotonic() - state.start)
            state.last = chunk
            parts.append(chunk.text)
            if chunk.finish_reason is not None:
                break
        last = state.last
        if last is None or last.finish_reason is None:
            raise EngineError("the backend stream ended without a finish reason")
        text = "".join(parts)
        usage = Usage.of(last.prompt_tokens, last.completion_tokens, last.cached_tokens)
        created = int(time.time())
        response: ChatCompletionResponse | CompletionResponse
        if isinstance(req, ChatCompletionRequest):
            message = ChatResponseMessage(content=text)
            choice = ChatChoice(index=0, message=message, finish_reason=last.finish_reason)
            response = ChatCompletionResponse(
                id=f"chatcmpl-{request_id}", created=created, model=self.model,
                choices=[choice], usage=usage,
            )  # fmt: skip
        else:
            completion = CompletionChoice(index=0, text=text, finish_reason=last.finish_reason)
            response = CompletionResponse(
                id=f"cmpl-{request_id}", created=created, model=self.model,
                choices=[completion], usage=usage,
            )  # fmt: skip
        return _encode_json(response)

    async def _events(
        self,
        stream: AsyncIterator[TextChunk],
        first: TextChunk,
        req: OpenAIRequest,
        request_id: str,
        state: _RequestState,
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        include_usage = req.include_usage()
        encoder: ChatStreamEncoder | CompletionStreamEncoder
        if isinstance(req, ChatCompletionRequest):
            encoder = ChatStreamEncoder(
                f"chatcmpl-{request_id}", self.model, created, include_usage=include_usage
            )
        else:
            encoder = CompletionStreamEncoder(
                f"cmpl-{request_id}", self.model, created, include_usage=include_usage
            )
        itl = self.metrics.itl
        chunk = state.last = first
        try:
            yield encoder.chunk(chunk.text, chunk.finish_reason)
            last_at = time.monotonic()
            while chunk.finish_reason is None:
                next_chunk = await anext(stream, None)
                if next_chunk is None:
                    raise EngineError("the backend stream ended without a finish reason")
                now = time.monotonic()
                new_tokens = next_chunk.completion_tokens - chunk.completion_tokens
                if new_tokens > 0:
                    itl.observe((now - last_at) / new_tokens)
                    last_at = now
                chunk = state.last = next_chunk
                yield encoder.chunk(chunk.text, chunk.finish_reason)
            if include_usage:
                yield encoder.usage(
                    Usage.of(chunk.prompt_tokens, chunk.completion_tokens, chunk.cached_tokens)
                )
            yield DONE
            state.status = SUCCESS
        except Exception as exc:
            err = from_exception(exc)
            log.info("request %s failed mid-stream: %s", request_id, err.info.message)
            yield sse_error(ErrorResponse(error=err.info))

    async def _close_stream(
        self, stream: AsyncIterator[TextChunk], state: _RequestState, disconnected: bool
    ) -> None:
        if disconnected:
            log.info("request %s: client disconnected mid-stream", state.request_id)
            self.metrics.disconnects.inc()
        await _aclose(stream)
        self._finish(state)

    async def _settle(
        self, stream: AsyncIterator[TextChunk] | None, state: _RequestState, response: Response
    ) -> Response:
        """Close the backend stream, record the request's metrics, return ``response``."""
        await _aclose(stream)
        self._finish(state)
        return response

    def _finish(self, state: _RequestState) -> None:
        metrics = self.metrics
        metrics.inflight.dec()
        metrics.count_request(state.endpoint, state.request_type, state.status)
        metrics.duration.observe(time.monotonic() - state.start)
        if state.last is not None:
            metrics.input_tokens.observe(state.last.prompt_tokens)
            metrics.output_tokens.observe(state.last.completion_tokens)


async def _first(stream: AsyncIterator[TextChunk]) -> TextChunk:
    chunk = await anext(stream, None)
    if chunk is None:
        raise EngineError("the backend stream ended without any output")
    return chunk


async def _aclose(stream: AsyncIterator[TextChunk] | None) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


def _new_id() -> str:
    return uuid.uuid4().hex


def _encode_json(value: ChatCompletionResponse | CompletionResponse) -> bytes:
    return msgspec.json.encode(value)
