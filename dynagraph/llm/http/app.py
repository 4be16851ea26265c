"""The OpenAI-compatible HTTP app: ``create_app`` builds the route table.

The app only validates and formats. Everything model-specific (templating,
tokenization, detokenization, stop strings, tool parsing, logprob text) happens behind
:class:`~dynagraph.llm.http.backend.Backend`, which the Frontend component implements by
calling the Processor.

Routes: ``/v1/chat/completions``, ``/v1/completions``, ``/v1/models`` (the models live
workers serve), ``/tokenize`` and ``/detokenize`` (vLLM's), ``/health``, ``/metrics``,
``/openapi.json``. The generation and tokenizer handlers, and the checks a request
passes before it reaches the backend, are ``dynagraph.llm.http.routes``; how a
generation's response is written and accounted for is ``dynagraph.llm.http.responses``.
An unknown path is a 404 ``not_found``, a known path with another method a 405
``method_not_allowed``.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

import msgspec
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from dynagraph.llm.http.admission import Admission
from dynagraph.llm.http.asgi import App, Request, Response
from dynagraph.llm.http.backend import Backend
from dynagraph.llm.http.errors import HTTPError, error_response, json_response
from dynagraph.llm.http.limits import RequestLimits
from dynagraph.llm.http.metrics import FrontendMetrics
from dynagraph.llm.http.openapi import openapi_document
from dynagraph.llm.http.routes import Routes
from dynagraph.llm.http.tenancy import TenantGate
from dynagraph.llm.protocol import Endpoint, ErrorInfo, ModelCard, ModelList


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
    routes = Routes(backend, metrics, served_model_name, max_model_len,
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
