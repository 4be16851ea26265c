"""How long vLLM's engine core busy-waits for its model runner (``VllmWorker.engine-core-spin-s``).

vLLM's engine core hands each step to its model-runner process through a shared-memory
ring (``vllm.distributed.device_communicators.shm_broadcast``) and reads the answer back
from another. A reader that read something in the last ``busy_loop_s`` (1 s in vLLM 0.32)
polls the ring with ``sched_yield``, so under load the engine core spins through every
model step: py-spy of it at 64 streams (2026-12-06, 2-core VM), 70% of its samples waited
on the model runner, 52% in ``sched_yield``; its CPU time was ~7 s of a 10 s run. On 2
cores that spinner competes with the Frontend and VllmWorker, and (our reading, not
measured) keeps a core looking busy, so their wake-ups land on the model runner's core
as often as on the spinner's.

This module is a vLLM general plugin (``pyproject.toml``), run in every process vLLM
starts. In the engine core (``multiprocessing``'s process name ``EngineCore...``), and
only where ``DYNAGRAPH_ENGINE_CORE_SPIN_S`` is set (the VllmWorker sets it from its
config), the readers created there busy-wait that long instead, and then look at the ring
every ``NAP_S`` (0.1 ms) until the answer is there. Not vLLM's own idle path, a sleep on
the writer's ZMQ notification: with the busy-wait at 0 (served, 16 streams) 78-88% of
those sleeps ran to their timeout as if no notification came, and at start-up the engine
core hung on one that never did. Elsewhere, and in vLLM's own server, nothing changes.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import time
from collections.abc import Mapping
from typing import Any

# Under "vllm.": the engine core configures only vLLM's loggers, so its output shows.
log = logging.getLogger("vllm.dynagraph.engine_spin")

SPIN_ENV = "DYNAGRAPH_ENGINE_CORE_SPIN_S"
"""Seconds the engine core's shared-memory readers busy-wait after a read."""

NAP_S = 0.0001
"""A reader's sleep between looks at the ring once its busy-wait is over."""

_PATCHED = "_dynagraph_spin_s"


def engine_core_setting(key: str, env: Mapping[str, str] = os.environ,
                        process_name: str | None = None) -> str | None:
    """``env[key]`` in vLLM's engine-core process (``multiprocessing``'s name
    ``EngineCore...``), where our vLLM plugins act; None elsewhere, or where it is unset
    or empty."""
    raw = env.get(key)
    name = multiprocessing.current_process().name if process_name is None else process_name
    return raw if raw and name.startswith("EngineCore") else None


def engine_core_spin_s(env: Mapping[str, str] = os.environ,
                       process_name: str | None = None) -> float | None:
    """The busy-wait to apply in this process, or ``None`` to leave vLLM's."""
    raw = engine_core_setting(SPIN_ENV, env, process_name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        log.warning("%s=%r is not a number of seconds; left vLLM's", SPIN_ENV, raw)
        return None
    return max(value, 0.0)


def register() -> None:
    """vLLM's plugin hook: patch ``SpinCondition`` in the engine core when asked."""
    spin = engine_core_spin_s()
    if spin is None:
        return
    from vllm.distributed.device_communicators import shm_broadcast

    cls = getattr(shm_broadcast, "SpinCondition", None)
    if cls is not None and patch_spin_condition(cls, spin):
        log.info("engine core: shared-memory readers busy-wait %.3f s", spin)


def patch_spin_condition(cls: Any, spin: float) -> bool:
    """Make ``cls`` (vLLM's ``SpinCondition``) readers busy-wait ``spin`` seconds after a
    read and then look at the ring every ``NAP_S``; whether it was patched (not twice)."""
    if _PATCHED in vars(cls):
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
            # Not vLLM's sleep on the writer's ZMQ notification: served, 78-88% of those
            # sleeps ran to their timeout, the notification lost or late (and at start-up
            # one never came). A short nap and another look at the ring instead.
            time.sleep(NAP_S)

    cls.__init__, cls.wait = spin_init, napping_wait
    setattr(cls, _PATCHED, spin)
    return True
