"""Create prometheus_client metric objects from catalogue entries (name, help, labels)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dynagraph.observability.catalog import spec

LATENCY_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


def counter(name: str, registry: CollectorRegistry) -> Counter:
    s = spec(name)
    assert s.kind == "counter" and s.name.endswith("_total"), s
    return Counter(s.name.removesuffix("_total"), s.help, list(s.labels), registry=registry)


def gauge(name: str, registry: CollectorRegistry) -> Gauge:
    s = spec(name)
    assert s.kind == "gauge", s
    return Gauge(s.name, s.help, list(s.labels), registry=registry)


def histogram(name: str, registry: CollectorRegistry,
              buckets: tuple[float, ...] = LATENCY_BUCKETS) -> Histogram:
    s = spec(name)
    assert s.kind == "histogram", s
    return Histogram(s.name, s.help, list(s.labels), buckets=buckets, registry=registry)
