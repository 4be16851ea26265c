"""The core keeper: the graph's processes keep off the cores vLLM bound its runners to."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dynagraph.cli.core_keeper import CoreKeeper, managed, plan
from dynagraph.runtime.nice import defer_renice, thread_ids

ALL = frozenset({0, 1, 2, 3})


def test_no_engine_bound_leaves_every_core() -> None:
    assert plan(ALL, {}).target == ALL
    unbound = plan(ALL, {10: ALL})  # an engine core that floats binds nothing
    assert unbound.target == ALL and not unbound.engine_cores and not unbound.keeps_off


def test_others_get_the_cores_no_runner_is_bound_to() -> None:
    got = plan(ALL, {10: ALL, 11: frozenset({0}), 12: frozenset({1})})
    assert got.engine_cores == {0, 1}
    assert got.target == {2, 3}
    assert got.keeps_off


def test_runners_on_every_core_leave_the_others_everywhere() -> None:
    got = plan(frozenset({0, 1}), {11: frozenset({0}), 12: frozenset({1})})
    assert got.target == {0, 1}
    assert not got.keeps_off


def test_the_keeper_binds_only_threads_with_every_core_or_its_own_cores() -> None:
    given = frozenset({1})
    assert managed(ALL, ALL, None)
    assert managed(given, ALL, given)  # inherited by a new thread or process
    assert not managed(frozenset({2}), ALL, given)  # bound by someone else
    assert not managed(given, ALL, None)


ROOT = """
import os, subprocess, sys, time
runner = subprocess.Popen([sys.executable, "-c", '''
import os, time
open("/proc/self/comm", "w").write("VLLM::Worker")
os.sched_setaffinity(0, {0})
print("bound", flush=True)
time.sleep(120)
'''], stdout=subprocess.PIPE, text=True)
assert runner.stdout.readline().strip() == "bound"
other = subprocess.Popen([sys.executable, "-c", '''
import threading, time
threading.Thread(target=time.sleep, args=(120,), daemon=True).start()
print("up", flush=True)
time.sleep(120)
'''], stdout=subprocess.PIPE, text=True)
assert other.stdout.readline().strip() == "up"
print(runner.pid, other.pid, flush=True)
sys.stdin.readline()  # the engine goes
runner.kill(); runner.wait()
print("gone", flush=True)
sys.stdin.readline()
other.kill(); other.wait()
"""


@pytest.fixture
def graph() -> Iterator[subprocess.Popen[str]]:
    """A root process with two children: a 'model runner' bound to core 0, and a
    two-threaded process with every core. A line to its stdin ends the runner."""
    root = subprocess.Popen([sys.executable, "-c", ROOT], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        yield root
    finally:
        assert root.stdin is not None
        root.stdin.close()
        try:
            root.wait(timeout=10)
        except subprocess.TimeoutExpired:
            root.kill()
            root.wait()


def _cores(pid: int) -> set[frozenset[int]]:
    return {frozenset(os.sched_getaffinity(t)) for t in thread_ids(pid)}


def _nice(pid: int) -> set[int]:
    return {os.getpriority(os.PRIO_PROCESS, t) for t in thread_ids(pid)}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to bind")
def test_a_served_graph_s_processes_leave_the_runner_s_core(
        graph: subprocess.Popen[str], tmp_path: Path) -> None:
    assert graph.stdout is not None and graph.stdin is not None
    runner, other = (int(x) for x in graph.stdout.readline().split())
    allowed = frozenset(os.sched_getaffinity(0))
    assert _cores(other) == {allowed}
    keeper = CoreKeeper(graph.pid, str(tmp_path), allowed)
    defer_renice([runner], 7, str(tmp_path))  # its worker's engine-nice
    got = keeper.scan()
    assert got.engine_cores == {0} and got.keeps_off
    assert _cores(other) == {allowed - {0}}  # both threads
    assert _cores(runner) == {frozenset({0})}  # vLLM's processes are never touched
    assert _cores(graph.pid) == {allowed}  # nor the root (what it starts gets every core)
    assert _nice(runner) == {0}  # its core is its own: no need to yield
    assert keeper.scan() == got  # a second pass changes nothing

    graph.stdin.write("end the runner\n")
    graph.stdin.flush()
    assert graph.stdout.readline().strip() == "gone"
    back = keeper.scan()  # the engine is gone: the others get every core back
    assert not back.engine_cores and back.target == allowed
    assert _cores(other) == {allowed}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to bind")
def test_an_engine_whose_cores_cannot_be_kept_free_gets_its_worker_s_niceness(
        graph: subprocess.Popen[str], tmp_path: Path) -> None:
    assert graph.stdout is not None
    runner, other = (int(x) for x in graph.stdout.readline().split())
    keeper = CoreKeeper(graph.pid, str(tmp_path), frozenset({0}))  # the runner has them all
    got = keeper.scan()
    assert not got.keeps_off and got.target == {0}
    assert _nice(runner) == {0}  # its worker has not said what it wants yet
    defer_renice([runner], 7, str(tmp_path))
    keeper.scan()
    assert _nice(runner) == {7}
    assert _cores(other) == {frozenset(os.sched_getaffinity(0))}  # not the keeper's to bind
    keeper.scan()
    assert _nice(runner) == {7}  # once, not again
