"""Lower the CPU priority of an engine's helper processes (``VllmWorker.engine-nice``).

Where the engines share cores with the Frontend, Processor, Router and etcd (a 2-core
box serving two vLLM workers), a fully loaded engine takes its equal share of a core from
processes that need little CPU but need it on time: a Processor that does not run for 4 s
misses its stream heartbeats (``StreamBroken``), a component that misses its lease
keep-alives drops out of discovery. A positive niceness on the engine's processes lets
the scheduler run those first and gives the engines everything left over.

On Linux niceness belongs to each thread, and a thread's new threads inherit it, so every
existing thread of every process is set (the engine's OpenMP threads already exist when
the engine is up).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

import psutil

log = logging.getLogger(__name__)

ENGINE_NICE_DIR_ENV = "DYNAGRAPH_ENGINE_NICE_DIR"
"""Set by ``dynamo serve`` while its core keeper runs (``dynagraph.cli.core_keeper``): a
worker does not renice its engine's processes but writes each one's niceness there
(``defer_renice``), and the keeper applies it where the engine shares cores with the
graph."""


def defer_renice(pids: Iterable[int], increment: int, directory: str) -> None:
    """Leave ``increment`` for ``pids`` to the core keeper: a file per pid in
    ``directory`` holding it."""
    os.makedirs(directory, exist_ok=True)
    for pid in pids:
        with open(os.path.join(directory, str(pid)), "w") as f:
            f.write(str(increment))


def deferred_nice(pid: int, directory: str) -> int | None:
    """The niceness ``defer_renice`` left for ``pid`` (None: none yet, or unreadable)."""
    try:
        with open(os.path.join(directory, str(pid))) as f:
            return max(0, min(19, int(f.read().strip())))
    except (OSError, ValueError):
        return None


def thread_ids(pid: int) -> list[int]:
    """The threads of process ``pid`` (empty once it is gone)."""
    try:
        return [t.id for t in psutil.Process(pid).threads()]
    except psutil.Error:
        return []


def renice(pids: Iterable[int], increment: int) -> int:
    """Add ``increment`` to the niceness of every thread of ``pids`` (capped at 19);
    returns how many threads were changed. Threads that vanish meanwhile are skipped."""
    if increment <= 0:
        return 0
    changed = 0
    for pid in pids:
        for tid in thread_ids(pid):
            try:
                now = os.getpriority(os.PRIO_PROCESS, tid)
                os.setpriority(os.PRIO_PROCESS, tid, min(19, now + increment))
                changed += 1
            except OSError:
                continue
    return changed
