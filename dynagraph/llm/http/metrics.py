"""Frontend Prometheus metrics, named as Dynamo names them (``dynamo_frontend_*``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip
_DURATION_BUCKETS = (
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
_TOKEN_BUCKETS = (
    1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072,
)  # fmt: skip

# Label values of dynamo_frontend_requests_total.
ENDPOINT_LABELS = {"chat": "chat_completions", "completion": "completions"}
STREAM, UNARY = "stream", "unary"
SUCCESS, ERROR = "success", "error"


class FrontendMetrics:
    """The frontend's metrics in ``registry``, with children bound to one model name."""

    def __init__(self, registry: CollectorRegistry, model: str) -> None:
        self.model = model
        self.requests = Counter(
            "dynamo_frontend_requests",
            "Requests handled by the HTTP frontend",
            ["model", "endpoint", "request_type", "status"],
            registry=registry,
        )
        inflight = Gauge(
            "dynamo_frontend_inflight_requests",
            "Requests currently being processed",
            ["model"],
            registry=registry,
        )
        ttft = Histogram(
            "dynamo_frontend_time_to_first_token_seconds",
            "Time from request arrival to the first generated text",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        itl = Histogram(
            "dynamo_frontend_inter_token_latency_seconds",
            "Time between generated tokens (per streamed chunk, divided by its tokens)",
            ["model"],
            buckets=_ITL_BUCKETS,
            registry=registry,
        )
        duration = Histogram(
            "dynamo_frontend_request_duration_seconds",
            "Time from request arrival to the end of the response",
            ["model"],
            buckets=_DURATION_BUCKETS,
            registry=registry,
        )
        isl = Histogram(
            "dynamo_frontend_input_sequence_tokens",
            "Prompt length in tokens",
            ["model"],
            buckets=_TOKEN_BUCKETS,
            registry=registry,
        )
        osl = Histogram(
            "dynamo_frontend_output_sequence_tokens",
            "Generated length in tokens",
            ["model"],
            buckets=_TOKEN_BUCKETS,
            registry=registry,
        )
        disconnects = Counter(
            "dynamo_frontend_client_disconnects",
            "Requests whose client disconnected before the response was complete",
            ["model"],
            registry=registry,
        )
        self.inflight = inflight.labels(model)
        self.ttft = ttft.labels(model)
        self.itl = itl.labels(model)
        self.duration = duration.labels(model)
        self.input_tokens = isl.labels(model)
        self.output_tokens = osl.labels(model)
        self.disconnects = disconnects.labels(model)

    def count_request(self, endpoint: str, request_type: str, status: str) -> None:
        """Count a finished request. ``endpoint`` is ``"chat"`` or ``"completion"``."""
        self.requests.labels(
            self.model, ENDPOINT_LABELS.get(endpoint, endpoint), request_type, status
        ).inc()
