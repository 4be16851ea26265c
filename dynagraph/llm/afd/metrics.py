"""Prometheus export of attention-FFN disaggregation, read at scrape time.

- FfnWorker: ``dynamo_ffn_*`` from its ``FfnServer``'s ``ServerStats`` (updated by
  the server's threads).
- VllmWorker: ``dynamo_worker_afd_*`` from the engine-side connector's stats, which the
  engine process publishes in a small file (``AfdAttachment.stats()``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from dynagraph.llm.afd.server import ServerStats
from dynagraph.observability.catalog import spec

_ENGINE_COUNTERS: tuple[tuple[str, str, float], ...] = (
    ("dynamo_worker_afd_forwards_total", "forwards", 1.0),
    ("dynamo_worker_afd_microbatched_forwards_total", "microbatched_forwards", 1.0),
    ("dynamo_worker_afd_layer_calls_total", "calls", 1.0),
    ("dynamo_worker_afd_failovers_total", "failovers", 1.0),
    ("dynamo_worker_afd_exchange_wait_seconds_total", "wait_seconds", 1.0),
    ("dynamo_worker_afd_ffn_compute_seconds_total", "worker_compute_us", 1e-6),
)


def _counter(name: str, worker: str, value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(name.removesuffix("_total"), spec(name).help, labels=["worker"])
    c.add_metric([worker], value)
    return c


class FfnStatsCollector(Collector):
    def __init__(self, stats: ServerStats, worker: str) -> None:
        self.stats = stats
        self.worker = worker

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self.stats
        yield _counter("dynamo_ffn_calls_total", self.worker, s.calls)
        yield _counter("dynamo_ffn_rows_total", self.worker, s.rows)
        yield _counter("dynamo_ffn_compute_seconds_total", self.worker, s.compute_seconds)
        yield _counter("dynamo_ffn_errors_total", self.worker, s.errors)
        g = GaugeMetricFamily("dynamo_ffn_connections", spec("dynamo_ffn_connections").help,
                              labels=["worker"])
        g.add_metric([self.worker], s.connections)
        yield g


class EngineAfdCollector(Collector):
    def __init__(self, read: Callable[[], dict[str, float]], worker: str) -> None:
        self.read = read
        self.worker = worker

    def collect(self) -> Iterator[CounterMetricFamily]:
        stats = self.read()
        for name, key, scale in _ENGINE_COUNTERS:
            yield _counter(name, self.worker, stats.get(key, 0.0) * scale)


def register_ffn_stats(stats: ServerStats, *, worker: str,
                       registry: CollectorRegistry = REGISTRY) -> FfnStatsCollector:
    collector = FfnStatsCollector(stats, worker)
    registry.register(collector)
    return collector


def register_engine_afd(read: Callable[[], dict[str, float]], *, worker: str,
                        registry: CollectorRegistry = REGISTRY) -> EngineAfdCollector:
    collector = EngineAfdCollector(read, worker)
    registry.register(collector)
    return collector
