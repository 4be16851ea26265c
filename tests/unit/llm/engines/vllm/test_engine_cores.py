"""An engine core started by a worker the core keeper bound goes back on the graph's cores
before vLLM picks its model runner's (``dynagraph.llm.engines.vllm.engine_cores``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dynagraph.llm.engines.vllm.engine_cores import graph_cpus
from dynagraph.runtime.cpus import GRAPH_CPUS_ENV


def test_only_an_engine_core_and_only_where_dynamo_serve_names_the_cores() -> None:
    env = {GRAPH_CPUS_ENV: "0,1,3"}
    assert graph_cpus(env, "EngineCore_DP0") == {0, 1, 3}
    assert graph_cpus(env, "VllmWorker") is None  # a worker stays where the keeper put it
    assert graph_cpus({}, "EngineCore_DP0") is None  # not under dynamo serve's keeper
    assert graph_cpus({GRAPH_CPUS_ENV: "0-1"}, "EngineCore_DP0") is None  # malformed


def test_vllm_loads_it_as_a_general_plugin() -> None:
    from importlib.metadata import entry_points

    names = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert names.get("dynagraph_engine_cores") == "dynagraph.llm.engines.vllm.engine_cores:register"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to bind")
def test_an_engine_core_of_a_bound_worker_starts_on_every_graph_core() -> None:
    """A fresh process named as vLLM names its engine core, bound as a kept-off worker
    hands it down; what vLLM's bind would read afterwards is the graph's cores."""
    allowed = sorted(os.sched_getaffinity(0))
    code = (
        "import multiprocessing, os\n"
        f"os.sched_setaffinity(0, {{{allowed[-1]}}})\n"
        "multiprocessing.current_process().name = 'EngineCore_DP0'\n"
        "from dynagraph.llm.engines.vllm import engine_cores\n"
        "engine_cores.register()\n"
        "print(sorted(os.sched_getaffinity(0)))\n")
    env = {**os.environ, GRAPH_CPUS_ENV: ",".join(str(c) for c in allowed)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=False, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(allowed)
