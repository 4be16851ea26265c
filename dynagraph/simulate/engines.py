"""One simulated engine on the virtual clock: the mocker's ``EngineCore`` plus the worker's
KV event feed, stepped as the served ``MockerEngine`` steps it.

The served engine runs a step (``Scheduler.step``) when it starts, waits out its price,
then delivers the step's tokens and KV events; requests that arrive meanwhile join the
next step, which starts when the previous one ends; an idle or blocked engine waits for
the next request. :class:`SimEngine` keeps that state (``busy``: a step's end is due)
and leaves the clock to the fleet: :meth:`start_step` runs a step and says when it ends,
:meth:`finish_step` is called then and hands back its outputs and its net KV change
(the ``RelayBatch`` the worker's ``kv_events`` stream would carry to the Router).
"""

from __future__ import annotations

from dynagraph.llm.engines.base import EngineLoad
from dynagraph.llm.engines.mocker.core import EngineCore
from dynagraph.llm.engines.mocker.scheduler import Delta, StepResult
from dynagraph.llm.engines.mocker.sequence import Sequence
from dynagraph.llm.kv.events.relay import KvEventFeed
from dynagraph.llm.router.events import KvEvent, RelayBatch


class SimEngine:
    """An engine of the simulated fleet, ``worker_id`` as the Router knows it."""

    __slots__ = ("_last_load", "_sampled", "busy", "core", "feed", "pending", "version",
                 "waking", "worker_id")

    def __init__(self, worker_id: int, core: EngineCore, *, publish_kv_events: bool) -> None:
        self.worker_id = worker_id
        self.core = core
        self.feed = KvEventFeed() if publish_kv_events else None
        self.busy = False
        """A step is running; its end is due on the clock."""
        self.waking = False
        """A step start is due on the clock (requests arrived at an idle engine)."""
        self.pending: StepResult | None = None
        self.version = 0
        """Bumped by every change a load sample could show."""
        self._sampled = -1
        self._last_load: EngineLoad | None = None

    @property
    def idle(self) -> bool:
        """No step running or due, nothing to schedule."""
        return not self.busy and not self.waking and not self.core.scheduler.has_work

    def admit(self, seq: Sequence) -> None:
        self.core.admit(seq)
        self.version += 1

    def start_step(self) -> tuple[float, RelayBatch | None]:
        """Run one step now: (its duration, 0 when nothing could be scheduled; the KV change
        to publish now when nothing was). A step with work is held until
        :meth:`finish_step`."""
        self.waking = False
        result, duration = self.core.step()
        self.version += 1
        if not result.scheduled:  # blocked: waits for the next request, as served
            return 0.0, self._publish(result.events)
        self.busy = True
        self.pending = result
        return duration, None

    def finish_step(self) -> tuple[list[Delta], RelayBatch | None]:
        """The running step ended: its outputs and its KV change, in the served order."""
        result = self.pending
        assert result is not None
        self.pending = None
        self.busy = False
        return result.outputs, self._publish(result.events)

    def _publish(self, events: list[KvEvent]) -> RelayBatch | None:
        if self.feed is None or not events:
            return None
        return self.feed.publish(events)

    def sample_load(self) -> EngineLoad | None:
        """The load report if it changed since the last one returned (the worker's
        ``load_metrics`` stream sends changes only), else None."""
        if self.version == self._sampled:
            return None
        self._sampled = self.version
        load = self.core.load()
        if load == self._last_load:
            return None
        self._last_load = load
        return load
