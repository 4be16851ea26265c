"""What ``dynamo serve``'s core keeper did to a served graph (``dynagraph.cli.core_keeper``),
checked from ``/proc``."""

from __future__ import annotations

import os

from dynagraph.cli.core_keeper import Plan, plan, split_processes
from dynagraph.runtime.nice import thread_ids


def assert_cores_kept(serve_pid: int, output: str, engine_nice: int = 19) -> Plan:
    """Every thread of the graph's own processes on the cores no model runner is bound
    to; vLLM's processes at niceness 0 while that keeps them free, else at
    ``engine_nice``. Returns the plan it checked against."""
    engines, others = split_processes(serve_pid)
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
