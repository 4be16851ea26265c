"""The mocker: a simulated vLLM engine with measured timing and no model.

``MockerEngine`` implements :class:`dynagraph.llm.engines.base.Engine` like
``VllmEngine``: token ids in, token-id deltas out, ``load()``, ``abort()``,
``kv_transfer_params`` for disaggregated prefill. Instead of a forward pass it waits
the time a timing :class:`Profile` predicts for the step (divided by ``speed``), so
clients see realistic TTFT and ITL; output tokens are deterministic. It is cheap
enough that many engines share one process and one event loop.

Modules: ``profile`` (timing data, step pricing), ``kv`` (block pool, prefix cache,
KV events), ``sequence`` (one request), ``scheduler`` (vLLM v1's step),
``transfer`` (simulated KV hand-off), ``args``, ``core`` (one engine's state, step
pricing and load, with no clock: what ``dynagraph.simulate`` drives on a virtual clock),
``engine`` (the asyncio step task),
``outputs`` (refused sampling options, a request's output queue).
``benchmarks/profiling/profile_vllm_cpu.py`` measures the ``cpu-tiny`` profile.
``tests/vllm/test_mocker_fidelity.py`` runs one workload through vLLM's own scheduler and
this one and requires the same tokens scheduled and the same KV events in every step.

How it maps to vLLM v1 (0.32):

=============================  ===========================================================
vLLM                           mocker
=============================  ===========================================================
``Scheduler.schedule``         ``Scheduler.step``: running first, then waiting (FCFS),
                               token budget ``max_num_batched_tokens``, ``max_num_seqs``,
                               chunked prefill, full-prompt admission check
                               (``scheduler_reserve_full_isl``), watermark, ``priority``
                               policy; no ``long_prefill_token_threshold``, no spec
                               decode, no async scheduling
``allocate_slots`` / preempt   ``KvBlockManager.allocate``; on failure the last running
                               request (``priority``: the lowest-priority one) is
                               preempted (recompute), as vLLM v1
``BlockPool``                  ``KvBlockManager``: null block 0, ref counts, free queue
                               (uncached blocks reused first, cached ones LRU), duplicate
                               hashes allowed, ``BlockStored`` at allocation of the
                               tokens that fill a block, ``BlockRemoved`` on eviction
block hashes                   ``BlockHasher`` (``dynagraph.llm.router.hashing``): the
                               same 64-bit values vLLM publishes
prefix cache stats             ``EngineLoad.prefix_cache_queries/hits``: prompt tokens
                               of first admissions (preempted requests not counted)
model forward + sampling       ``Profile.step_seconds`` of the step's ``StepWork``; a
                               deterministic token per request that reached its end;
                               never an EOS or stop token, so finish reason ``length``
NixlConnector (P side)         ``do_remote_decode``: blocks held after finishing until
                               ``release_transfer`` or ``kv-lease-seconds``; params
                               with engine id, block ids/hashes, ``remote_num_tokens``
NixlConnector (D side)         ``do_remote_prefill``: local prefix lookup, prompt slots
                               allocated, ``WAITING_FOR_REMOTE_KV`` for
                               ``bytes / bandwidth``, then the last prompt token is
                               computed locally (first token), blocks cached
=============================  ===========================================================
"""

from __future__ import annotations

from .args import MockerEngineArgs
from .engine import MockerEngine
from .profile import Profile, StepWork, available_profiles, load_profile
from .transfer import KvTransferRegistry, process_registry

__all__ = [
    "KvTransferRegistry",
    "MockerEngine",
    "MockerEngineArgs",
    "Profile",
    "StepWork",
    "available_profiles",
    "load_profile",
    "process_registry",
]
