"""Processor metrics: time in the Processor before dispatch, tokenize and detokenize time.

Use (built in the component's ``__init__``)::

    self.metrics = ProcessorMetrics(self.runtime.registry)
    ...
    timer = self.metrics.request()                         # at arrival
    with timer.tokenizing():
        pre = self.preprocessor.preprocess(...)
    detok = timer.timed(self.preprocessor.detokenizer(pre))  # times every process()
    ...                                                    # choose a worker
    timer.dispatched()                                     # just before calling it
    ...
    timer.finished()                                       # in a finally: records detokenize
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from prometheus_client import REGISTRY, CollectorRegistry

from dynagraph.observability.metrics import counter, histogram

T = TypeVar("T")


class ProcessorMetrics:
    """``dynamo_processor_{queue,tokenize,detokenize}_seconds`` in ``registry``."""

    def __init__(self, registry: CollectorRegistry = REGISTRY,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.queue = histogram("dynamo_processor_queue_seconds", registry)
        self.tokenize = histogram("dynamo_processor_tokenize_seconds", registry)
        self.detokenize = histogram("dynamo_processor_detokenize_seconds", registry)
        self.migrations = counter("dynamo_processor_migrations_total", registry)
        self.delayed = histogram("dynamo_processor_slo_delayed_seconds", registry)
        self.shed = counter("dynamo_processor_slo_shed_total", registry)
        self.clock = clock

    def migrated(self, worker: int | None, failure: Exception) -> None:
        """A request moved on from a failed worker (``migrating``'s ``on_migrate``)."""
        self.migrations.labels(type(failure).__name__).inc()

    def slo_delayed(self, slo_class: str, seconds: float) -> None:
        """SLO-aware admission let a request through after holding it ``seconds``."""
        self.delayed.labels(slo_class).observe(seconds)

    def slo_shed(self, slo_class: str) -> None:
        """SLO-aware admission refused a request."""
        self.shed.labels(slo_class).inc()

    def request(self) -> RequestTimer:
        """Start timing one request (call when it arrives)."""
        return RequestTimer(self)


class RequestTimer:
    """Times one request; every method is cheap and never raises."""

    def __init__(self, metrics: ProcessorMetrics) -> None:
        self._m = metrics
        self._arrived = metrics.clock()
        self._tokenize = 0.0
        self._detokenize = 0.0
        self._dispatched = False
        self._finished = False

    @contextmanager
    def tokenizing(self) -> Iterator[None]:
        t0 = self._m.clock()
        try:
            yield
        finally:
            self._tokenize += self._m.clock() - t0

    def dispatched(self) -> None:
        """The request is being sent to a worker: records queue and tokenize time (once)."""
        if self._dispatched:
            return
        self._dispatched = True
        waited = self._m.clock() - self._arrived - self._tokenize
        self._m.queue.observe(max(waited, 0.0))
        self._m.tokenize.observe(self._tokenize)

    def timed(self, detokenizer: T) -> T:
        """``detokenizer`` with its ``process`` method timed (same object, patched)."""
        process: Callable[..., Any] = detokenizer.process  # type: ignore[attr-defined]

        def timed_process(*args: Any, **kwargs: Any) -> Any:
            t0 = self._m.clock()
            try:
                return process(*args, **kwargs)
            finally:
                self._detokenize += self._m.clock() - t0

        detokenizer.process = timed_process  # type: ignore[attr-defined]
        return detokenizer

    def finished(self) -> None:
        """The response is complete (or abandoned): records detokenize time (once)."""
        if self._finished:
            return
        self._finished = True
        if self._dispatched:
            self._m.detokenize.observe(self._detokenize)
