"""Prometheus export of an engine's load, read at scrape time (no background task).

Names follow vLLM's where it has one for the same number, with the ``dynamo_worker_``
prefix, and Prometheus conventions (``_total`` counters, base units).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from dynagraph.llm.engines.base import EngineLoad


class EngineLoadCollector(Collector):
    """Turns ``load()`` snapshots into gauges and counters labelled by worker."""

    def __init__(self, load: Callable[[], EngineLoad], worker: str) -> None:
        self._load = load
        self._worker = worker

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        load = self._load()
        labels = ["worker"]
        values = [self._worker]
        for name, doc, value in (
            ("dynamo_worker_requests_running", "Requests being processed by the engine.",
             load.running),
            ("dynamo_worker_requests_waiting", "Requests queued in the engine.", load.waiting),
            ("dynamo_worker_kv_used_blocks", "KV cache blocks in use.", load.kv_blocks_used),
            ("dynamo_worker_kv_total_blocks", "KV cache blocks in the engine.", load.kv_blocks_total),
            ("dynamo_worker_kv_cache_usage_ratio", "Fraction of KV cache blocks in use (0-1).",
             load.kv_usage),
        ):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, value)
            yield g
        for name, doc, value in (
            ("dynamo_worker_prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             load.prefix_cache_queries),
            ("dynamo_worker_prefix_cache_hits", "Prompt tokens found in the prefix cache.",
             load.prefix_cache_hits),
        ):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, value)
            yield c


def register_engine_load(load: Callable[[], EngineLoad], *, worker: str,
                         registry: CollectorRegistry = REGISTRY) -> EngineLoadCollector:
    collector = EngineLoadCollector(load, worker)
    registry.register(collector)
    return collector
