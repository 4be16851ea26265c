"""Keep a graph's own processes off the cores its engines bound their model runners to
(``dynamo serve --engine-cores keep-off``, the default).

vLLM on the CPU binds each model runner's OpenMP threads to cores
(``VLLM_CPU_OMP_THREADS_BIND``; by default the first allowed core of a 2-core box) and
leaves the engine core and the API server free to run anywhere. Ours are the Frontend, VllmWorker, Router and the embedded etcd
and NATS: the kernel put them on the runner's core too, more so since the runner runs at
niceness 19 (``engine-nice``), whose tiny weight makes its core look idle to the load
balancer. A forward pass is one thread on that core, so every moment it spends on the run
queue behind one of ours lengthens the step for all the streams in it.

The keeper (``dynamo serve`` runs it every ``INTERVAL_S`` once the graph is ready):

- looks at the processes below ``dynamo serve``. vLLM's engine processes (named
  ``VLLM::...``: the engine core, the model runners) are never touched: their placement
  is vLLM's (the engine core floats, and runs on the runner's core while the runner
  waits for it);
- the engine cores are those of the ``VLLM::`` processes bound to fewer cores than
  ``dynamo serve`` may use (a NIXL engine's too: vLLM's NIXL worker binds its engine
  core's main thread to the last core, ``dynagraph.llm.kv.transfer.nixl_connector``);
- every thread of every other process is bound to the remaining cores, if any remain; where
  none remain (say two workers, one per core of a 2-core box) or no engine is bound, the
  threads it bound before get all the cores back.

Niceness (``VllmWorker.engine-nice``) exists so that a loaded engine does not starve the
graph's light processes where they share cores. Under the keeper, the engine processes
are left at niceness 0 while it keeps the graph off their runners' cores: a worker that
sees ``ENGINE_NICE_DIR_ENV`` (``dynagraph.runtime.nice``) does not renice them but
leaves its ``engine-nice`` for each in that directory. Where the keeper cannot keep the
graph off (no runner bound, or every core bound), it gives each engine process that
niceness, as the worker would have. A runner at 19 has so small a weight that the kernel
puts anything on its core, the benchmark client included. Niceness only goes up without
privileges, so an engine once reniced stays so. The graph's own processes keep their
niceness (renicing them as well made fewer tokens per second; see
``benchmarks/results/HISTORY.md``).

``dynamo serve`` itself is not bound, so a component it starts or restarts begins with
every core; threads created later in a bound process inherit its binding. An engine
started by a worker already bound (a restart, a scale-up) would inherit it too, and vLLM
picks the runner's cores among its engine process's: a vLLM plugin puts each engine core
back on the graph's cores first (``dynagraph.llm.engines.vllm.engine_cores``). Threads someone else bound
(neither every core nor the keeper's cores) are left alone.

Planning is pure (``plan``); ``CoreKeeper.scan`` reads ``/proc`` and applies it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

import psutil

from dynagraph.runtime.cpus import cpu_list
from dynagraph.runtime.nice import deferred_nice, renice, thread_ids

log = logging.getLogger(__name__)

INTERVAL_S = 2.0
"""How often ``dynamo serve`` re-applies the plan (new threads, restarted components)."""
ENGINE_PREFIX = "VLLM::"
"""Process names (``/proc/<pid>/comm``) of vLLM's engine processes."""


@dataclass(frozen=True)
class Plan:
    engine_cores: frozenset[int]
    """Cores the engines' processes are bound to (empty: none is bound)."""
    target: frozenset[int]
    """What every thread of the graph's other processes gets."""

    @property
    def keeps_off(self) -> bool:
        """Whether the others are bound away from the engines' cores."""
        return bool(self.engine_cores) and self.target.isdisjoint(self.engine_cores)


def plan(allowed: frozenset[int], engines: Mapping[int, frozenset[int]]) -> Plan:
    """``allowed``: the cores ``dynamo serve`` may use; ``engines``: each engine
    process's cores. The others get ``allowed`` less every core an engine is bound to,
    or ``allowed`` where that leaves none."""
    bound: set[int] = set()
    for cores in engines.values():
        if cores < allowed:
            bound |= cores
    rest = allowed - bound
    if not bound or not rest:
        return Plan(frozenset(bound), allowed)
    return Plan(frozenset(bound), frozenset(rest))


def managed(current: frozenset[int], allowed: frozenset[int],
            given: frozenset[int] | None) -> bool:
    """Whether a thread bound to ``current`` is the keeper's to bind: it has every core,
    or what the keeper gave it (inherited by a new thread or process, too)."""
    return current == allowed or current == given


class CoreKeeper:
    """Applies ``plan`` to the processes below ``root`` (``dynamo serve``'s pid)."""

    def __init__(self, root: int, nice_dir: str, allowed: frozenset[int] | None = None
                 ) -> None:
        """``nice_dir``: where workers leave their engines' niceness (``defer_renice``)."""
        self.root = root
        self.nice_dir = nice_dir
        self.allowed = allowed if allowed is not None else frozenset(os.sched_getaffinity(root))
        self.given: frozenset[int] | None = None
        """What the keeper last bound threads to (None: nothing yet)."""
        self.last: Plan | None = None
        self.reniced: set[int] = set()
        """Engine processes given their niceness (it only goes up)."""

    def scan(self) -> Plan:
        """One pass: returns the plan it applied (logged when it changes)."""
        engines, others = split_processes(self.root)
        now = plan(self.allowed, engines)
        changed = 0
        for pid in others:
            for tid in thread_ids(pid):
                cores = _affinity(tid)
                if cores is None or cores == now.target:
                    continue
                if managed(cores, self.allowed, self.given) and _bind(tid, now.target):
                    changed += 1
        self.given = now.target
        if not now.keeps_off:  # the engines share cores with the graph: let it go first
            for pid in engines.keys() - self.reniced:
                want = deferred_nice(pid, self.nice_dir)
                if want is None:
                    continue  # its worker has not said yet (its engine is starting)
                if want:
                    threads = renice([pid], want)
                    log.info("engine process %d shares cores with the graph: niceness "
                             "+%d on %d threads", pid, want, threads)
                self.reniced.add(pid)
        self.reniced &= engines.keys()
        if now != self.last:
            if now.keeps_off:
                log.info("graph processes keep off the engines' cores %s: %d threads on %s",
                         cpu_list(now.engine_cores), changed, cpu_list(now.target))
            elif self.last is not None and self.last.keeps_off:
                log.info("graph processes back on every core %s (%d threads)",
                         cpu_list(now.target), changed)
            self.last = now
        return now


def split_processes(root: int) -> tuple[dict[int, frozenset[int]], list[int]]:
    """The processes below ``root``: vLLM's engine processes with their cores, and the
    others (processes gone meanwhile are left out)."""
    engines: dict[int, frozenset[int]] = {}
    others: list[int] = []
    try:
        children = psutil.Process(root).children(recursive=True)
    except psutil.Error:
        return engines, others
    for proc in children:
        try:
            if proc.name().startswith(ENGINE_PREFIX):
                engines[proc.pid] = frozenset(proc.cpu_affinity())
            else:
                others.append(proc.pid)
        except psutil.Error:
            continue
    return engines, others


def _affinity(tid: int) -> frozenset[int] | None:
    try:
        return frozenset(os.sched_getaffinity(tid))
    except OSError:  # gone meanwhile
        return None


def _bind(tid: int, cores: frozenset[int]) -> bool:
    try:
        os.sched_setaffinity(tid, cores)
        return True
    except OSError:  # gone meanwhile, or not ours to change
        return False
