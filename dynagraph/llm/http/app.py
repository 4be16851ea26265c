"""The OpenAI-compatible HTTP app: routes, SSE streaming, errors and frontend metrics.

The app only validates and formats. Everything model-specific (templating,
tokenization, detokenization, stop strings, tool parsing, logprob text) happens behind
:class:`Backend`, which the Frontend component implements by calling the Processor.

Routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models`` (the models live
workers serve), ``/tokenize`` and ``/detokenize`` (vLLM's), ``/health``, ``/metrics``,
``/openapi.json``. A request naming a model no live worker serves is a 404
``model_not_found``; a field we cannot honour is a 400 naming it (``param``). Plain
requests (one choice, text only) stream through byte templates; the others through
:class:`ChoiceStreamEncoder`.

Before a generation request reaches the backend: its body is read up to
``limits.max_body_bytes`` (413 beyond), parsed (400), checked against ``limits`` (400
naming the field); while no model worker is registered at all it waits up to
``worker_wait_s`` (then 503 with ``Retry-After``); then it takes an admission slot
(``admission``: a bounded number in flight and a bounded, time-limited queue; 429 with
``Retry-After`` when full). The slot is held until the response is complete.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import msgspec
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from pydantic import ValidationError

from dynagraph.errors import EngineError
from dynagraph.llm.http.admission import Admission, Overloaded
from dynagraph.llm.http.asgi import App, BodyTooLarge, Request, Response
from dynagraph.llm.http.collect import ResponseCollector, expected_choices
from dynagraph.llm.http.errors import (
    HTTPError,
    error_response,
    from_exception,
    from_validation_error,
    json_response,
)
from dynagraph.llm.http.limits import RequestLimits, check_limits, prompt_text_bytes
from dynagraph.llm.http.metrics import (
    ERROR,
    STREAM,
    SUCCESS,
    UNARY,
    FrontendMetrics,
    TenantMetrics,
)
from dynagraph.llm.http.openapi import openapi_document
from dynagraph.llm.http.sse import (
    DONE,
    ChatStreamEncoder,
    ChoiceStreamEncoder,
    ClientDisconnected,
    CompletionStreamEncoder,
    DisconnectWatch,
    SSEResponse,
    sse_error,
)
from dynagraph.llm.http.tenancy import OPEN, TenantGate
from dynagraph.llm.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    Endpoint,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    OpenAIRequest,
    TextChunk,
    TokenizeKind,
    TokenizeRequest,
    Usage,
)
from dynagraph.llm.tenants import TenantEntry, TenantToken

log = logging.getLogger(__name__)

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


@dataclass(frozen=True)
class ModelInfo:
    """A model some live worker serves."""

    name: str
    max_model_len: int | None = None


class Backend(Protocol):
    """What the HTTP app needs from the serving graph (the Frontend implements it)."""

    def ready(self) -> bool:
        """True when at least one model worker can take requests (drives ``/health``)."""
        ...

    def models(self) -> Sequence[ModelInfo]:
        """The models live workers serve now (cheap; called per request)."""
        ...

    async def tokenize(self, kind: TokenizeKind, model: str, body: dict[str, Any]
                       ) -> dict[str, Any]:
        """Answer a ``/tokenize`` (``kind == "tokenize"``) or ``/detokenize`` body."""
        ...

    def generate(self, request: OpenAIRequest, request_id: str,
                 tenant: TenantToken | None = None) -> AsyncIterator[TextChunk]:
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
    limits: RequestLimits | None = None,
    admission: Admission | None = None,
    worker_wait_s: float = 10.0,
    tenants: TenantGate | None = None,
) -> App:
    """Build the app. Metrics go into ``registry`` (a fresh one if None), served at
    ``/metrics``; ``app.state.registry`` and ``app.state.metrics`` expose them.
    ``served_model_name`` labels the metrics; ``max_model_len`` applies to models whose
    workers publish no context length. ``admission`` None: no limit on requests in flight."""
    registry = registry if registry is not None else CollectorRegistry()
    metrics = FrontendMetrics(registry, served_model_name)
    gate = tenants or TenantGate(None, None, {})
    routes = _Routes(backend, metrics, served_model_name, max_model_len,
                     limits or RequestLimits(), admission, worker_wait_s, gate)
    app = App(on_error=_route_error)
    app.state.registry = registry
    app.state.metrics = metrics

    generate_routes: tuple[tuple[str, Endpoint], ...] = (
        ("/v1/chat/completions", "chat"), ("/v1/completions", "completion"))
    for path, endpoint in generate_routes:
        app.route("POST", path)(partial(routes.generate, endpoint=endpoint))

    @app.route("GET", "/v1/models")
    async def models(request: Request) -> Response:
        try:
            gate.identify(request.headers)
        except HTTPError as err:
            return error_response(err.status, err.info, err.headers)
        cards = [ModelCard(id=m.name, created=routes.created,
                           max_model_len=m.max_model_len or max_model_len)
                 for m in backend.models()]
        return json_response(200, ModelList(data=cards))

    for kind in ("tokenize", "detokenize"):
        app.route("POST", f"/{kind}")(partial(routes.tokenize, kind=kind))

    @app.route("GET", "/health")
    async def health(request: Request) -> Response:
        if backend.ready():
            return Response(b'{"status":"healthy"}', media_type="application/json")
        info = ErrorInfo(
            message="no model worker is ready", type="service_unavailable", code="no_instances"
        )
        return error_response(503, info)

    @app.route("GET", "/metrics")
    async def metrics_route(request: Request) -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_PLAIN_0_0_4)

    document = msgspec.json.encode(openapi_document(app.routes | {"/openapi.json": ["GET"]}))

    @app.route("GET", "/openapi.json")
    async def openapi(request: Request) -> Response:
        return Response(document, media_type="application/json")

    return app


def _route_error(status: int, message: str, headers: Mapping[str, str]) -> Response:
    info = ErrorInfo(message=message, type="invalid_request_error",
                     code="not_found" if status == 404 else "method_not_allowed")
    return error_response(status, info, headers)


@dataclass(slots=True, eq=False)
class _RequestState:
    request_id: str
    endpoint: Endpoint
    request_type: str
    start: float
    release: Callable[[], None] | None
    tenant: TenantEntry
    expected: int
    status: str = ERROR
    last: TextChunk | None = None


@dataclass(eq=False)
class _Routes:
    backend: Backend
    metrics: FrontendMetrics
    model: str
    max_model_len: int | None
    limits: RequestLimits
    admission: Admission | None
    worker_wait_s: float
    gate: TenantGate

    def __post_init__(self) -> None:
        self.tenant_metrics = (TenantMetrics(self.metrics.registry) if self.gate.required
                               else None)
        self.created = int(time.time())

    async def generate(self, request: Request, endpoint: Endpoint) -> Response:
        start = time.monotonic()
        header_id = request.headers.get("x-request-id")
        request_id = header_id if header_id and _REQUEST_ID.fullmatch(header_id) else _new_id()
        headers = {"x-request-id": request_id}
        entry = OPEN
        try:
            entry = self.gate.identify(request.headers)
            parsed = self._parse(await self._body(request), endpoint)
            slo_class = self.gate.slo_class(entry, request.headers)
            expected = _expected_tokens(parsed)
            self.gate.admit(entry, expected)
            try:
                await self._wait_for_workers()
                self._model(parsed.model)
                release = await self._admit(self.gate.class_priority.get(slo_class, 0))
            except HTTPError:
                self.gate.settle(entry, expected, 0)
                raise
        except HTTPError as err:
            self.metrics.count_request(endpoint, UNARY, ERROR)
            if self.tenant_metrics is not None:
                self.tenant_metrics.request(entry.tenant, ERROR)
            return error_response(err.status, err.info, {**headers, **err.headers})

        state = _RequestState(request_id, endpoint, STREAM if parsed.stream else UNARY, start,
                              release, entry, expected)
        self.metrics.inflight.inc()
        stream: AsyncIterator[TextChunk] | None = None
        try:
            stream = self.backend.generate(parsed, request_id,
                                           self.gate.token(entry, slo_class, request_id))
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
            return await self._settle(stream, state, Response(status=499, headers=headers))
        except Exception as exc:
            failure = from_exception(exc)
            log.info(
                "request %s failed with %d: %s", request_id, failure.status, failure.info.message
            )
            response = error_response(failure.status, failure.info, {**headers, **failure.headers})
            return await self._settle(stream, state, response)

    async def _body(self, request: Request) -> bytes:
        try:
            return await request.body(self.limits.max_body_bytes)
        except BodyTooLarge as exc:
            raise HTTPError(413, str(exc), code="body_too_large") from None

    async def _wait_for_workers(self) -> None:
        """While no model worker at all is registered, wait for one (start-up, restarts)."""
        if self.backend.models():
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.worker_wait_s
        while not self.backend.models():
            if loop.time() >= deadline:
                raise HTTPError(503, f"no model worker is ready (waited {self.worker_wait_s:g}s)",
                                type="service_unavailable", code="no_instances",
                                headers={"retry-after": str(max(1, math.ceil(
                                    self.worker_wait_s / 2)))})
            await asyncio.sleep(0.05)

    async def _admit(self, priority: int) -> Callable[[], None] | None:
        """A slot in flight; waiting ones go by SLO class ``priority``, then arrival."""
        if self.admission is None:
            return None
        try:
            return await self.admission.acquire(priority)
        except Overloaded as exc:
            raise HTTPError(429, str(exc), type="rate_limit_exceeded", code="overloaded",
                            headers={"retry-after": str(exc.retry_after)}) from None

    def _parse(self, body: bytes, endpoint: Endpoint) -> OpenAIRequest:
        model_cls = ChatCompletionRequest if endpoint == "chat" else CompletionRequest
        try:
            parsed: OpenAIRequest = model_cls.model_validate_json(body)
        except ValidationError as exc:
            raise from_validation_error(exc) from exc
        unsupported = parsed.unsupported()
        if unsupported is not None:
            raise HTTPError(400, f"{unsupported} is not supported by this server",
                            param=unsupported, code="unsupported_parameter")
        check_limits(parsed, self.limits)
        if not self.backend.models():
            return parsed  # the model is checked once a worker is up (_wait_for_workers)
        model = self._model(parsed.model)
        max_model_len = model.max_model_len or self.max_model_len
        requested = parsed.requested_max_tokens()
        if max_model_len is not None and requested is not None:
            if requested >= max_model_len:
                raise HTTPError(
                    400,
                    f"max_tokens ({requested}) must be smaller than the model's context "
                    f"length ({max_model_len})",
                    param="max_tokens",
                    code="context_length_exceeded",
                )
        return parsed

    def _model(self, name: str | None) -> ModelInfo:
        models = self.backend.models()
        for model in models:
            if model.name == name:
                return model
        served = ", ".join(repr(m.name) for m in models) or "none (no model worker is up)"
        raise HTTPError(404, f"the model {name!r} does not exist; served: {served}",
                        param="model", code="model_not_found")

    async def tokenize(self, request: Request, kind: TokenizeKind) -> Response:
        """``/tokenize`` and ``/detokenize`` (vLLM's bodies and answers)."""
        model_cls = TokenizeRequest if kind == "tokenize" else DetokenizeRequest
        try:
            self.gate.identify(request.headers)
            try:
                parsed = model_cls.model_validate_json(await self._body(request))
            except ValidationError as exc:
                raise from_validation_error(exc) from exc
            models = self.backend.models()
            name = parsed.model or (models[0].name if len(models) == 1 else None)
            model = self._model(name)
            body = parsed.model_dump(mode="json", exclude_unset=True)
            answer = await self.backend.tokenize(kind, model.name, body)
        except Exception as exc:
            failure = from_exception(exc)
            return error_response(failure.status, failure.info, failure.headers)
        return Response(msgspec.json.encode(answer), media_type="application/json")

    async def _collect(
        self,
        stream: AsyncIterator[TextChunk],
        req: OpenAIRequest,
        request_id: str,
        state: _RequestState,
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
        state: _RequestState,
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


async def _first(stream: AsyncIterator[TextChunk]) -> TextChunk:
    chunk = await anext(stream, None)
    if chunk is None:
        raise EngineError("the backend stream ended without any output")
    return chunk


async def _aclose(stream: AsyncIterator[TextChunk] | None) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


def _expected_tokens(req: OpenAIRequest) -> int:
    """A request's token cost before it is tokenized: prompt bytes / 4 + what it may generate."""
    return prompt_text_bytes(req) // 4 + (req.requested_max_tokens() or 256) * req.n


def _new_id() -> str:
    return uuid.uuid4().hex


