"""The environment an engine's processes start with: what vLLM, PyTorch and OpenMP read.

:func:`apply_env` sets it in this process before vLLM is imported; the processes vLLM
starts inherit it. It covers the CPU KV cache size, huge pages, OpenMP's spin, the engine
core's busy-wait (``engine_spin``), vLLM's CPU binding and torch.compile.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping

from dynagraph.llm.engines.vllm.args import VllmEngineArgs
from dynagraph.llm.engines.vllm.engine_spin import SPIN_ENV
from dynagraph.llm.kv.transfer.switches import KV_SHM as KV_SHM_ENV

SPREAD = "spread"


def spread_bind(value: str | None, worker_index: int, cpus: int) -> str | None:
    """``cpu-threads-bind`` as vLLM takes it: ``spread`` becomes worker ``worker_index``'s
    own core, so that the engines of a multi-worker component do not share one core (as
    vLLM's automatic binding can place them)."""
    if value != SPREAD:
        return value
    return str(worker_index % max(cpus, 1))


DYNAMO_DISABLE_ENV = "TORCHDYNAMO_DISABLE"
HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"
"""PyTorch's switch: its CPU allocator advises huge pages for allocations of 2 MiB and more
(read once per process, so it takes effect in the engine processes vLLM starts)."""
OMP_SPIN_ENV = "GOMP_SPINCOUNT"
"""libgomp's spin before a waiting thread sleeps (``omp-spin-count``; read at its start)."""


def huge_pages_for(args: VllmEngineArgs, env: Mapping[str, str]) -> bool:
    """``huge-pages`` as the engine gets it: an explicit setting, else on only for an
    engine with a NIXL connector whose KV cache stays in PyTorch's memory (not moved to
    shared memory: ``KV_SHM_ENV``, which ``prepare_nixl`` sets with the connector)."""
    if args.huge_pages is not None:
        return args.huge_pages
    connector = (args.kv_transfer_config or {}).get("kv_connector")
    return connector == "NixlConnector" and env.get(KV_SHM_ENV) != "1"


def apply_env(args: VllmEngineArgs) -> None:
    """Set what vLLM reads from the environment. Must run before vLLM is imported."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_DO_NOT_TRACK", "1")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_space_gib)
    os.environ[HUGE_PAGES_ENV] = "1" if huge_pages_for(args, os.environ) else "0"
    if args.omp_spin_count is not None:
        os.environ[OMP_SPIN_ENV] = str(args.omp_spin_count)
    if args.engine_core_spin_s is not None:
        os.environ[SPIN_ENV] = repr(args.engine_core_spin_s)
    if args.cpu_threads_bind is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.cpu_threads_bind
    if args.cpu_reserved_cores is not None:
        os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(args.cpu_reserved_cores)
    if args.enforce_eager and DYNAMO_DISABLE_ENV not in os.environ:
        # Eager means no torch.compile at all: vLLM still compiles a sampler helper (the
        # rank count of ``logprobs``), which on the CPU makes the first request asking
        # for logprobs wait for inductor to build C++, once per engine and again for new
        # shapes. Spawned engine processes read the variable;
        # this process (and forked ones) already imported torch, so set its flag too.
        os.environ[DYNAMO_DISABLE_ENV] = "1"
        if "torch._dynamo" in sys.modules:
            sys.modules["torch._dynamo"].config.disable = True

