"""``dynamo serve`` at run time: worker processes started or retired to reach a replica count.

``reconcile`` (pure) says which worker indexes to start and which to retire;
``RuntimeScaling`` (the supervisor's part that follows the scale keys of
``dynagraph.planner.connector`` and applies them) starts them, or retires them: SIGTERM,
so the worker withdraws from discovery and drains; SIGKILL if it has not exited after
``--drain-grace`` plus ``--stop-timeout``; never restarted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from dynagraph.aio import cancel_and_wait
from dynagraph.cli.startup import OutputFilter
from dynagraph.cli.startup_output import StartupOutput
from dynagraph.planner.connector import parse_replicas, scale_prefix
from dynagraph.runtime.procfs import (
    group_pids,
    is_resource_tracker,
    pid_alive,
    process_name,
    shm_files,
    unlink_orphaned_shm,
)
from dynagraph.sdk._graph import Graph
from dynagraph.sdk._service import spec_of

log = logging.getLogger("dynagraph.serve")


def reconcile(active: Collection[int], retiring: Collection[int], want: int
              ) -> tuple[list[int], list[int]]:
    """``(start, retire)``: worker indexes to start and to retire so that ``want``
    processes are active.

    New workers take the lowest indexes not used by an active or a still-draining one (an
    index picks the worker's GPUs, ``resources: {gpu: N}``, which a draining worker still
    holds); the highest-numbered active workers are retired first.
    """
    if want < 0:
        raise ValueError(f"want must be >= 0, got {want}")
    if want <= len(active):
        return [], sorted(active, reverse=True)[: len(active) - want]
    used = set(active) | set(retiring)
    start: list[int] = []
    i = 0
    while len(start) < want - len(active):
        if i not in used:
            start.append(i)
        i += 1
    return start, []


@dataclass
class Child:
    """One worker process of the graph (``Component:index``), as the supervisor runs it."""

    component: str
    index: int
    env: dict[str, str]
    proc: asyncio.subprocess.Process | None = None
    restarts: list[float] = field(default_factory=list)
    pump: asyncio.Task[None] | None = None
    output: OutputFilter | None = None
    retiring: bool = False
    """Scaled down: draining, then gone (not restarted)."""

    @property
    def label(self) -> str:
        return f"{self.component}:{self.index}"

    @property
    def name(self) -> str:
        """``Component[i]``, as progress lines and the ready banner name it."""
        return f"{self.component}[{self.index}]"


TRACKER_GRACE_S = 2.0
"""How long a swept group's multiprocessing resource trackers get to unlink what its
killed processes registered (vLLM's semaphores) and exit, before they are killed too."""


async def sweep_group(child: Child) -> None:
    """SIGKILL whatever is left in the child's process group (e.g. an engine core that
    outlived a killed worker). Each child leads its own group (start_new_session).

    The shared-memory files the leftovers mapped are removed unless some other process
    maps them. A multiprocessing resource tracker in the group is killed last: it is the
    one that knows the semaphores of an engine core already gone (it unlinks them when
    the last process holding its pipe exits, then exits too). Killed with the rest, it
    leaves their ``/dev/shm/sem.mp-*`` files behind."""
    if child.proc is None:
        return
    pgid = child.proc.pid
    members = set(group_pids(pgid))
    segments = shm_files(sorted(members))  # before the kill: their maps go with them
    trackers = {pid for pid in members if is_resource_tracker(pid)}
    living = {pid: process_name(pid) for pid in members - trackers if pid_alive(pid)}
    for pid in living:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + TRACKER_GRACE_S
    # Not our children (nothing to await): poll /proc.
    while any(map(pid_alive, trackers)) and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)  # what is left, or was forked meanwhile
    if living:
        log.warning("%s left processes behind (%s); killed its process group", child.label,
                    ", ".join(f"{name} {pid}" for pid, name in sorted(living.items())))
    removed = unlink_orphaned_shm(segments, members | {pgid})
    if removed:
        log.info("%s: removed %d shared-memory segments it left (%s)", child.label,
                 len(removed), ", ".join(removed))


class RuntimeScaling:
    """The supervisor's scaling at run time (mixed into ``dynagraph.cli.serve.Supervisor``,
    which provides these attributes and ``_start_child``)."""

    graph: Graph
    started: Mapping[str, Any]
    """The components this serve runs (``--service-name``): only their scale keys apply."""
    children: list[Child]
    stopping: asyncio.Event
    startup: StartupOutput | None
    _children_changed: asyncio.Event
    _retirements: set[asyncio.Task[None]]

    @property
    def _drain_limit(self) -> float:
        raise NotImplementedError

    async def _start_child(self, name: str, index: int, spec_path: str) -> None:
        raise NotImplementedError

    async def _follow_scale(self, discovery: Any, spec_path: str) -> None:
        """Apply every scale key of the components this serve runs (current values first;
        another host's components are that host's ``dynamo serve``'s)."""
        names = set(self.started)
        namespaces = {spec_of(c).namespace for c in self.graph.nodes}
        streams = [discovery.watch_prefix(scale_prefix(ns)) for ns in namespaces]
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        async def pump(stream: Any) -> None:
            async for item in stream:
                queue.put_nowait(item)

        pumps = [asyncio.create_task(pump(st), name="scale-watch") for st in streams]
        try:
            while not self.stopping.is_set():
                key, value = await queue.get()
                name = key.rsplit("/", 1)[-1]
                want = parse_replicas(value)
                if name not in names:
                    continue
                host = self.started[name].service_args.embed_in
                if want is not None and host is not None:
                    log.warning("ignoring %s = %r: %s runs inside %s's processes; scale "
                                "that", key, value, name, host)
                    continue
                if want is None:
                    if value is not None:
                        log.warning("ignoring %s = %r: not a replica count", key, value)
                    continue
                await self._scale_to(name, want, spec_path)
        finally:
            await cancel_and_wait(pumps)
            for st in streams:
                with contextlib.suppress(Exception):
                    await st.aclose()

    async def _scale_to(self, name: str, want: int, spec_path: str) -> None:
        mine = [c for c in self.children if c.component == name]
        active = {c.index: c for c in mine if not c.retiring}
        retiring = [c.index for c in mine if c.retiring]
        start, retire = reconcile(list(active), retiring, want)
        if start or retire:
            log.info("scaling %s from %d to %d worker(s)", name, len(active), want)
        for i in retire:
            child = active[i]
            child.retiring = True
            task = asyncio.create_task(self._retire(child), name=f"retire-{child.label}")
            self._retirements.add(task)
            task.add_done_callback(self._retirements.discard)
        for i in start:
            await self._start_child(name, i, spec_path)
        self._children_changed.set()

    async def _retire(self, child: Child) -> None:
        """SIGTERM (the child drains), SIGKILL if it outlives its drain; then forget it."""
        assert child.proc is not None
        with contextlib.suppress(ProcessLookupError):
            child.proc.send_signal(signal.SIGTERM)
        limit = self._drain_limit
        try:
            await asyncio.wait_for(child.proc.wait(), limit)
            log.info("%s retired (exit code %s)", child.label, child.proc.returncode)
        except TimeoutError:
            log.warning("%s did not drain in %.0fs: SIGKILL", child.label, limit)
            with contextlib.suppress(ProcessLookupError):
                child.proc.kill()
            await asyncio.wait_for(child.proc.wait(), 5)
        finally:
            await sweep_group(child)
            if self.startup is not None:
                self.startup.exited(child.name)
            if child.pump is not None:
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(child.pump, 2)
            if child in self.children:
                self.children.remove(child)
