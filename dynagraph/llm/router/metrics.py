"""Router metrics: decisions, prefix overlap, decision latency, index size, KV event batches,
predicted TTFT and learned prefill speeds.

The Router component builds one set from its runtime's registry::

    self.metrics = RouterMetrics(self.runtime.registry)
    self.metrics.decision(mode="kv", worker=f"{wid:x}", request_blocks=n,
                          overlap_blocks=k, seconds=t)
    self.metrics.kv_event_batch(f"{wid:x}")
    self.metrics.index_blocks(f"{wid:x}", blocks, pooled_blocks, tiered_blocks)
    self.metrics.prefill_tokens_per_second(f"{wid:x}", tokens_per_s)
    self.metrics.rebalanced(f"{wid:x}", count)
    self.metrics.forget_worker(f"{wid:x}")
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry

from dynagraph.observability.metrics import counter, gauge, histogram


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.decisions = counter("dynamo_router_decisions_total", registry)
        self.request_blocks = counter("dynamo_router_request_blocks_total", registry)
        self.overlap_blocks = counter("dynamo_router_overlap_blocks_total", registry)
        self.decision_seconds = histogram("dynamo_router_decision_seconds", registry)
        self.index = gauge("dynamo_router_index_blocks", registry)
        self.pooled = gauge("dynamo_router_index_pooled_blocks", registry)
        self.tiered = gauge("dynamo_router_index_tiered_blocks", registry)
        self.batches = counter("dynamo_router_kv_event_batches_total", registry)
        self.predicted_ttft = histogram("dynamo_router_predicted_ttft_seconds", registry)
        self.prefill_speed = gauge("dynamo_router_worker_prefill_tokens_per_second", registry)
        self.rebalanced_requests = counter("dynamo_router_rebalanced_requests_total", registry)

    def decision(self, *, mode: str, worker: str, request_blocks: int, overlap_blocks: int,
                 seconds: float, predicted_ttft: float | None = None) -> None:
        """Record one routing decision for a prompt of ``request_blocks`` full blocks
        (``predicted_ttft``: the time cost model's forecast for the chosen worker)."""
        self.decisions.labels(worker, mode).inc()
        self.request_blocks.labels(worker).inc(request_blocks)
        self.overlap_blocks.labels(worker).inc(overlap_blocks)
        self.decision_seconds.observe(seconds)
        if predicted_ttft is not None:
            self.predicted_ttft.observe(predicted_ttft)

    def prefill_tokens_per_second(self, worker: str, value: float) -> None:
        self.prefill_speed.labels(worker).set(value)

    def rebalanced(self, worker: str, count: int) -> None:
        """``worker`` was asked to hand back ``count`` waiting requests."""
        self.rebalanced_requests.labels(worker).inc(count)

    def kv_event_batch(self, worker: str, count: int = 1) -> None:
        self.batches.labels(worker).inc(count)

    def index_blocks(self, worker: str, blocks: int, pooled: int = 0, tiered: int = 0) -> None:
        """The index's blocks of ``worker``: on its engine, in its host KV pool, and those
        it wrote to its shared tier."""
        self.index.labels(worker).set(blocks)
        self.pooled.labels(worker).set(pooled)
        self.tiered.labels(worker).set(tiered)

    def forget_worker(self, worker: str) -> None:
        """Drop a departed worker's index gauge (its counters keep their history)."""
        for family in (self.index, self.pooled, self.tiered, self.prefill_speed):
            try:
                family.remove(worker)
            except KeyError:
                pass
