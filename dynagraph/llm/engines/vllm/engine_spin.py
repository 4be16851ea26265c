"""How long vLLM's engine core busy-waits for its model runner (``VllmWorker.engine-core-spin-s``).

vLLM's engine core hands each step to its model-runner process through a shared-memory
ring (``vllm.distributed.device_communicators.shm_broadcast``) and reads the answer back
from another. A reader that read something in the last ``busy_loop_s`` (1 s in vLLM 0.32)
polls the ring with ``sched_yield``, so under load the engine core spins through every
model step, taking a core from the Frontend and VllmWorker where they share a few.

This module is a vLLM general plugin (``pyproject.toml``), run in every process vLLM
starts. In the engine core (``multiprocessing``'s process name ``EngineCore...``), and
only where ``DYNAGRAPH_ENGINE_CORE_SPIN_S`` is set (the VllmWorker sets it from its
config), the readers created there busy-wait that long instead, and then look at the ring
every ``NAP_S`` (0.1 ms) until the answer is there (the patch:
``dynagraph.llm.engines.vllm.adapter.napping_shm_readers``). Not vLLM's own idle path, a
sleep on the writer's ZMQ notification: most of those sleeps ran to their timeout as if
no notification came, and at start-up the engine core could hang on one that never did.
Elsewhere, and in vLLM's own server, nothing changes.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from collections.abc import Mapping

from dynagraph.llm.engines.vllm.adapter import napping_shm_readers

# Under "vllm.": the engine core configures only vLLM's loggers, so its output shows.
log = logging.getLogger("vllm.dynagraph.engine_spin")

SPIN_ENV = "DYNAGRAPH_ENGINE_CORE_SPIN_S"
"""Seconds the engine core's shared-memory readers busy-wait after a read."""


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
    """vLLM's plugin hook: make the engine core's readers nap when asked."""
    spin = engine_core_spin_s()
    if spin is not None and napping_shm_readers(spin):
        log.info("engine core: shared-memory readers busy-wait %.3f s", spin)
