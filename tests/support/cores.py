"""What ``dynamo serve``'s core keeper did to a served graph (``dynagraph.cli.core_keeper``),
checked from ``/proc``."""

from __future__ import annotations

import os
from pathlib import Path

from dynagraph.cli.core_keeper import ENGINE_PREFIX, Plan, plan
from dynagraph.runtime.procfs import descendants, thread_ids


def assert_cores_kept(serve_pid: int, output: str, engine_nice: int = 19) -> Plan:
    """Every thread of the graph's own processes on the cores no model runner is bound
    to; vLLM's processes at niceness 0 while that keeps them free, else at
    ``engine_nice``. Returns the plan it checked against."""
    engines: dict[int, frozenset[int]] = {}
    others: list[int] = []
    for pid in descendants(serve_pid):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if name.startswith(ENGINE_PREFIX):
            engines[pid] = frozenset(os.sched_getaffinity(pid))
        else:
            others.append(pid)
    assert engines, "no vLLM engine process in the graph"
    want = plan(frozenset(os.sched_getaffinity(serve_pid)), engines)
    cores = {frozenset(os.sched_getaffinity(t)) for pid in others for t in thread_ids(pid)}
    assert cores == {want.target}, (cores, want)
    nice = {os.getpriority(os.PRIO_PROCESS, t) for pid in engines for t in thread_ids(pid)}
    if want.keeps_off:  # vLLM bound its runners to some of the cores: say which
        assert "graph processes keep off the engines' cores" in output
        assert nice == {0}, nice
    else:
        assert nice == {engine_nice}, nice
    return want
