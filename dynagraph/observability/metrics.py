"""Metric objects, built from the catalogue into an injected registry.

Every metric a dynagraph process exports is made here from its catalogue entry (name,
help, labels, buckets), so a name, its help text and its buckets have one owner
(``catalog``). Building is idempotent per registry: asking again for a name already
built in that registry returns the same object. Components therefore build their
metric groups in ``__init__`` from ``self.runtime.registry`` (the process's default
registry when served) without a per-process cache, and a test passes a fresh
``CollectorRegistry``.
"""

from __future__ import annotations

import threading
import weakref
from typing import TypeVar

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from dynagraph.observability.catalog import MetricSpec, spec

M = TypeVar("M", bound=MetricWrapperBase)

_built: weakref.WeakKeyDictionary[CollectorRegistry, dict[str, MetricWrapperBase]] = (
    weakref.WeakKeyDictionary()
)
_lock = threading.Lock()


def _get(name: str, registry: CollectorRegistry, kind: type[M]) -> M:
    s = spec(name)
    with _lock:
        made = _built.setdefault(registry, {})
        metric = made.get(s.name)
        if metric is None:
            metric = made[s.name] = _make(s, registry)
    if not isinstance(metric, kind):
        raise TypeError(f"metric {s.name} is a {s.kind}, not a {kind.__name__}")
    return metric


def _make(s: MetricSpec, registry: CollectorRegistry) -> MetricWrapperBase:
    labels = list(s.labels)
    if s.kind == "counter":
        return Counter(s.name.removesuffix("_total"), s.help, labels, registry=registry)
    if s.kind == "gauge":
        return Gauge(s.name, s.help, labels, registry=registry)
    return Histogram(s.name, s.help, labels, buckets=s.buckets, registry=registry)


def counter(name: str, registry: CollectorRegistry = REGISTRY) -> Counter:
    """The counter ``name`` (its catalogue name, ending in ``_total``) in ``registry``."""
    return _get(name, registry, Counter)


def gauge(name: str, registry: CollectorRegistry = REGISTRY) -> Gauge:
    return _get(name, registry, Gauge)


def histogram(name: str, registry: CollectorRegistry = REGISTRY) -> Histogram:
    return _get(name, registry, Histogram)
