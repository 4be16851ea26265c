"""The engine fork server: what a child started from it gets (its starter's environment,
the same server for its own children, OpenMP's cores and threads). Real processes, no
vLLM: the server preloads nothing here."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from typing import Any

import pytest

from dynagraph.llm.engines.vllm import forkserver as fs


@pytest.mark.parametrize(("env", "cores"), [
    ({"OMP_PLACES": "{0,1,2}", "OMP_PROC_BIND": "true"}, {0, 1, 2}),
    ({"OMP_PLACES": "{3}"}, {3}),
    ({"OMP_PLACES": "{0,1}", "OMP_PROC_BIND": "false"}, None),
    ({"GOMP_CPU_AFFINITY": "0 2-3"}, {0, 2, 3}),
    ({"KMP_AFFINITY": "granularity=fine,explicit,proclist=[1,4]"}, {1, 4}),
    ({"OMP_PLACES": "cores"}, None),
    ({}, None),
])
def test_openmp_cores_reads_the_forms_vllm_writes(env: dict[str, str],
                                                   cores: set[int] | None) -> None:
    assert fs.openmp_cores(env) == (frozenset(cores) if cores is not None else None)


@pytest.mark.parametrize(("raw", "threads"), [("4", 4), ("2,1", 2), ("", None), ("x", None),
                                               ("0", None)])
def test_openmp_threads(raw: str, threads: int | None) -> None:
    assert fs.openmp_threads({"OMP_NUM_THREADS": raw}) == threads


def test_only_the_cpu_build_and_not_when_turned_off() -> None:
    assert fs.wanted(True, "forkserver")
    assert not fs.wanted(False, "forkserver")
    assert not fs.wanted(True, "spawn")


def _report(queue: Any) -> None:
    affinity = sorted(os.sched_getaffinity(0))
    import torch

    queue.put((os.getpid(), os.getppid(), os.environ.get("PROBE"), affinity,
               torch.get_num_threads()))


def _child(queue: Any) -> None:
    _report(queue)
    os.environ["PROBE"] = "set by the child"
    grandchild = fs.CONTEXT.Process(target=_report, args=(queue,))
    grandchild.start()
    grandchild.join()


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """A fork server that preloads only torch (what OpenMP's settings matter to)."""
    monkeypatch.setattr(fs, "PRELOAD", ["torch"])
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "1")  # start() sets these two:
    monkeypatch.setenv("LD_PRELOAD", os.environ.get("LD_PRELOAD", ""))  # restored after
    fs.start()
    yield multiprocessing.forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    fs.stop()


def test_a_child_has_its_starters_environment_and_its_children_the_same_server(
        server: int, monkeypatch: pytest.MonkeyPatch) -> None:
    core = sorted(os.sched_getaffinity(0))[-1]
    monkeypatch.setenv("PROBE", "set by the test")
    monkeypatch.setenv("OMP_PLACES", f"{{{core}}}")  # as vLLM sets them for a model runner
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    queue = fs.CONTEXT.SimpleQueue()
    child = fs.CONTEXT.Process(target=_child, args=(queue,))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0
    (_, child_parent, child_env, child_cores, child_threads) = queue.get()
    (_, grandchild_parent, grandchild_env, *_) = queue.get()
    assert child_env == "set by the test"  # not the server's environment
    assert grandchild_env == "set by the child"
    assert child_parent == grandchild_parent == server  # no second server
    assert child_cores == [core]
    assert child_threads == 1
