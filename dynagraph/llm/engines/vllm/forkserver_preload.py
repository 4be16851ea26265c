"""Imported by the engine fork server (``forkserver.PRELOAD``) before it forks anything:
the vLLM modules the engine core and the model runner run, with their process starts
pointed at the fork server (``adapter.start_processes_from``)."""

from __future__ import annotations

import warnings

with warnings.catch_warnings():  # vLLM's import trips torch FutureWarnings
    warnings.simplefilter("ignore", FutureWarning)
    import vllm.v1.engine.core  # noqa: F401
    import vllm.v1.executor.multiproc_executor  # noqa: F401
    import vllm.v1.worker.cpu_worker  # noqa: F401

from dynagraph.llm.engines.vllm.adapter import start_processes_from  # noqa: E402
from dynagraph.llm.engines.vllm.forkserver import CONTEXT  # noqa: E402

start_processes_from(CONTEXT)
