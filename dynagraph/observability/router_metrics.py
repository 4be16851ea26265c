"""Router metrics: decisions, prefix overlap, decision latency, index size, KV event batches.

The Router component builds one set from its runtime's registry::

    self.metrics = RouterMetrics(self.runtime.registry)
    self.metrics.decision(mode="kv", worker=f"{wid:x}", request_blocks=n,
                          overlap_blocks=k, seconds=t)
    self.metrics.kv_event_batch(f"{wid:x}")
    self.metrics.index_blocks(f"{wid:x}", blocks)
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
        self.batches = counter("dynamo_router_kv_event_batches_total", registry)

    def decision(self, *, mode: str, worker: str, request_blocks: int, overlap_blocks: int,
                 seconds: float) -> None:
        """Record one routing decision for a prompt of ``request_blocks`` full blocks."""
        self.decisions.labels(worker, mode).inc()
        self.request_blocks.labels(worker).inc(request_blocks)
        self.overlap_blocks.labels(worker).inc(overlap_blocks)
        self.decision_seconds.observe(seconds)

    def kv_event_batch(self, worker: str, count: int = 1) -> None:
        self.batches.labels(worker).inc(count)

    def index_blocks(self, worker: str, blocks: int) -> None:
        self.index.labels(worker).set(blocks)

    def forget_worker(self, worker: str) -> None:
        """Drop a departed worker's index gauge (its counters keep their history)."""
        try:
            self.index.remove(worker)
        except KeyError:
            pass
