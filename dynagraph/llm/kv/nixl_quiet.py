"""vLLM's ``NixlConnector`` with NIXL's progress thread asleep when idle.

vLLM creates its NIXL agent with the default ``nixl_agent_config``: progress thread on,
and ``nixl._api`` hard-codes its poll delay ``pthrDelay = 0``, so the thread busy-spins
and each NIXL-enabled engine burns ~100% of a core while idle.

What was measured here (``benchmarks/nixl_progress.py``): the
UCX progress thread waits on the workers' event file descriptors and only uses
``pthrDelay`` as its poll timeout, so a non-zero delay keeps it event-driven: a 2 MiB
READ with a completion notification still finishes in ~0.1 ms while the thread costs
~0.01 cores when idle. Without the thread (what this module did first) a READ with a
notification completes only when *both* agents are polled, i.e. at the pace of the
prefill and decode engines' steps: 2-5 ms per transfer instead of 0.2 ms.

So this module, imported by vLLM inside each engine-core process (name it as the
connector's module path; the class keeps the name ``NixlConnector`` so vLLM's own
``has_connector("NixlConnector")`` checks still hold)::

    kv_transfer_config = {"kv_connector": "NixlConnector",
                          "kv_connector_module_path": "dynagraph.llm.kv.nixl_quiet", ...}

replaces that hard-coded 0 by ``DYNAGRAPH_NIXL_PROGRESS_DELAY_US`` (set by
``nixl_side.prepare_nixl`` from the components' ``nixl-progress-delay-us``; default
10000); ``0`` keeps NIXL's busy-spinning default.

Turning the thread off is not offered: besides slow transfers, an idle prefill engine
(no steps, so no polling) then never answers UCX's connection wire-up, and the first
remote prefill after start-up hung until its KV expired (seen with vLLM's engine core in
its own process, the production set-up).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as _base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
    NixlConnector as _VllmNixlConnector,
)

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


LISTENER_JOIN_S = 1.5


class NixlConnector(_VllmNixlConnector):
    """vLLM's NixlConnector; importing this module removed the idle busy-spin.

    ``shutdown`` also bounds the wait for vLLM's handshake-listener thread: vLLM joins
    it without a timeout and, seen here, that join outlasts the engine's 5 s shutdown
    budget, so every NIXL engine was force-killed on exit. The thread is a daemon; after
    ``LISTENER_JOIN_S`` it is left to die with the process.
    """

    def shutdown(self) -> None:
        sched = getattr(self, "connector_scheduler", None)
        listener = getattr(sched, "_nixl_handshake_listener_t", None)
        if sched is not None and listener is not None:
            sched._stop_event.set()
            listener.join(timeout=LISTENER_JOIN_S)
            sched._nixl_handshake_listener_t = None
        super().shutdown()  # type: ignore[no-untyped-call]  # vLLM's method is unannotated
