"""The Router's pressure summary for SLO-aware admission, and the class-aware cost knob.

``PressureView`` counts the requests this Router has in flight on each worker (from
routing until the caller closes the stream: immediate, where the workers' own reports lag
by up to a sampling interval) and summarises each candidate's load as a
:class:`~dynagraph.llm.tenants.slo_admission.Pressure`, which travels back with the
decision. ``class_overlap_weight`` scales the cost's overlap weight by the request's SLO
class: below 1 an ``interactive`` request weighs queueing more than a cache hit, above 1
a ``batch`` request prefers the cache hit (less work for the fleet). Pure, no I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from dynagraph.llm.router.state import NO_LOAD, RouterState
from dynagraph.llm.tenants.slo_admission import Pressure, WorkerPressure

DEFAULT_CLASS_OVERLAP_WEIGHTS: dict[str, float] = {"interactive": 0.5, "batch": 2.0}


def class_overlap_weight(overlap_weight: float, slo_class: str | None,
                         scales: Mapping[str, float]) -> float:
    """``overlap_weight`` scaled for ``slo_class`` (unlisted classes: unchanged)."""
    if slo_class is None:
        return overlap_weight
    return overlap_weight * scales.get(slo_class, 1.0)


class PressureView:
    def __init__(self) -> None:
        self.inflight: dict[int, int] = {}

    def begin(self, w: int) -> None:
        self.inflight[w] = self.inflight.get(w, 0) + 1

    def end(self, w: int) -> None:
        n = self.inflight.get(w, 0) - 1
        if n > 0:
            self.inflight[w] = n
        else:
            self.inflight.pop(w, None)

    def summary(self, state: RouterState, allowed: Collection[int] | None = None,
                predicted_ttft_s: Mapping[int, float] | None = None) -> Pressure:
        """The pressure of the workers a decision chooses among (the healthy live ones
        among ``allowed``, else the live ones), in ascending id order."""
        live = state.live if allowed is None else state.live & set(allowed)
        candidates = (state.healthy & live) or live
        predicted = predicted_ttft_s or {}
        out: list[WorkerPressure] = []
        for w in sorted(candidates):
            rep = state.reported.get(w, NO_LOAD)
            queue = state.queues.get(w)
            prefilling = max(rep.prefilling, queue.prefilling if queue is not None else 0)
            out.append(WorkerPressure(worker_id=w, running=rep.running, waiting=rep.waiting,
                                      inflight=self.inflight.get(w, 0),
                                      kv_usage=round(rep.kv_usage, 4),
                                      predicted_ttft_s=predicted.get(w),
                                      prefilling=prefilling))
        return Pressure(workers=out)
