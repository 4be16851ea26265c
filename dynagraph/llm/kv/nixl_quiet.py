"""vLLM's ``NixlConnector`` with NIXL's progress thread asleep while idle.

vLLM makes its NIXL agents with ``nixl._api``'s hard-coded ``pthrDelay = 0``: the
progress thread busy-spins, a full core per engine while idle. The thread waits on UCX
event file descriptors and uses the delay only as a poll timeout, so a non-zero delay
keeps it event-driven: a 2 MiB READ with notification still completes in ~0.2 ms, at
< 0.01 cores idle (``benchmarks/nixl_progress.py``). The thread must stay on: without it
the first transfer into an idle engine never completes (nobody polls its agent).

vLLM imports this module inside each engine-core process (name it as the connector's
module path; the class keeps the name ``NixlConnector`` so vLLM's own
``has_connector("NixlConnector")`` checks hold)::

    kv_transfer_config = {"kv_connector": "NixlConnector",
                          "kv_connector_module_path": "dynagraph.llm.kv.nixl_quiet", ...}

The delay comes from ``DYNAGRAPH_NIXL_PROGRESS_DELAY_US`` (set by
``nixl_side.prepare_nixl`` from ``nixl-progress-delay-us``; default 10000; 0 keeps
NIXL's busy-spin).

With ``DYNAGRAPH_KV_SHM=1`` (``kv-transport: shm`` or ``auto``) the engine's KV cache is
allocated in shared memory and published, and its READs from same-host peers that did
the same are copies (``dynagraph.llm.kv.shm_direct``).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as _base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlConnector as _VllmNixlConnector,
)

from dynagraph.llm.kv import shm_direct
from dynagraph.llm.kv.nixl_side import delayed_agent_config, progress_delay_from_env

log = logging.getLogger(__name__)

MODULE_PATH = __name__


def install(environ: Any = os.environ) -> int:
    """Give NIXL agents made from now on the configured progress-thread delay (idempotent).

    Returns the delay in microseconds (0: NIXL's busy-spinning default is kept).
    """
    delay = progress_delay_from_env(environ)
    if getattr(_base_worker, "nixl_agent_config", None) is None:  # no NIXL: vLLM fails later
        return delay
    if delay > 0:
        import nixl._api as api  # the module vLLM's agents come from

        bindings = api.nixlBind
        bindings.nixlAgentConfig = delayed_agent_config(bindings.nixlAgentConfig, delay)
        log.info("NIXL progress thread sleeps up to %d us between UCX events", delay)
    return delay


install()


def _shared_kv_allocation() -> None:
    """vLLM's KV cache allocation, its buffer moved to a memfd before anything views it."""
    from vllm.v1.worker import gpu_model_runner as runner

    allocate = getattr(runner, "allocate_kv_cache")  # noqa: B009  (imported there, not exported)
    if getattr(allocate, "__dynagraph_shm__", False):
        return

    def allocate_shared(*args: Any, **kwargs: Any) -> Any:
        kv_caches = allocate(*args, **kwargs)
        region = shm_direct.rehome(kv_caches)
        if region is not None:
            log.info("KV cache in shared memory (%.2f GiB)", region.nbytes / 2**30)
        return kv_caches

    allocate_shared.__dynagraph_shm__ = True  # type: ignore[attr-defined]
    setattr(runner, "allocate_kv_cache", allocate_shared)  # noqa: B010


if shm_direct.enabled():
    _shared_kv_allocation()


LISTENER_JOIN_S = 1.5


class NixlConnector(_VllmNixlConnector):
    """vLLM's NixlConnector; importing this module removed the idle busy-spin.

    ``shutdown`` bounds the join of vLLM's handshake-listener thread (a daemon): vLLM's
    unbounded join outlasted the engine's 5 s shutdown budget, so every NIXL engine was
    force-killed on exit.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._published: str | None = None
        worker = getattr(self, "connector_worker", None)
        if worker is not None and shm_direct.enabled():
            worker.nixl_wrapper = shm_direct.ShmNixl(worker.nixl_wrapper)

    def shutdown(self) -> None:
        sched = getattr(self, "connector_scheduler", None)
        listener = getattr(sched, "_nixl_handshake_listener_t", None)
        if sched is not None and listener is not None:
            sched._stop_event.set()
            listener.join(timeout=LISTENER_JOIN_S)
            sched._nixl_handshake_listener_t = None
        if self._published is not None:
            shm_direct.withdraw(self._published)
            self._published = None
        super().shutdown()  # type: ignore[no-untyped-call]  # vLLM's method is unannotated

    def register_kv_caches(self, kv_caches: Any) -> None:
        super().register_kv_caches(kv_caches)
        worker = getattr(self, "connector_worker", None)
        if worker is None or not shm_direct.enabled():
            return
        regions = shm_direct.regions_of(t.data_ptr() for t in kv_caches.values())
        if regions:
            agent = str(worker.nixl_wrapper.name)
            shm_direct.publish(agent, regions)
            self._published = agent
