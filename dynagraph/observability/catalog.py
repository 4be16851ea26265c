"""Every metric a dynagraph process exports: name, type, labels, who exports it.

One owner for metric names. Dashboards (``deploy/grafana/dashboards``) may only use
names listed here or infrastructure names from ``INFRA_METRICS``; a unit test checks
that. Names follow Prometheus conventions (counters end in ``_total``, base units:
seconds, bytes, ratios 0-1) and take Dynamo's or vLLM's name where one exists for
the same number. ``name`` is the family name as Prometheus stores it (with
``_total`` for counters; histograms also have ``_bucket``, ``_sum``, ``_count``).

``component`` is the process that exports the metric. ``graph`` is the first graph
in which that process exports it (``agg``, ``agg_router``, ``disagg``, ``agg_afd``); the
dashboard test only requires data from a panel whose graph is being tested.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["counter", "gauge", "histogram"]


LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
TTFT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip
DURATION_BUCKETS = (
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
TOKEN_BUCKETS = (
    1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072,
)  # fmt: skip
QUEUE_WAIT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


@dataclass(frozen=True)
class MetricSpec:
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...]
    component: str
    graph: str
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    """Histogram bucket bounds (ignored for counters and gauges)."""

    def series_names(self) -> tuple[str, ...]:
        """The names Prometheus stores for this family."""
        if self.kind == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)


def _m(name: str, kind: Kind, help: str, labels: tuple[str, ...], component: str,
       graph: str = "agg", buckets: tuple[float, ...] = LATENCY_BUCKETS) -> MetricSpec:
    return MetricSpec(name, kind, help, labels, component, graph, buckets)


FRONTEND = "Frontend"
PROCESSOR = "Processor"
ROUTER = "Router"
WORKER = "VllmWorker"
PREFILL = "PrefillWorker"
FFN = "FfnWorker"

CATALOG: tuple[MetricSpec, ...] = (
    # Frontend (dynagraph/llm/http/metrics.py): Dynamo's dynamo_frontend_* names.
    _m("dynamo_frontend_requests_total", "counter", "Requests handled by the HTTP frontend",
       ("model", "endpoint", "request_type", "status"), FRONTEND),
    _m("dynamo_frontend_inflight_requests", "gauge", "Requests currently being processed",
       ("model",), FRONTEND),
    _m("dynamo_frontend_time_to_first_token_seconds", "histogram",
       "Time from request arrival to the first generated text", ("model",), FRONTEND,
       buckets=TTFT_BUCKETS),
    _m("dynamo_frontend_inter_token_latency_seconds", "histogram",
       "Time between generated tokens (per streamed chunk, divided by its tokens)", ("model",),
       FRONTEND, buckets=ITL_BUCKETS),
    _m("dynamo_frontend_request_duration_seconds", "histogram",
       "Time from request arrival to the end of the response", ("model",), FRONTEND,
       buckets=DURATION_BUCKETS),
    _m("dynamo_frontend_input_sequence_tokens", "histogram", "Prompt length in tokens",
       ("model",), FRONTEND, buckets=TOKEN_BUCKETS),
    _m("dynamo_frontend_output_sequence_tokens", "histogram", "Generated length in tokens",
       ("model",), FRONTEND, buckets=TOKEN_BUCKETS),
    _m("dynamo_frontend_tenant_requests_total", "counter",
       "Requests per tenant (with a tenants file) and status", ("tenant", "status"), FRONTEND),
    _m("dynamo_frontend_tenant_tokens_total", "counter",
       "Tokens per tenant: prompt, completion, and prompt tokens served from the prefix cache",
       ("tenant", "kind"), FRONTEND),
    _m("dynamo_frontend_client_disconnects_total", "counter",
       "Requests whose client disconnected before the response was complete",
       ("model",), FRONTEND),
    # Processor (dynagraph/llm/processor_metrics.py).
    _m("dynamo_processor_queue_seconds", "histogram",
       "Time from a request's arrival at the Processor to its dispatch to a worker, "
       "tokenization excluded (worker choice, waiting for a worker)", (), PROCESSOR),
    _m("dynamo_processor_tokenize_seconds", "histogram",
       "Time to apply the chat template and tokenize one request", (), PROCESSOR),
    _m("dynamo_processor_detokenize_seconds", "histogram",
       "Time spent detokenizing one request's output, summed over its chunks", (), PROCESSOR),
    _m("dynamo_frontend_migrations_total", "counter",
       "Requests moved to another Processor after theirs failed mid-stream (reason: the "
       "failure's type)", ("reason",), FRONTEND),
    _m("dynamo_processor_migrations_total", "counter",
       "Requests moved to another worker after theirs failed (reason: the failure's type)",
       ("reason",), PROCESSOR),
    _m("dynamo_processor_slo_delayed_seconds", "histogram",
       "How long SLO-aware admission held a deferrable request before sending it on",
       ("slo_class",), PROCESSOR, "agg_router", buckets=QUEUE_WAIT_BUCKETS),
    _m("dynamo_processor_slo_shed_total", "counter",
       "Requests SLO-aware admission refused (HTTP 429) under pressure", ("slo_class",),
       PROCESSOR, "agg_router"),
    # Decode worker load (dynagraph/llm/engines/metrics.py), vLLM's meanings.
    _m("dynamo_worker_requests_running", "gauge", "Requests being processed by the engine.",
       ("worker",), WORKER),
    _m("dynamo_worker_requests_waiting", "gauge", "Requests queued in the engine.",
       ("worker",), WORKER),
    _m("dynamo_worker_kv_used_blocks", "gauge", "KV cache blocks in use.", ("worker",), WORKER),
    _m("dynamo_worker_kv_total_blocks", "gauge", "KV cache blocks in the engine.",
       ("worker",), WORKER),
    _m("dynamo_worker_kv_cache_usage_ratio", "gauge", "Fraction of KV cache blocks in use (0-1).",
       ("worker",), WORKER),
    _m("dynamo_worker_prefix_cache_queries_total", "counter",
       "Prompt tokens looked up in the prefix cache.", ("worker",), WORKER),
    _m("dynamo_worker_prefix_cache_hits_total", "counter",
       "Prompt tokens found in the prefix cache.", ("worker",), WORKER),
    _m("dynamo_worker_kv_pool_query_tokens_total", "counter",
       "Prompt tokens past the engine's own prefix looked up in its KV connectors.",
       ("worker",), WORKER),
    _m("dynamo_worker_kv_pool_hit_tokens_total", "counter",
       "Prompt tokens loaded from the host KV pool (or the tier under it) instead of "
       "computed.", ("worker",), WORKER),
    _m("dynamo_worker_kv_tier_hit_tokens_total", "counter",
       "Of those, prompt tokens found in the tier under the pool (kv-offload-dir).",
       ("worker",), WORKER),
    _m("dynamo_worker_kv_tier_read_bytes_total", "counter",
       "Bytes of KV read from the tier under the pool into the pool.", ("worker",), WORKER),
    _m("dynamo_worker_kv_tier_read_seconds_total", "counter",
       "Seconds spent reading KV from the tier under the pool.", ("worker",), WORKER),
    _m("dynamo_worker_kv_tier_bytes", "gauge",
       "Bytes of block files in the tier under the pool (kv-offload-dir) at this worker's "
       "last trim pass (kv-offload-dir-gib).", ("worker",), WORKER),
    _m("dynamo_worker_kv_tier_trimmed_blocks_total", "counter",
       "Blocks this worker deleted from the tier under the pool to keep it within "
       "kv-offload-dir-gib (oldest written first).", ("worker",), WORKER),
    _m("dynamo_worker_kv_pool_loaded_bytes_total", "counter",
       "Bytes of KV loaded from the host KV pool into the engine.", ("worker",), WORKER),
    _m("dynamo_worker_kv_pool_load_seconds_total", "counter",
       "Seconds spent loading KV from the host KV pool.", ("worker",), WORKER),
    _m("dynamo_worker_kv_pool_stored_bytes_total", "counter",
       "Bytes of KV stored from the engine into the host KV pool.", ("worker",), WORKER),
    _m("dynamo_worker_kv_pool_evictions_total", "counter",
       "Blocks the host KV pool dropped to make room.", ("worker",), WORKER),
    _m("dynamo_worker_kv_pool_usage_ratio", "gauge",
       "Fraction of the host KV pool's blocks in use (0-1).", ("worker",), WORKER),
    # Router (dynagraph/llm/router/metrics.py).
    _m("dynamo_router_decisions_total", "counter",
       "Routing decisions by chosen worker and mode", ("worker", "mode"), ROUTER, "agg_router"),
    _m("dynamo_router_request_blocks_total", "counter",
       "Full prompt blocks of routed requests", ("worker",), ROUTER, "agg_router"),
    _m("dynamo_router_overlap_blocks_total", "counter",
       "Cached prefix blocks on the chosen worker, summed over decisions", ("worker",), ROUTER,
       "agg_router"),
    _m("dynamo_router_decision_seconds", "histogram",
       "Time to choose a worker for one request (index lookup + cost)", (), ROUTER,
       "agg_router"),
    _m("dynamo_router_index_blocks", "gauge", "Blocks the index holds per worker",
       ("worker",), ROUTER, "agg_router"),
    _m("dynamo_router_index_pooled_blocks", "gauge",
       "Blocks the index holds per worker in the worker's host KV pool",
       ("worker",), ROUTER, "agg_router"),
    _m("dynamo_router_index_tiered_blocks", "gauge",
       "Blocks the index holds per worker that it wrote to its shared tier (kv-offload-dir)",
       ("worker",), ROUTER, "agg_router"),
    _m("dynamo_router_kv_event_batches_total", "counter", "KV event batches applied",
       ("worker",), ROUTER, "agg_router"),
    _m("dynamo_router_predicted_ttft_seconds", "histogram",
       "Time to first token the cost model predicted on the chosen worker (time cost model)",
       (), ROUTER, "agg_router", TTFT_BUCKETS),
    _m("dynamo_router_worker_prefill_tokens_per_second", "gauge",
       "Prefill speed the Router learned for a worker (prompt tokens per engine second)",
       ("worker",), ROUTER, "agg_router"),
    _m("dynamo_router_rebalanced_requests_total", "counter",
       "Waiting requests a worker was asked to hand back for a free place elsewhere "
       "(rebalance-wait)", ("worker",), ROUTER, "agg_router"),
    # Disaggregation, decode side (dynagraph/llm/disagg/metrics.py).
    _m("dynamo_worker_prefill_requests_total", "counter",
       "Prefills by where they ran (local, remote, fallback = wanted remote, ran local) "
       "and the reason", ("where", "reason"), WORKER, "disagg"),
    _m("dynamo_worker_remote_prefill_wait_seconds", "histogram",
       "Enqueue of a remote prefill job to its KV transfer parameters (or giving up)", (),
       WORKER, "disagg", QUEUE_WAIT_BUCKETS),
    _m("dynamo_worker_kv_transfers_total", "counter",
       "KV cache transfers from prefill workers into this decode worker", ("worker",), WORKER,
       "disagg"),
    _m("dynamo_worker_kv_transfer_bytes_total", "counter",
       "Bytes of KV cache received from prefill workers", ("worker",), WORKER, "disagg"),
    _m("dynamo_worker_kv_transfer_seconds", "histogram",
       "Time of one KV transfer, from the read being posted to its completion (NIXL's telemetry)", ("worker",), WORKER,
       "disagg"),
    # Prefill queue (dynagraph/llm/disagg/metrics.py).
    _m("dynamo_prefill_queue_depth", "gauge",
       "Jobs waiting in the prefill queue for a first delivery (as seen by this process)",
       (), WORKER, "disagg"),
    _m("dynamo_prefill_queue_wait_seconds", "histogram",
       "Time from enqueue to a prefill worker pulling the job", (), PREFILL, "disagg"),
    _m("dynamo_prefill_queue_redeliveries_total", "counter",
       "Prefill jobs pulled again after a worker failed to ack them", (), PREFILL, "disagg"),
    # VllmWorker with an FfnWorker linked (dynagraph/llm/afd/metrics.py).
    _m("dynamo_worker_afd_forwards_total", "counter",
       "Forward passes whose FFNs ran on FfnWorkers", ("worker",), WORKER, "agg_afd"),
    _m("dynamo_worker_afd_microbatched_forwards_total", "counter",
       "Forward passes split into two micro-batches (attention/FFN ping-pong)",
       ("worker",), WORKER, "agg_afd"),
    _m("dynamo_worker_afd_layer_calls_total", "counter",
       "Layer FFN calls sent to FfnWorkers (per micro-batch)", ("worker",), WORKER, "agg_afd"),
    _m("dynamo_worker_afd_failovers_total", "counter",
       "FfnWorker failures that sent calls to another worker", ("worker",), WORKER, "agg_afd"),
    _m("dynamo_worker_afd_exchange_wait_seconds_total", "counter",
       "Time the engine waited for FFN results", ("worker",), WORKER, "agg_afd"),
    _m("dynamo_worker_afd_ffn_compute_seconds_total", "counter",
       "FFN compute time reported by the FfnWorkers for this engine's calls",
       ("worker",), WORKER, "agg_afd"),
    # FfnWorker (dynagraph/llm/afd/metrics.py): attention-FFN disaggregation.
    _m("dynamo_ffn_calls_total", "counter", "Layer FFN calls computed for engines",
       ("worker",), FFN, "agg_afd"),
    _m("dynamo_ffn_rows_total", "counter", "Hidden-state rows (tokens) computed",
       ("worker",), FFN, "agg_afd"),
    _m("dynamo_ffn_compute_seconds_total", "counter", "Time spent computing layer FFNs",
       ("worker",), FFN, "agg_afd"),
    _m("dynamo_ffn_errors_total", "counter", "Layer FFN calls that failed",
       ("worker",), FFN, "agg_afd"),
    _m("dynamo_ffn_connections", "gauge", "Engine connections open now",
       ("worker",), FFN, "agg_afd"),
)

INFRA_METRICS: dict[str, str] = {
    # etcd serves these on its client URL at /metrics.
    "etcd_server_has_leader": "etcd",
    "etcd_mvcc_db_total_size_in_bytes": "etcd",
    "etcd_debugging_mvcc_keys_total": "etcd",
    "etcd_server_proposals_committed_total": "etcd",
    "etcd_disk_wal_fsync_duration_seconds_bucket": "etcd",
    "etcd_network_client_grpc_received_bytes_total": "etcd",
    "grpc_server_handled_total": "etcd",
    # The NATS exporter: nats-io/prometheus-nats-exporter names (compose) and
    # dynagraph.observability.nats_exporter, which emits the same names (local runs).
    "gnatsd_varz_connections": "nats",
    "gnatsd_varz_in_msgs": "nats",
    "gnatsd_varz_out_msgs": "nats",
    "gnatsd_varz_in_bytes": "nats",
    "gnatsd_varz_out_bytes": "nats",
    "gnatsd_varz_mem": "nats",
    "gnatsd_varz_slow_consumers": "nats",
    "jetstream_stream_total_messages": "nats",
    "jetstream_consumer_num_pending": "nats",
    "jetstream_consumer_num_ack_pending": "nats",
    "jetstream_consumer_num_redelivered": "nats",
    # Prometheus itself.
    "up": "prometheus",
    "scrape_duration_seconds": "prometheus",
}

PENDING_RENAMES: dict[str, str] = {}
"""Catalogued names known to break a convention, and the name each should take."""

BY_NAME: dict[str, MetricSpec] = {m.name: m for m in CATALOG}


def series_index() -> dict[str, MetricSpec]:
    """Every stored series name (``_bucket``/``_sum``/``_count`` included) -> its family."""
    return {s: m for m in CATALOG for s in (m.name, *m.series_names())}


def spec(name: str) -> MetricSpec:
    """The family ``name`` belongs to (a series name is accepted); KeyError if unknown."""
    found = series_index().get(name)
    if found is None:
        raise KeyError(f"metric {name!r} is not in dynagraph.observability.catalog")
    return found
