"""Frontend metrics, named as Dynamo names them (``dynamo_frontend_*``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from dynagraph.llm.protocol import TextChunk
from dynagraph.observability.metrics import counter, gauge, histogram

# Label values of dynamo_frontend_requests_total.
ENDPOINT_LABELS = {"chat": "chat_completions", "completion": "completions"}
STREAM, UNARY = "stream", "unary"
SUCCESS, ERROR = "success", "error"


class FrontendMetrics:
    """The frontend's metrics in ``registry``, with children bound to one model name."""

    def __init__(self, registry: CollectorRegistry, model: str) -> None:
        self.model = model
        self.registry = registry
        self.requests = counter("dynamo_frontend_requests_total", registry)
        self.inflight = gauge("dynamo_frontend_inflight_requests", registry).labels(model)
        self.ttft = histogram("dynamo_frontend_time_to_first_token_seconds",
                              registry).labels(model)
        self.itl = histogram("dynamo_frontend_inter_token_latency_seconds",
                             registry).labels(model)
        self.duration = histogram("dynamo_frontend_request_duration_seconds",
                                  registry).labels(model)
        self.input_tokens = histogram("dynamo_frontend_input_sequence_tokens",
                                      registry).labels(model)
        self.output_tokens = histogram("dynamo_frontend_output_sequence_tokens",
                                       registry).labels(model)
        self.disconnects = counter("dynamo_frontend_client_disconnects_total",
                                   registry).labels(model)
        self.migrations = counter("dynamo_frontend_migrations_total", registry)

    def migrated(self, processor: int | None, failure: Exception) -> None:
        """A request moved on from a failed Processor (``resuming``'s ``on_migrate``)."""
        self.migrations.labels(type(failure).__name__).inc()

    def count_request(self, endpoint: str, request_type: str, status: str) -> None:
        """Count a finished request. ``endpoint`` is ``"chat"`` or ``"completion"``."""
        self.requests.labels(
            self.model, ENDPOINT_LABELS.get(endpoint, endpoint), request_type, status
        ).inc()


class TenantMetrics:
    """Per-tenant requests and tokens (only with a tenants file; the label is the tenant's
    name, never its key)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = counter("dynamo_frontend_tenant_requests_total", registry)
        self.tokens = counter("dynamo_frontend_tenant_tokens_total", registry)

    def request(self, tenant: str, status: str) -> None:
        self.requests.labels(tenant, status).inc()

    def finished(self, tenant: str, status: str, last: TextChunk | None) -> None:
        self.request(tenant, status)
        if last is not None:
            self.tokens.labels(tenant, "prompt").inc(last.prompt_tokens)
            self.tokens.labels(tenant, "completion").inc(last.completion_tokens)
            self.tokens.labels(tenant, "cached").inc(last.cached_tokens or 0)
