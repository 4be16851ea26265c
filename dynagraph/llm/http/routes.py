"""The generation and tokenizer route handlers, and the checks a request passes first.

:class:`Routes` holds what the handlers share (backend, metrics, limits, admission,
tenant gate); ``create_app`` (``dynagraph.llm.http.app``) binds its ``generate`` to
``/v1/chat/completions`` and ``/v1/completions`` and its ``tokenize`` to ``/tokenize``
and ``/detokenize``.

Before a generation request reaches the backend: its body is read up to
``limits.max_body_bytes`` (413 beyond), parsed (400), checked against ``limits`` (400
naming the field); while no model worker is registered at all it waits up to
``worker_wait_s`` (then 503 with ``Retry-After``); then it takes an admission slot
(``admission``: a bounded number in flight and a bounded, time-limited queue; 429 with
``Retry-After`` when full). The slot is held until the response is complete (see
``dynagraph.llm.http.responses``). A request naming a model no live worker serves is a
404 ``model_not_found``; a field we cannot honour is a 400 naming it (``param``). Every
response carries ``x-request-id``: the client's, when it is a safe id, else a new one.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial

import msgspec
from pydantic import ValidationError

from dynagraph.errors import EngineError
from dynagraph.llm.http.admission import Admission, Overloaded
from dynagraph.llm.http.asgi import BodyTooLarge, Request, Response
from dynagraph.llm.http.backend import Backend, ModelInfo
from dynagraph.llm.http.errors import (
    HTTPError,
    error_response,
    from_exception,
    from_validation_error,
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
from dynagraph.llm.http.responses import RequestState, ResponseWriter
from dynagraph.llm.http.sse import ClientDisconnected, DisconnectWatch, SSEResponse
from dynagraph.llm.http.tenancy import OPEN, TenantGate
from dynagraph.llm.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    Endpoint,
    OpenAIRequest,
    TextChunk,
    TokenizeKind,
    TokenizeRequest,
)

log = logging.getLogger(__name__)

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


@dataclass(eq=False)
class Routes(ResponseWriter):
    """The route handlers' shared state; ``generate`` and ``tokenize`` are the handlers."""

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

        state = RequestState(request_id, endpoint, STREAM if parsed.stream else UNARY, start,
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


async def _first(stream: AsyncIterator[TextChunk]) -> TextChunk:
    chunk = await anext(stream, None)
    if chunk is None:
        raise EngineError("the backend stream ended without any output")
    return chunk


def _expected_tokens(req: OpenAIRequest) -> int:
    """A request's token cost before it is tokenized: prompt bytes / 4 + what it may generate."""
    return prompt_text_bytes(req) // 4 + (req.requested_max_tokens() or 256) * req.n


_ID_PREFIX = uuid.uuid4().hex[:16]
_ID_COUNTER = itertools.count()


def _new_id_prefix() -> None:
    global _ID_PREFIX
    _ID_PREFIX = uuid.uuid4().hex[:16]


os.register_at_fork(after_in_child=_new_id_prefix)  # a forked child counts on its own


def _new_id() -> str:
    """A request id unique across processes (32 hex digits, as a uuid4's): this process's
    random prefix and a counter (no system call per request)."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER):016x}"
