"""Rebalancing: which workers hand back requests still waiting for a place. Pure, no I/O.

The Router places a request when it arrives, on what it knows then. When a burst meets
a fleet that is still growing, the requests of its first seconds queue on the workers
that were there, and stay queued there after new workers come up idle: a worker runs at
most ``max_num_seqs`` requests at once and the rest wait until places free, one every
``request_s / max_num_seqs`` s. So whenever places are free somewhere, the Router asks the
workers whose queues are long to hand back the requests that would wait there longer
than ``min_wait_s`` (the newest first: the last in line). A handed-back request has
produced nothing yet; the Processor places it again (``Requeued``), and the Router's
cost decides where, its cached prefix included.

:func:`releases` decides how many per worker: at most as many as there are free places
(``slots - active`` over the workers with known slots), from the longest queues first;
a worker keeps the waiting requests that start within ``min_wait_s``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class QueueView:
    """What the Router knows of one worker's queue."""

    worker_id: int
    active: int
    """Requests running or waiting there (reported, or routed there if more)."""
    waiting: int
    """Requests waiting for a place (reported)."""
    slots: int
    """Requests it runs at once (``max_num_seqs``; 0 = unknown: never rebalanced)."""
    request_s: float
    """Seconds a request stays there (learned)."""


def releases(queues: Iterable[QueueView], *, min_wait_s: float) -> dict[int, int]:
    """Per worker, the waiting requests to hand back (only workers with some)."""
    views = [q for q in queues if q.slots > 0]
    free = sum(max(q.slots - q.active, 0) for q in views)
    out: dict[int, int] = {}
    for q in sorted(views, key=lambda q: (-q.waiting, q.worker_id)):
        if free <= 0 or q.waiting <= 0:
            break
        # the k-th waiting request starts after about k * request_s / slots seconds
        keep = int(min_wait_s * q.slots / q.request_s) if q.request_s > 0 else q.waiting
        n = min(q.waiting - keep, free)
        if n > 0:
            out[q.worker_id] = n
            free -= n
    return out
