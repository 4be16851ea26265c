"""The load a Planner decides on: samples of the workers' load, averaged per interval.

``LoadWindow`` (pure) collects one ``Sample`` every ``metric-pulling-interval`` (the
decode engines' latest ``EngineLoad``s, as their ``load_metrics`` streams last reported
them, and the prefill-queue depth) and turns an adjustment interval's samples into an
``Observation``: mean KV usage over the engines, requests waiting and running per decode
replica and
prefill-queue jobs per prefill replica (per serving replica, at least one).

``LoadFollower`` keeps one ``load_metrics`` stream open per decode instance (as the
Router does) and remembers each one's latest load.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from dynagraph.errors import DynagraphError
from dynagraph.llm.engines.base import EngineLoad
from dynagraph.llm.protocol import Subscribe
from dynagraph.planner.policy import Observation
from dynagraph.sdk import direct

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sample:
    kv_usage: tuple[float, ...]
    """Each decode engine's fraction of KV blocks in use."""
    waiting: int
    """Requests waiting over all decode engines."""
    running: int
    """Requests running over all decode engines."""
    prefill_queue: int
    """Prefill-queue jobs not yet picked up."""

    @staticmethod
    def of(loads: Iterable[EngineLoad], prefill_queue: int = 0) -> Sample:
        loads = list(loads)
        return Sample(tuple(ld.kv_usage for ld in loads), sum(ld.waiting for ld in loads),
                      sum(ld.running for ld in loads), prefill_queue)


class LoadWindow:
    """Samples of one adjustment interval."""

    def __init__(self) -> None:
        self.samples: list[Sample] = []

    def add(self, sample: Sample) -> None:
        self.samples.append(sample)

    def observe(self, decode_replicas: int, prefill_replicas: int) -> Observation:
        """This interval's ``Observation`` (all zero without samples); empties the window."""
        samples, self.samples = self.samples, []
        return _mean(samples, decode_replicas, prefill_replicas)

    def recent(self, count: int, decode_replicas: int, prefill_replicas: int) -> Observation:
        """The ``Observation`` of the last ``count`` samples (the window is kept)."""
        return _mean(self.samples[-count:] if count > 0 else [], decode_replicas,
                     prefill_replicas)


def _mean(samples: list[Sample], decode_replicas: int, prefill_replicas: int) -> Observation:
    """The mean load of ``samples``, per serving replica (at least one)."""
    if not samples:
        return Observation()
    n = len(samples)
    kv = [sum(s.kv_usage) / len(s.kv_usage) for s in samples if s.kv_usage]
    return Observation(
        decode_kv_usage=sum(kv) / len(kv) if kv else 0.0,
        decode_waiting=sum(s.waiting for s in samples) / n / max(1, decode_replicas),
        decode_running=sum(s.running for s in samples) / n / max(1, decode_replicas),
        prefill_queue=sum(s.prefill_queue for s in samples) / n / max(1, prefill_replicas),
    )


class LoadFollower:
    """Follows the ``load_metrics`` stream of every instance of a worker component.

    ``load_metrics``: that endpoint of the component's client (``self.decode.load_metrics``
    of a ``depends()``); ``watch``: an ``InstanceWatch`` of it.
    """

    def __init__(self, load_metrics: Callable[[Subscribe], AsyncIterator[EngineLoad]],
                 watch: Any, reconnect_delay: float = 0.5) -> None:
        self.load_metrics = load_metrics
        self.watch = watch
        self.reconnect_delay = reconnect_delay
        self.loads: dict[int, EngineLoad] = {}
        self._tasks: dict[int, asyncio.Task[None]] = {}
        watch.subscribe(self._on_instances)
        self._on_instances(watch.instances())

    def current(self) -> list[EngineLoad]:
        """The latest load of every live instance that has reported one."""
        return [ld for w, ld in self.loads.items() if w in self._tasks]

    def _on_instances(self, instances: list[Any]) -> None:
        live = {i.instance_id for i in instances}
        for w in list(self._tasks):
            if w not in live:
                self._tasks.pop(w).cancel()
                self.loads.pop(w, None)
        for w in live - set(self._tasks):
            self._tasks[w] = asyncio.create_task(self._follow(w), name=f"planner-load-{w:x}")

    async def _follow(self, w: int) -> None:
        while True:
            try:
                stream = direct(self.load_metrics, Subscribe(), w)
                async with contextlib.aclosing(stream):
                    async for load in stream:
                        self.loads[w] = load
            except (DynagraphError, ValueError) as exc:
                log.debug("worker %x load stream: %s", w, exc)
            self.loads.pop(w, None)
            await asyncio.sleep(self.reconnect_delay)

    async def close(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.watch.close()
