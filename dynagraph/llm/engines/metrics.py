"""Prometheus export of an engine's load, read at scrape time (no background task).

The families and their help texts are the catalogue's ``dynamo_worker_*`` load entries;
they are collected from ``load()`` snapshots rather than updated per event.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from dynagraph.llm.engines.base import EngineLoad
from dynagraph.observability.catalog import spec

_GAUGES: tuple[tuple[str, Callable[[EngineLoad], float]], ...] = (
    ("dynamo_worker_requests_running", lambda load: load.running),
    ("dynamo_worker_requests_waiting", lambda load: load.waiting),
    ("dynamo_worker_kv_used_blocks", lambda load: load.kv_blocks_used),
    ("dynamo_worker_kv_total_blocks", lambda load: load.kv_blocks_total),
    ("dynamo_worker_kv_cache_usage_ratio", lambda load: load.kv_usage),
    ("dynamo_worker_kv_pool_usage_ratio", lambda load: load.kv_pool_usage),
)
_COUNTERS: tuple[tuple[str, Callable[[EngineLoad], float]], ...] = (
    ("dynamo_worker_prefix_cache_queries_total", lambda load: load.prefix_cache_queries),
    ("dynamo_worker_prefix_cache_hits_total", lambda load: load.prefix_cache_hits),
    ("dynamo_worker_kv_pool_query_tokens_total", lambda load: load.kv_pool_query_tokens),
    ("dynamo_worker_kv_pool_hit_tokens_total", lambda load: load.kv_pool_hit_tokens),
    ("dynamo_worker_kv_tier_hit_tokens_total", lambda load: load.kv_tier_hit_tokens),
    ("dynamo_worker_kv_tier_read_bytes_total", lambda load: load.kv_tier_read_bytes),
    ("dynamo_worker_kv_tier_read_seconds_total", lambda load: load.kv_tier_read_seconds),
    ("dynamo_worker_kv_pool_loaded_bytes_total", lambda load: load.kv_pool_loaded_bytes),
    ("dynamo_worker_kv_pool_load_seconds_total", lambda load: load.kv_pool_load_seconds),
    ("dynamo_worker_kv_pool_stored_bytes_total", lambda load: load.kv_pool_stored_bytes),
    ("dynamo_worker_kv_pool_evictions_total", lambda load: load.kv_pool_evictions),
)


class EngineLoadCollector(Collector):
    """Turns ``load()`` snapshots of several engines into families labelled by worker.

    One collector per process; ``add(worker, load)`` for each engine it holds.
    """

    def __init__(self) -> None:
        self._engines: dict[str, Callable[[], EngineLoad]] = {}

    def add(self, worker: str, load: Callable[[], EngineLoad]) -> None:
        self._engines[worker] = load

    def remove(self, worker: str) -> None:
        self._engines.pop(worker, None)

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        loads = [(worker, load()) for worker, load in self._engines.items()]
        for name, value in _GAUGES:
            g = GaugeMetricFamily(name, spec(name).help, labels=["worker"])
            for worker, load in loads:
                g.add_metric([worker], value(load))
            yield g
        for name, value in _COUNTERS:
            c = CounterMetricFamily(name.removesuffix("_total"), spec(name).help,
                                    labels=["worker"])
            for worker, load in loads:
                c.add_metric([worker], value(load))
            yield c


_collectors: weakref.WeakKeyDictionary[CollectorRegistry, EngineLoadCollector] = (
    weakref.WeakKeyDictionary()
)


def register_engine_load(load: Callable[[], EngineLoad], *, worker: str,
                         registry: CollectorRegistry = REGISTRY) -> EngineLoadCollector:
    """Export ``load()`` labelled ``worker=...`` in ``registry`` (one collector per registry)."""
    collector = _collectors.get(registry)
    if collector is None:
        collector = _collectors[registry] = EngineLoadCollector()
        registry.register(collector)
    collector.add(worker, load)
    return collector
