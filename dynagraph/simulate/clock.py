"""The virtual clock: a queue of callbacks at simulated times. No wall clock anywhere.

Callbacks run in time order; callbacks due at the same time run in the order they were
scheduled (FIFO), so a run is a function of its inputs alone. ``now`` is the time of the
callback being run (or the last one run); a callback may schedule others at ``now`` or
later, never earlier.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from typing import Any


class Clock:
    """A discrete-event queue (see the module docstring)."""

    __slots__ = ("_heap", "_order", "now")

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._order = itertools.count()

    def at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` at simulated time ``when`` (not before ``now``)."""
        if when < self.now:
            raise ValueError(f"cannot schedule at {when} before now ({self.now})")
        heapq.heappush(self._heap, (when, next(self._order), fn, args))

    def next_time(self) -> float:
        """When the next callback is due (infinity when none is)."""
        return self._heap[0][0] if self._heap else math.inf

    def __len__(self) -> int:
        return len(self._heap)

    def run_next(self) -> bool:
        """Run the next callback; False when there is none."""
        if not self._heap:
            return False
        when, _, fn, args = heapq.heappop(self._heap)
        self.now = when
        fn(*args)
        return True
