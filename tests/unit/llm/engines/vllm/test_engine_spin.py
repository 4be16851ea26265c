"""The engine core's busy-wait for its model runner (``engine-core-spin-s``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import pytest

from dynagraph.llm.engines.vllm.adapter import patch_spin_condition
from dynagraph.llm.engines.vllm.args import VllmEngineArgs
from dynagraph.llm.engines.vllm.engine_spin import SPIN_ENV, engine_core_spin_s
from dynagraph.llm.engines.vllm.env import apply_env


def test_only_the_engine_core_and_only_when_asked() -> None:
    assert engine_core_spin_s({}, "EngineCore") is None
    assert engine_core_spin_s({SPIN_ENV: ""}, "EngineCore") is None
    assert engine_core_spin_s({SPIN_ENV: "0.0"}, "EngineCore") == 0.0
    assert engine_core_spin_s({SPIN_ENV: "0.25"}, "EngineCore_DP1") == 0.25
    assert engine_core_spin_s({SPIN_ENV: "-1"}, "EngineCore") == 0.0
    assert engine_core_spin_s({SPIN_ENV: "soon"}, "EngineCore") is None
    # The VllmWorker itself (an in-process engine core), the model runner, vLLM's server.
    for name in ("MainProcess", "VllmWorker-0", "APIServer"):
        assert engine_core_spin_s({SPIN_ENV: "0"}, name) is None


class FakeSpinCondition:
    """vLLM 0.32's ``SpinCondition`` reader; records the waits the patch passes on."""

    def __init__(self, is_reader: bool, context: Any, notify_address: str,
                 busy_loop_s: float = 1) -> None:
        self.busy_loop_s = busy_loop_s
        self.last_read = time.monotonic()
        self.waits: list[int | None] = []

    def wait(self, timeout_ms: int | None = None) -> None:
        self.waits.append(timeout_ms)


def test_readers_busy_wait_as_told_then_nap_instead_of_waiting_for_a_notification() -> None:
    napping = type("Napping", (FakeSpinCondition,), {})
    assert patch_spin_condition(napping, 0.0)
    assert not patch_spin_condition(napping, 0.5)  # once only
    reader = napping(True, None, "ipc://x")
    assert reader.busy_loop_s == 0.0
    began = time.monotonic()
    reader.wait()  # past its busy-wait: a nap, not vLLM's wait on the ZMQ notification
    assert reader.waits == [] and time.monotonic() - began < 0.5
    spinning = type("Spinning", (FakeSpinCondition,), {})
    patch_spin_condition(spinning, 60.0)
    reader = spinning(True, None, "ipc://x")
    reader.wait(timeout_ms=7)  # within its busy-wait: vLLM's own (sched_yield)
    assert reader.waits == [7]
    assert FakeSpinCondition(True, None, "ipc://x").busy_loop_s == 1  # the base untouched


def test_the_config_reaches_the_engines_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Set for the engine core vLLM spawns; ``null`` leaves the operator's value."""
    monkeypatch.setenv(SPIN_ENV, "0.5")  # and restored after the test
    apply_env(VllmEngineArgs.model_validate({"model": "m", "engine-core-spin-s": None}))
    assert os.environ[SPIN_ENV] == "0.5"
    apply_env(VllmEngineArgs(model="m"))
    assert os.environ[SPIN_ENV] == "0.0"
    apply_env(VllmEngineArgs.model_validate({"model": "m", "engine-core-spin-s": 1}))
    assert float(os.environ[SPIN_ENV]) == 1.0


def test_vllm_loads_it_as_a_general_plugin() -> None:
    from importlib.metadata import entry_points

    names = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert names.get("dynagraph_engine_spin") == "dynagraph.llm.engines.vllm.engine_spin:register"


@pytest.mark.vllm
def test_vllms_own_spin_condition_is_patched_and_wakes_without_a_writer() -> None:
    """In a fresh process named as vLLM names its engine core: a reader nobody writes to
    returns from an unbounded wait at once (vLLM's own would sleep until notified)."""
    code = (
        "import multiprocessing, os, time, zmq\n"
        f"os.environ[{SPIN_ENV!r}] = '0'\n"
        "multiprocessing.current_process().name = 'EngineCore'\n"
        "from dynagraph.llm.engines.vllm import engine_spin\n"
        "engine_spin.register()\n"
        "from vllm.distributed.device_communicators.shm_broadcast import SpinCondition\n"
        "from vllm.utils.network_utils import get_open_zmq_ipc_path\n"
        "ctx = zmq.Context()\n"
        "r = SpinCondition(True, ctx, get_open_zmq_ipc_path())\n"
        "began = time.monotonic(); r.wait(); waited = time.monotonic() - began\n"
        "print(r.busy_loop_s, waited < 5)\n"
        "r.local_notify_socket.close(0); r.read_cancel_socket.close(0)\n"
        "r.write_cancel_socket.close(0); ctx.term()\n")
    began = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["0.0", "True"], (out.stdout, time.monotonic() - began)
