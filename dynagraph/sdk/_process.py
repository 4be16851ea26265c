"""Several instances of one component in one process (``instances-per-process``).

``dynamo serve`` starts one process per component worker; a component that opts in
(``@service(instances_key="engines-per-process")``, see
``dynagraph.sdk._config.instances_per_process``) runs ``count`` instances in that process.
Each instance is what a process of its own would be: its own discovery (lease, hence
instance id), ``ComponentRuntime``, request-plane server and registrations, so callers,
the Router and readiness counting see ``count`` independent instances. They share the
process's event loop, metrics server and registry (metrics are labelled per instance
where the component does so).

Instance ``k`` of worker process ``index`` gets ``worker_index = index * count + k``, so
worker indexes stay unique across the component. Instances start concurrently; if one
fails, the others are stopped and the error is raised (the supervisor restarts the
process). Stop: every instance withdraws and drains at once, then the leases are
revoked. With more than one instance, the per-instance start-up lines (lease granted,
server listening) are shown only at ``--log-level debug``, and the process reports
"ready" to ``dynamo serve`` once, when all its instances are (256 engines do not print
768 lines).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

from dynagraph.runtime import progress
from dynagraph.sdk._graph import Graph
from dynagraph.sdk._runtime import ComponentRuntime
from dynagraph.sdk._service import spec_of

log = logging.getLogger(__name__)

CLOSE_TIMEOUT_S = 5.0
PER_INSTANCE_LOGGERS = ("dynagraph.runtime.discovery._etcd", "dynagraph.runtime.rpc._server",
                        "dynagraph.sdk._runtime")
"""Loggers whose INFO start-up lines are per instance."""


@contextlib.contextmanager
def _quiet(names: tuple[str, ...]) -> Iterator[None]:
    """Their INFO lines are not shown meanwhile (WARNING and above still are)."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        if lg.getEffectiveLevel() < logging.WARNING and lg.getEffectiveLevel() >= logging.INFO:
            lg.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


class ProcessInstances:
    """Runs ``count`` instances of ``cls`` here; ``start()`` then ``stop()``.

    ``new_discovery()`` returns an unstarted discovery client (e.g. ``discovery_from_env``);
    one is made per instance.
    """

    def __init__(self, graph: Graph, cls: type, values: dict[str, Any], *, count: int,
                 new_discovery: Callable[[], Any], worker_index: int = 0,
                 nats_url: str | None = None, metrics_address: str | None = None,
                 host: str = "127.0.0.1", labels: dict[str, Any] | None = None,
                 embedded: bool = False) -> None:
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        self.graph = graph
        self.cls = cls
        self.values = values
        self.count = count
        self.new_discovery = new_discovery
        self.worker_index = worker_index
        self.nats_url = nats_url
        self.metrics_address = metrics_address
        self.host = host
        """Where every instance's request plane binds and what it publishes (``--host``)."""
        self.labels = labels
        """Published with every instance (``serve_id``)."""
        self.embedded = embedded
        """Runs inside its caller's process (``ServiceArgs.embed-in``): callers here reach
        it without the socket."""
        self.runtimes: list[ComponentRuntime] = []
        self._discoveries: list[Any] = []

    @property
    def instances(self) -> list[Any]:
        """The component objects started so far."""
        return [rt.instance for rt in self.runtimes if rt.instance is not None]

    async def start(self) -> None:
        """Start every instance (concurrently); on a failure stop them all and raise."""
        with _quiet(PER_INSTANCE_LOGGERS) if self.count > 1 else contextlib.nullcontext():
            try:
                await asyncio.gather(*(self._start_one(k) for k in range(self.count)))
            except BaseException:
                await self.stop()
                raise
        if self.count > 1:
            first, last = self.worker_index * self.count, (self.worker_index + 1) * self.count - 1
            ids = sorted(rt.discovery.instance_id for rt in self.runtimes)
            progress.report("ready", f"{self.count} instances (worker_index {first}-{last}, "
                            f"instance ids {ids[0]:x} ... {ids[-1]:x})",
                            label=f"{spec_of(self.cls).name}[{first}-{last}]")

    async def _start_one(self, k: int) -> None:
        discovery = self.new_discovery()
        self._discoveries.append(discovery)
        await discovery.start()
        runtime = ComponentRuntime(self.graph, self.cls, self.values, discovery=discovery,
                                   worker_index=self.worker_index * self.count + k,
                                   nats_url=self.nats_url, metrics_address=self.metrics_address,
                                   # an embedded component is ready when its host is
                                   report_ready=self.count == 1 and not self.embedded,
                                   host=self.host,
                                   labels=self.labels, local_calls=self.embedded)
        self.runtimes.append(runtime)
        await runtime.start()

    async def stop(self) -> None:
        """Stop every instance, then revoke every lease. Idempotent; never raises."""
        runtimes, self.runtimes = self.runtimes, []
        discoveries, self._discoveries = self._discoveries, []
        for result in await asyncio.gather(*(rt.stop() for rt in runtimes),
                                           return_exceptions=True):
            if isinstance(result, BaseException):
                log.error("stopping an instance of %s failed: %r", self.cls.__name__, result)
        for result in await asyncio.gather(
                *(asyncio.wait_for(d.close(), CLOSE_TIMEOUT_S) for d in discoveries),
                return_exceptions=True):
            if isinstance(result, BaseException):
                log.warning("closing an instance's discovery failed: %r", result)
