"""Disaggregation metrics: where prefills ran, KV transfers, the prefill queue.

Decode worker (``dynagraph.llm.disagg.decode``): ``PrefillMetrics.observe(plan)`` per
request (``dynamo_worker_prefill_requests_total{where, reason}`` and the remote wait);
``DecodeMetrics.kv_transfer(nbytes, seconds)`` per KV transfer the engine finished
(vLLM's NixlConnector stats, via ``VllmEngine.observe_kv_transfers``) and
``queue_depth(n)`` every second from the queue's ``depth()``.

Prefill worker (``components/prefill_worker.py``): ``PrefillQueueMetrics.pulled(
enqueued_at, delivery_count)`` for every job it pulls (``PrefillJobHandler(observer=...)``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from prometheus_client import REGISTRY, CollectorRegistry

from dynagraph.observability.metrics import counter, gauge, histogram


class PlanLike(Protocol):
    """What ``PrefillMetrics`` reads of a ``dynagraph.llm.disagg.PrefillPlan``."""

    @property
    def label(self) -> str: ...
    @property
    def reason(self) -> str: ...
    @property
    def wanted_remote(self) -> bool: ...
    @property
    def wait_s(self) -> float: ...


class PrefillMetrics:
    """Decode side: where prefills ran and why, and how long remote ones waited."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.requests = counter("dynamo_worker_prefill_requests_total", registry)
        self.remote_wait = histogram("dynamo_worker_remote_prefill_wait_seconds", registry)

    def observe(self, plan: PlanLike) -> None:
        self.requests.labels(plan.label, plan.reason).inc()
        if plan.wanted_remote:
            self.remote_wait.observe(plan.wait_s)


class DecodeMetrics:
    def __init__(self, worker: str, registry: CollectorRegistry = REGISTRY) -> None:
        self.worker = worker
        self._transfers = counter("dynamo_worker_kv_transfers_total", registry).labels(worker)
        self._bytes = counter("dynamo_worker_kv_transfer_bytes_total", registry).labels(worker)
        self._seconds = histogram("dynamo_worker_kv_transfer_seconds", registry).labels(worker)
        self._depth = gauge("dynamo_prefill_queue_depth", registry)

    def kv_transfer(self, nbytes: int, seconds: float) -> None:
        self._transfers.inc()
        self._bytes.inc(nbytes)
        self._seconds.observe(seconds)

    def queue_depth(self, depth: int) -> None:
        self._depth.set(depth)


class PrefillQueueMetrics:
    def __init__(self, registry: CollectorRegistry = REGISTRY,
                 clock: Callable[[], float] = time.time) -> None:
        self._wait = histogram("dynamo_prefill_queue_wait_seconds", registry)
        self._redeliveries = counter("dynamo_prefill_queue_redeliveries_total", registry)
        self._clock = clock

    def pulled(self, enqueued_at: float, delivery_count: int) -> None:
        """A job was pulled: ``enqueued_at`` is its wall-clock stamp (``time.time()``)."""
        self._wait.observe(max(self._clock() - enqueued_at, 0.0))
        if delivery_count > 1:
            self._redeliveries.inc()
