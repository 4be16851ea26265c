"""Settle a step's freshly posted KV reads before the engine looks for finished ones.

A same-host READ's bytes are copied while it is posted, but the post may return "in
progress" with only the completion left. vLLM's engine looks again one step later, and a
step with nothing to run sleeps 1 ms first (``EngineCore._process_engine_step``), so such
a transfer would be seen done well after its copy.

So the connector polls the reads it has just posted, for at most a short budget, and the
same step's ``get_finished`` reports them done. The poll only touches reads posted this
step, once: a slow transfer (another host, a throttled link) costs one budget, not one
per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

ENV = "DYNAGRAPH_NIXL_SETTLE_US"
"""How long a step may poll the KV reads it posted, in microseconds (0: not at all)."""
DEFAULT_SETTLE_US = 2_000
PAUSE_S = 50e-6
"""The sleep between polling rounds (see :func:`settle`)."""


def settle(check: Callable[[Any], str], handles: Iterable[Any], budget_s: float,
           clock: Callable[[], float] = time.perf_counter,
           pause: Callable[[float], None] = time.sleep) -> int:
    """Poll ``check`` (NIXL's ``check_xfer_state``) on each handle until none is
    ``"PROC"`` or ``budget_s`` is spent; returns how many are still in progress.

    Every handle is checked at least once when the budget is positive (a check is what
    makes UCX progress); finished and failed handles, and any whose check raised, are left
    to the engine's own bookkeeping, which checks them again and handles the failure.
    Between rounds the thread sleeps ``PAUSE_S``: what completes a read that left its post
    in progress runs on this engine's core (its NIXL progress thread), which a busy poll
    would delay.
    """
    pending = list(handles)
    if budget_s <= 0 or not pending:
        return len(pending)
    deadline = clock() + budget_s
    while True:
        pending = [h for h in pending if _state(check, h) == "PROC"]
        if not pending or clock() >= deadline:
            return len(pending)
        pause(PAUSE_S)


def _state(check: Callable[[Any], str], handle: Any) -> str:
    try:
        return check(handle)
    except Exception:  # noqa: BLE001  (vLLM's own poll sees it again and handles it)
        return "ERR"


def in_flight(transfers: dict[str, list[Any]]) -> set[Any]:
    """Every handle of vLLM's ``_recving_transfers`` (request id -> handles)."""
    return set(_handles(transfers))


def posted_since(transfers: dict[str, list[Any]], before: set[Any]) -> list[Any]:
    """The handles of ``transfers`` not in ``before`` (``in_flight`` earlier), in order."""
    return [h for h in _handles(transfers) if h not in before]


def _handles(transfers: dict[str, list[Any]]) -> Iterable[Any]:
    return (h for handles in transfers.values() for h in handles)
