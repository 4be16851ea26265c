"""vLLM's ``NixlConnector`` without NIXL's busy-spinning progress thread.

vLLM creates its NIXL agent with the default ``nixl_agent_config``, whose progress
thread is on and polls with ``pthrDelay = 0`` (hard-coded in ``nixl._api``): each
NIXL-enabled engine then burns ~100% of a core while idle. Transfers do not need
that thread: vLLM's connector polls ``check_xfer_state`` / ``get_new_notifs`` on every
engine step, and those calls drive UCX progress themselves.

Use it by naming this module as the connector's module path; the class keeps the
name ``NixlConnector`` so vLLM's own ``has_connector("NixlConnector")`` checks still
hold::

    kv_transfer_config = {"kv_connector": "NixlConnector",
                          "kv_connector_module_path": "dynagraph.llm.nixl_quiet", ...}

vLLM imports the module inside its engine-core process (where the agent is made),
which is why the patch is applied at import time rather than by the caller.
Set ``DYNAGRAPH_NIXL_PROGRESS_THREAD=1`` to keep the thread (for comparison).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as _base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlConnector as _VllmNixlConnector,
)

log = logging.getLogger(__name__)

MODULE_PATH = __name__
PROGRESS_THREAD_ENV = "DYNAGRAPH_NIXL_PROGRESS_THREAD"


def _quiet(factory: Any) -> Any:
    @functools.wraps(factory)
    def make(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("enable_prog_thread", False)
        return factory(*args, **kwargs)

    make.__dynagraph_quiet__ = True  # type: ignore[attr-defined]
    return make


def install() -> bool:
    """Patch vLLM's NIXL worker to create agents without a progress thread (idempotent).

    Returns True if agents made from now on have no progress thread.
    """
    if os.environ.get(PROGRESS_THREAD_ENV, "0") == "1":
        return False
    factory = _base_worker.nixl_agent_config
    if factory is None:  # NIXL not importable: vLLM fails on its own later
        return False
    if not getattr(factory, "__dynagraph_quiet__", False):
        _base_worker.nixl_agent_config = _quiet(factory)
        log.info("NIXL agents start without a progress thread (no idle busy-spin)")
    return True


install()


LISTENER_JOIN_S = 1.5


class NixlConnector(_VllmNixlConnector):
    """vLLM's NixlConnector; importing this module removed the idle busy-spin.

    ``shutdown`` also bounds the wait for vLLM's handshake-listener thread: vLLM joins
    it without a timeout and, seen here, that join outlasts the engine's 5 s shutdown
    budget, so every NIXL engine was force-killed on exit. The thread is a daemon; after
    ``LISTENER_JOIN_S`` it is left to die with the process.
    """

    def shutdown(self) -> None:  # type: ignore[no-untyped-def]
        sched = getattr(self, "connector_scheduler", None)
        listener = getattr(sched, "_nixl_handshake_listener_t", None)
        if sched is not None and listener is not None:
            sched._stop_event.set()
            listener.join(timeout=LISTENER_JOIN_S)
            sched._nixl_handshake_listener_t = None
        super().shutdown()
