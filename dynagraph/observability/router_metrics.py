"""Router metrics: decisions, predicted prefix overlap, decision latency, index size, events.

Use (one object per Router process, built in the component's ``__init__``)::

    self.metrics = RouterMetrics()
    # after each decision (worker ids as "%x" strings, like the worker metrics' label):
    self.metrics.decision(mode="kv", worker=f"{wid:x}", prompt_blocks=n,
                          overlap_blocks=k, seconds=t)
    # after applying a batch of KV events from a worker (kind: stored/removed/cleared):
    self.metrics.events_applied(f"{wid:x}", "stored", count=1)
    # whenever the index changes size (or periodically), and when a worker leaves:
    self.metrics.index_blocks(f"{wid:x}", blocks)
    self.metrics.forget_worker(f"{wid:x}")
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry

from dynagraph.observability._build import RATIO_BUCKETS, counter, gauge, histogram


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.decisions = counter("dynamo_router_decisions_total", registry)
        self.prompt_blocks = counter("dynamo_router_prompt_blocks_total", registry)
        self.overlap_blocks = counter("dynamo_router_overlap_blocks_total", registry)
        self.overlap_ratio = histogram("dynamo_router_overlap_ratio", registry, RATIO_BUCKETS)
        self.decision_seconds = histogram("dynamo_router_decision_seconds", registry)
        self.index = gauge("dynamo_router_index_blocks", registry)
        self.events = counter("dynamo_router_kv_events_applied_total", registry)

    def decision(self, *, mode: str, worker: str, prompt_blocks: int, overlap_blocks: int,
                 seconds: float) -> None:
        """Record one routing decision for a prompt of ``prompt_blocks`` full blocks."""
        self.decisions.labels(mode, worker).inc()
        self.prompt_blocks.inc(prompt_blocks)
        self.overlap_blocks.labels(worker).inc(overlap_blocks)
        if prompt_blocks > 0:
            self.overlap_ratio.observe(min(overlap_blocks / prompt_blocks, 1.0))
        self.decision_seconds.observe(seconds)

    def events_applied(self, worker: str, kind: str, count: int = 1) -> None:
        self.events.labels(worker, kind).inc(count)

    def index_blocks(self, worker: str, blocks: int) -> None:
        self.index.labels(worker).set(blocks)

    def forget_worker(self, worker: str) -> None:
        """Drop a departed worker's index gauge (its counters keep their history)."""
        try:
            self.index.remove(worker)
        except KeyError:
            pass
