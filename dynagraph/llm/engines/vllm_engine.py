"""The vLLM engine: vLLM v1's ``AsyncLLM`` embedded behind the :class:`Engine` protocol.

Importing this module does not import vLLM. :meth:`VllmEngine.start` first sets the
environment vLLM reads (``VLLM_CPU_KVCACHE_SPACE``, ``HF_HUB_OFFLINE``, ...) and only
then imports it. ``AsyncLLM`` always runs its engine core in a child process; with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` the model runs inside that child instead of a
third process, which starts in a few seconds (good for tests).

KV events: ``kv_events_endpoint`` is handed to vLLM's ZMQ publisher as is. Use
``ipc://PATH``: vLLM binds it and subscribers connect (local only). A
``tcp://HOST:PORT`` endpoint makes vLLM *connect* its PUB socket to a SUB you bound;
with vLLM 0.32 here that lost every event in our tests, so it is not recommended.
Wildcard hosts (``tcp://*``) are refused: they listen on every interface. Each batch
is three frames: topic, 8-byte big-endian sequence number, msgpack payload.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from dynagraph.errors import ConfigError, EngineError, InvalidRequest, PromptTooLong
from dynagraph.llm.engines.base import EngineLoad, EngineOutput, FinishReason, SamplingSpec
from dynagraph.llm.engines.engine_spin import SPIN_ENV
from dynagraph.llm.engines.nice import ENGINE_NICE_DIR_ENV, defer_renice, renice
from dynagraph.llm.engines.reaper import Reaper, vllm_descendants
from dynagraph.llm.engines.vllm_stats import (
    LoadTracker,
    make_stat_logger_factory,
    no_prometheus_logger,
)
from dynagraph.llm.kv.shm_direct import ENV as KV_SHM_ENV
from dynagraph.llm.kv.shm_transport import tier_dir
from dynagraph.llm.router.hashing import BlockHasher, seed_from_env
from dynagraph.runtime import progress

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0
"""Upper bound on model load + engine core start (torch.compile can take a minute)."""
SHUTDOWN_TIMEOUT_S = 30.0
ENGINE_EXIT_WAIT_S = 0.2
"""How long vLLM may wait for its engine-core processes to exit on their own before it
kills them. Left alone, their teardown is a garbage collection over the model runner's
heap (1+ s here, py-spy: ``gc_collect_main``) that nothing after a shutdown needs; the
shared-memory queue a killed worker leaves is unlinked by multiprocessing's resource
tracker when this process exits (and by ``dynamo serve``'s sweep)."""

OMP_SPIN_COUNT = 10_000
"""Engines' OpenMP threads spin ~0.2 ms after a parallel region instead of libgomp's
~9 ms. Where the model runs in the engine-core process (the NIXL-connected engines of the
disagg graphs) it has one OpenMP thread per core, and a thread spinning after its work
takes a core from the other engine, the KV hand-off and the graph's own processes; the
regions within a forward pass follow each other far closer than 0.2 ms, so the engine's
own work is as fast. (An agg engine's model runner has one thread: no effect there.)
Measured, 2-core VM, 2026-12-05: prefill engines alone (``benchmarks/disagg_served.py
--requests 40``, four A/B runs, ``disagg_served_omp_spin*.md``), TTFT 65 -> 59 ms at 1k
tokens and 319 -> 306 ms at 4k (medians of 160 requests each way; lower in every run),
1k transfers 0.45 -> 0.36 ms; the decode engines' too, under load
(``benchmarks/disagg_load.py``, ``disagg_load_omp_spin.md``, 2 rounds): TTFT p50
519 / 411 -> 122 / 125 ms, p99 1.7 / 1.8 -> 0.8 / 0.6 s, 2.1 -> 3.1 ms between tokens,
requests completed 312 / 307 -> 268 / 304 (a slower VM that morning: TTFT 771 / 736 ->
116 / 127 ms, completed 131 / 121 -> 170 / 170)."""


def _kebab(name: str) -> str:
    return name.replace("_", "-")


class VllmEngineArgs(BaseModel):
    """Typed vLLM settings; YAML may spell keys in kebab-case (``block-size``)."""

    model_config = ConfigDict(
        extra="forbid", alias_generator=_kebab, validate_by_name=True, validate_by_alias=True
    )

    model: str
    """Path of a Hugging Face style model directory (no hub is reachable)."""
    served_model_name: str | None = None
    block_size: int = Field(default=128, ge=16)
    """KV block size in tokens; a multiple of 32 on the CPU. The router must use the same."""
    max_model_len: int | None = Field(default=None, ge=16)
    max_num_seqs: int | None = Field(default=None, ge=1)
    max_num_batched_tokens: int | None = Field(default=None, ge=16)
    kv_cache_space_gib: int = Field(default=1, ge=1)
    """KV cache size on the CPU (``VLLM_CPU_KVCACHE_SPACE``); ignored on GPUs."""
    num_gpu_blocks_override: int | None = Field(default=None, ge=1)
    """vLLM's engine argument: the engine cache holds exactly this many blocks (a small
    cache, e.g. to study offloading), whatever ``kv-cache-space-gib`` would allow."""
    kv_offload_gib: float = Field(default=0.0, ge=0.0)
    """Host KV pool (``dynagraph.llm.kv.host_pool``): blocks that leave the engine's cache
    are kept in this much host memory and loaded back for a later request with the same
    prefix instead of recomputed. 0: off. Combined with a NIXL connector if one is set."""
    kv_offload_dir: str | None = None
    """A tier under the host KV pool (``dynagraph.llm.kv.host_tiers``): every block the
    pool stores is also written here, one file per block named by its hash, and a block
    found here is loaded back through the pool. Every worker of the model that names the
    same directory shares it: on a tmpfs (``/dev/shm/...``) a host-shared RAM tier, on a
    disk a disk tier. Needs ``kv-offload-gib``. ``None``: off."""
    kv_offload_dir_gib: float = Field(default=0.0, ge=0.0)
    """Size limit of ``kv-offload-dir`` (``dynagraph.llm.kv.tier_trim``): every few
    seconds, while its block files add up to more, the oldest written are deleted, down
    to 90% of the limit (the engine computes a deleted block it looked for). Every worker
    naming the directory should name the same limit; they take turns. 0: no limit (vLLM's
    tier never deletes a file)."""
    kv_compression: str = "none"
    """How the host KV pool stores blocks (``dynagraph.llm.kv.codec``): ``none``, ``int8``
    or ``fp8`` (groupwise scaled, ~1.94x more blocks in the same memory), or
    ``module:Class``. A lossy codec must pass the quality guard at start-up
    (``dynagraph.llm.kv.quality_guard``) or the worker refuses to start."""
    kv_transfer_compression: str = "none"
    """How a remote prefill's KV crosses the NIXL wire (``dynagraph.llm.kv.wire_codec``):
    ``none`` (raw), ``int8`` or ``fp8`` (the pool's codecs: ~1.94x fewer bytes), or
    ``module:Class``. Set it alike on the decode and prefill workers (a peer with another
    value is read raw); a same-host peer read by ``kv-transport: shm | auto`` is copied
    raw. Costs an encode on the prefill engine and a decode on the decode engine, and
    0.52x the KV cache in host memory on each, for half the bytes on a slow link. A lossy
    codec must pass the quality guard at start-up (the engine's cached calibration
    blocks round-tripped through it) or the worker refuses to start."""
    kv_compression_max_divergence: float = Field(default=0.05, gt=0.0)
    """Quality guard: the largest mean |logprob difference| (nats) per generated token
    allowed between calibration prompts served from compressed KV and computed."""
    kv_compression_min_agreement: float = Field(default=0.75, ge=0.0, le=1.0)
    """Quality guard: the smallest share of calibration prompts whose greedy tokens from
    compressed KV must equal the computed ones."""
    enforce_eager: bool = True
    """Skip torch.compile / graph capture (saves 30-70 s of start-up on the CPU); also
    turns off torch.compile for vLLM's helpers (``TORCHDYNAMO_DISABLE=1`` unless set)."""
    enable_prefix_caching: bool = True
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    """``priority``: requests carry their SLO class's priority (lower is served first)."""
    seed: int = 0
    dtype: str = "auto"
    kv_events_endpoint: str | None = None
    """ZMQ endpoint for vLLM's KV cache events; ``None`` disables them."""
    kv_events_topic: str = "kv-events"
    kv_events_replay_endpoint: str | None = None
    kv_transfer_config: dict[str, Any] | None = None
    """Passed to vLLM's ``KVTransferConfig`` (e.g. the NixlConnector settings)."""
    cpu_threads_bind: str | None = None
    """``VLLM_CPU_OMP_THREADS_BIND`` (e.g. ``"0"``, ``"0-1"``); ``None`` keeps vLLM's;
    ``spread``: worker ``i`` of the component on core ``i mod cpus`` (``spread_bind``).
    vLLM applies it only where it starts a model-runner process: an engine whose model runs
    in its engine-core process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the NIXL workers)
    runs OpenMP's default, a thread per core. Binding those too (``OMP_NUM_THREADS`` and
    ``GOMP_CPU_AFFINITY`` for the engine-core process, tried 2026-12-05) made the disagg
    graph's prefills ~1.9x slower one request at a time (4k: 548 against ~290 ms), so it
    is not done. vLLM's NIXL worker does bind such an engine's main thread, to the last
    core (``dynagraph.llm.kv.nixl_quiet`` says why that is kept)."""
    cpu_reserved_cores: int | None = Field(default=None, ge=0)
    """``VLLM_CPU_NUM_OF_RESERVED_CPU``; set 0 on 2-core machines with a KV connector."""
    engine_nice: int = Field(default=19, ge=0, le=19)
    """Niceness added to the engine's own processes (engine core, model runner) once it
    is up, so the graph's light processes and etcd run first where they share cores with
    it (``dynagraph.llm.engines.nice``). 0: unchanged. No effect on an in-process engine.
    19 by default: at 0, a 2-core box serving 1000-token completions starved etcd past
    the graph's 3 s leases and broke a stream on its 4 s idle timeout; at 19 neither,
    at about the same speed (``benchmarks/engine_nice_probe.py``). Measured again
    2026-12-06 with the engine sharing the graph's cores (``engine_nice_probe_share.md``):
    no lease lost at 0 or 19, but each request took 3.1-4.5 s at 0 against 2.0-2.8 s at
    19. Under ``dynamo serve`` (``--engine-cores keep-off``) the worker leaves it to the
    core keeper (``dynagraph.cli.core_keeper``): the engine stays at 0 while the graph
    keeps off its model runner's cores, and gets this value where it cannot."""
    huge_pages: bool | None = None
    """The engine's large CPU tensors (its KV cache, the weights) in transparent huge pages
    (PyTorch's ``THP_MEM_ALLOC_ENABLE``; a no-op where the kernel's THP is ``never``).
    Unset: on only where the KV cache stays in PyTorch's memory and peers read it over
    NIXL (``kv-transport: nixl``); off elsewhere (``huge_pages_for``).

    A KV read between engines (``process_vm_readv`` under NIXL's UCX) copies from 2 MiB
    pages at about twice the speed it copies from 4 KiB ones: measured on this machine,
    2 MiB in 0.18-0.20 ms against 0.35-0.38 ms, the page walks of the 4 KiB source being
    the difference (``perf``: 29% of the copying engine's samples in ``get_user_pages``);
    numpy's large arrays, which the raw NIXL benchmark reads, get huge pages by default.
    Served (``benchmarks/disagg_served.py``, two A/B runs, 2026-12-05): 4k-token transfers
    1.50 -> 0.97 and 1.39 -> 1.06 ms median.

    They cost start-up time here, most likely because this KVM guest reports free memory
    to its host (virtio-balloon free page reporting, from 2 MiB blocks up): a huge page
    comes from memory the host took back and faults in again on first touch. vLLM's
    "engine initialised" step took 9.0-12.5 s with the 1 GiB cache in huge pages against
    0.4-2.6 s in 4 KiB ones; the agg graph was ready in 31.0 s against 22.8 s
    (``benchmarks/engine_startup.py``, 2026-12-06). With ``kv-transport`` ``shm`` or
    ``auto`` the cache is moved to a memfd (4 KiB pages, ``shm_direct``), and the agg
    graph's throughput did not move with huge pages, so elsewhere they buy nothing."""
    omp_spin_count: int | None = Field(default=OMP_SPIN_COUNT, ge=0)
    """How long the engine's OpenMP threads spin after a parallel region before they sleep
    (``GOMP_SPINCOUNT``, in spins of libgomp's wait loop, the OpenMP vLLM preloads on the
    CPU); ``None`` keeps OpenMP's own (~9 ms of a core after every region here) or the
    operator's ``GOMP_SPINCOUNT``. Short by default: see ``OMP_SPIN_COUNT``."""
    engine_core_spin_s: float | None = Field(default=0.0, ge=0)
    """How long vLLM's engine core busy-waits (``sched_yield``) for its model runner's
    answer after the last one; past it, it looks every 0.1 ms
    (``dynagraph.llm.engines.engine_spin``). ``None`` keeps vLLM's 1 s (or the operator's
    ``DYNAGRAPH_ENGINE_CORE_SPIN_S``), under which the engine core spins through every
    model step. 0 by default: under ``vllm bench serve`` on 2 cores the agg graph made
    more output tokens per second at 0 than at 1 in all 6 rounds at 16 and 64 streams
    (``benchmarks/results/vllm_bench_serve_nap_clean.md``, 2026-12-06; 5 of 6 in
    ``_nap.md``), the engine's CPU per output token 421 / 209 us against 713 / 298. No
    effect on an engine whose model runs in its engine-core process."""
    warmup: bool = True
    """Serve one short request before the worker registers (``VllmEngine._warm_up``)."""
    log_stats: bool = False
    """Also run vLLM's periodic stats log lines."""
    vllm_metrics: bool = True
    """vLLM's own ``vllm:*`` Prometheus metrics (prompt tokens by source, NIXL transfer
    bytes, ...) in the worker's registry; false skips their recording on every engine step
    (~2% of a busy worker's CPU at 64 streams, py-spy)."""
    structured_outputs_backend: Literal[
        "auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer", "none"] = "auto"
    """vLLM's structured-output backend; ``none`` refuses constrained requests."""
    structured_outputs_disable_any_whitespace: bool = False
    """Constrained JSON without optional whitespace (vLLM's server-wide option)."""
    structured_outputs_disable_additional_properties: bool = False
    """JSON schemas without ``additionalProperties`` forbid extra keys (guidance only)."""
    max_logprobs: int = Field(default=20, ge=-1)
    """Most logprobs a request may ask for per position (-1: the whole vocabulary)."""
    extra_engine_args: dict[str, Any] = Field(default_factory=dict)
    """Any other ``vllm.AsyncEngineArgs`` field, passed through unchecked."""

    @field_validator("kv_compression", "kv_transfer_compression")
    @classmethod
    def _known_codec(cls, value: str, info: ValidationInfo) -> str:
        if value not in ("none", "int8", "fp8") and ":" not in value:
            key = str(info.field_name).replace("_", "-")
            raise ValueError(f"unknown {key} {value!r}: use none, int8, fp8 or "
                             "module:Class")
        return value

    @model_validator(mode="after")
    def _tier_needs_pool(self) -> VllmEngineArgs:
        if self.kv_offload_dir and self.kv_offload_gib <= 0:
            raise ValueError("kv-offload-dir is a tier under the host KV pool: set "
                             "kv-offload-gib too")
        if self.kv_offload_dir_gib > 0 and not self.kv_offload_dir:
            raise ValueError("kv-offload-dir-gib limits the tier kv-offload-dir names: set "
                             "kv-offload-dir too")
        return self

    @field_validator("kv_events_endpoint", "kv_events_replay_endpoint")
    @classmethod
    def _local_only(cls, value: str | None) -> str | None:
        if value is not None and ("*" in value or "0.0.0.0" in value or "::" in value):
            raise ValueError(
                f"{value!r} would listen on every interface; use ipc://PATH "
                "(vLLM binds it) or tcp://127.0.0.1:PORT"
            )
        return value


SPREAD = "spread"

TIER_IO_THREADS = 2
"""Read and write threads of the ``kv-offload-dir`` tier (vLLM's default is 16 each)."""


RECOMPUTE = "recompute"


def kv_transfer_config(args: VllmEngineArgs) -> dict[str, Any] | None:
    """vLLM's ``KVTransferConfig`` fields: ``kv-transfer-config`` as given, the host KV
    pool's offloading connector, or both under vLLM's ``MultiConnector`` (the pool
    second: a remote prefill's KV arrives over NIXL, the pool serves what was evicted)."""
    if args.kv_offload_gib <= 0:
        return args.kv_transfer_config
    # dynagraph.llm.kv.host_pool / host_tiers (import vLLM: named here, loaded by vLLM)
    extra: dict[str, Any] = {
        "spec_name": "HostPoolSpec", "spec_module_path": "dynagraph.llm.kv.host_pool",
        "cpu_bytes_to_use": int(args.kv_offload_gib * 2**30), "codec": args.kv_compression}
    if args.kv_offload_dir:  # vLLM's file-system tier, one directory per codec
        extra.update(spec_name="TieredHostPoolSpec",
                     spec_module_path="dynagraph.llm.kv.host_tiers",
                     secondary_tiers=[{
                         "type": "fs",
                         "root_dir": tier_dir(args.kv_offload_dir, args.kv_compression),
                         "n_read_threads": TIER_IO_THREADS,
                         "n_write_threads": TIER_IO_THREADS,
                         # the blocks it writes, as KV events (medium STORAGE) for the Router
                         "enable_kv_events": True}])
    # vLLM's scheduler reads the failure policy of the top connector only (its default:
    # fail the request). A block a connector could not load is computed instead: a NIXL
    # read from a prefill worker that died after its hand-off (nixl_side asks the same
    # of its own connector, which under the MultiConnector counted for nothing) or a
    # failed pool copy. A tier file gone or cut short never gets that far: the tier's
    # promotion into the pool fails and the lookup becomes a miss.
    pool = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_load_failure_policy": RECOMPUTE, "kv_connector_extra_config": extra}
    if not args.kv_transfer_config:
        return pool
    given = dict(args.kv_transfer_config)
    # vLLM 0.32's MultiConnector passes engine_id to each child besides the child's own
    # keys (TypeError when a child has one): it goes on the parent, children inherit it.
    engine_id = given.pop("engine_id", None)
    multi = {"kv_connector": "MultiConnector", "kv_role": given.get("kv_role", "kv_both"),
             "kv_load_failure_policy": given.get("kv_load_failure_policy", RECOMPUTE),
             "kv_connector_extra_config": {"connectors": [given, pool]}}
    if engine_id is not None:
        multi["engine_id"] = engine_id
    return multi


def block_hasher(args: VllmEngineArgs) -> BlockHasher:
    """Hashes blocks as this engine does: its block size, prefix-caching hash algorithm
    and seed (``PYTHONHASHSEED`` of the environment it inherits)."""
    return BlockHasher(args.block_size,
                       args.extra_engine_args.get("prefix_caching_hash_algo", "sha256"),
                       seed_from_env(os.environ))


def spread_bind(value: str | None, worker_index: int, cpus: int) -> str | None:
    """``cpu-threads-bind`` as vLLM takes it: ``spread`` becomes worker ``worker_index``'s
    own core. vLLM's automatic binding put both engines of a two-worker graph on core 0
    here, and their OpenMP threads then starved one of them: in round robin every request
    to it took 2-5 s, every one to the other 0.3-0.5 s (``benchmarks/results/
    routing_probe.md``)."""
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


def _apply_env(args: VllmEngineArgs) -> None:
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
        # rank count of ``logprobs``), and on the CPU that made the first request asking
        # for logprobs take 18.5 s instead of 0.1 s (inductor building C++), once per
        # engine and again for new shapes. Spawned engine processes read the variable;
        # this process (and forked ones) already imported torch, so set its flag too.
        os.environ[DYNAMO_DISABLE_ENV] = "1"
        if "torch._dynamo" in sys.modules:
            sys.modules["torch._dynamo"].config.disable = True


def _to_sampling_params(spec: SamplingSpec, kv_transfer_params: dict[str, Any] | None) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

    structured = None
    if spec.structured_outputs is not None:
        structured = StructuredOutputsParams(**spec.structured_outputs)
    return SamplingParams(
        n=spec.n,
        max_tokens=spec.max_tokens,
        min_tokens=spec.min_tokens,
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k or 0,
        min_p=spec.min_p,
        seed=spec.seed,
        ignore_eos=spec.ignore_eos,
        stop_token_ids=list(spec.stop_token_ids),
        presence_penalty=spec.presence_penalty,
        frequency_penalty=spec.frequency_penalty,
        repetition_penalty=spec.repetition_penalty,
        logit_bias=spec.logit_bias,
        bad_words=list(spec.bad_words) or None,
        allowed_token_ids=spec.allowed_token_ids,
        logprobs=spec.logprobs,
        prompt_logprobs=spec.prompt_logprobs,
        flat_logprobs=spec.logprobs is not None or spec.prompt_logprobs is not None,
        structured_outputs=structured,
        detokenize=False,  # the processor detokenizes; the engine only moves ids
        output_kind=RequestOutputKind.DELTA,
        extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None,
    )


class VllmEngine:
    """One vLLM ``AsyncLLM`` serving token-id requests. See :class:`Engine`."""

    def __init__(self, args: VllmEngineArgs) -> None:
        self.args = args
        self._llm: Any = None
        self._tracker = LoadTracker()
        self._num_blocks = [0]
        self._max_model_len = 0
        self._start_seconds = 0.0
        self._in_flight: set[str] = set()
        self._reaper: Reaper | None = None
        self.guard_report: Any = None
        """The host pool codec's quality guard report (``kv-compression``), once passed."""
        self.wire_guard_report: Any = None
        """The wire codec's (``kv-transfer-compression``), once passed."""

    @property
    def started(self) -> bool:
        return self._llm is not None

    @property
    def engine_pids(self) -> list[int]:
        """The processes vLLM started for this engine (engine core, model runner), once up."""
        return list(self._reaper.pids) if self._reaper is not None else []

    @property
    def max_model_len(self) -> int:
        """The context length in tokens (known after :meth:`start`)."""
        return self._max_model_len

    @property
    def start_seconds(self) -> float:
        """How long :meth:`start` took."""
        return self._start_seconds

    def engine_args(self) -> dict[str, Any]:
        """The keyword arguments for ``vllm.AsyncEngineArgs`` (without config objects)."""
        a = self.args
        kwargs: dict[str, Any] = {
            "model": a.model,
            "served_model_name": a.served_model_name,
            "block_size": a.block_size,
            "max_model_len": a.max_model_len,
            "max_num_seqs": a.max_num_seqs,
            "max_num_batched_tokens": a.max_num_batched_tokens,
            "num_gpu_blocks_override": a.num_gpu_blocks_override,
            "enforce_eager": a.enforce_eager,
            "enable_prefix_caching": a.enable_prefix_caching,
            "scheduling_policy": a.scheduling_policy,
            "seed": a.seed,
            "dtype": a.dtype,
            "disable_log_stats": not a.log_stats,
            "enable_log_requests": False,
            "max_logprobs": a.max_logprobs,
        }
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        overlap = set(kwargs) & set(a.extra_engine_args)
        if overlap:
            raise ConfigError(
                f"extra-engine-args repeats typed settings {sorted(overlap)}; "
                "set them as top-level keys instead",
                key="extra-engine-args",
            )
        return {**kwargs, **a.extra_engine_args}

    def _build(self) -> Any:
        """Create the AsyncLLM (blocking: loads the model, starts the engine core)."""
        _apply_env(self.args)
        with warnings.catch_warnings():  # vLLM's import trips torch FutureWarnings
            warnings.simplefilter("ignore", FutureWarning)
            from vllm import AsyncEngineArgs
            from vllm.config import KVEventsConfig, KVTransferConfig, StructuredOutputsConfig
            from vllm.platforms import current_platform
            from vllm.v1.engine.async_llm import AsyncLLM

        if current_platform.is_cpu() and self.args.block_size % 32:
            raise ConfigError(
                f"block-size {self.args.block_size} must be a multiple of 32 on the CPU",
                key="block-size",
            )
        kwargs = self.engine_args()
        if self.args.kv_events_endpoint:
            kwargs["kv_events_config"] = KVEventsConfig(
                enable_kv_cache_events=True,
                publisher="zmq",
                endpoint=self.args.kv_events_endpoint,
                replay_endpoint=self.args.kv_events_replay_endpoint,
                topic=self.args.kv_events_topic,
            )
        transfer = kv_transfer_config(self.args)
        if transfer:
            kwargs["kv_transfer_config"] = KVTransferConfig(**transfer)
        if "enable_logging_iteration_details" in getattr(AsyncEngineArgs, "__dataclass_fields__",
                                                         {}):
            # What each step computed, for the step timings in ``load()`` (vLLM logs them
            # only with its own stat loggers on, at INFO).
            kwargs.setdefault("enable_logging_iteration_details", True)
        if self.args.structured_outputs_backend != "none":
            kwargs["structured_outputs_config"] = StructuredOutputsConfig(
                backend=self.args.structured_outputs_backend,
                disable_any_whitespace=self.args.structured_outputs_disable_any_whitespace,
                disable_additional_properties=(
                    self.args.structured_outputs_disable_additional_properties))
        try:
            engine_args = AsyncEngineArgs(**kwargs)
        except TypeError as exc:
            raise ConfigError(f"bad vLLM engine argument: {exc}") from exc
        loggers = [make_stat_logger_factory(self._tracker, self._num_blocks)]
        if not self.args.vllm_metrics:  # else vLLM adds its Prometheus logger
            loggers.append(no_prometheus_logger())
        return AsyncLLM.from_engine_args(engine_args, stat_loggers=loggers)

    async def start(self) -> None:
        """Load the model and start vLLM's engine core, off the event loop."""
        if self._llm is not None:
            return
        began = time.monotonic()
        progress.report("loading", f"vLLM engine for {self.args.model}: importing vLLM")
        helpers_before = set(vllm_descendants())
        built: list[Any] = []  # not a return value: a thread pool future would keep it alive
        building = asyncio.get_running_loop().run_in_executor(
            None, lambda: built.append(self._build())
        )
        try:
            await asyncio.wait_for(asyncio.shield(building), START_TIMEOUT_S)
        except (TimeoutError, asyncio.CancelledError) as exc:
            # The build thread cannot be stopped; shut its engine down when it finishes.
            building.add_done_callback(lambda _: [llm.shutdown() for llm in built])
            if isinstance(exc, TimeoutError):
                raise EngineError(
                    f"vLLM did not start within {START_TIMEOUT_S:.0f}s for {self.args.model}"
                ) from exc
            raise
        except ConfigError:
            raise
        except Exception as exc:
            raise EngineError(f"vLLM failed to start for {self.args.model}: {exc}") from exc
        llm = self._llm = built.pop()
        # vLLM's helper processes outlive a SIGKILLed owner; a watchdog ends them.
        self._reaper = Reaper(sorted(set(vllm_descendants()) - helpers_before))
        if (nice_dir := os.environ.get(ENGINE_NICE_DIR_ENV)) and self.engine_pids:
            defer_renice(self.engine_pids, self.args.engine_nice, nice_dir)
            log.info("engine processes %s: niceness left to dynamo serve's core keeper "
                     "(+%d where they share cores with the graph)", self.engine_pids,
                     self.args.engine_nice)
        elif self.args.engine_nice:
            threads = renice(self.engine_pids, self.args.engine_nice)
            log.info("engine processes %s: niceness +%d on %d threads", self.engine_pids,
                     self.args.engine_nice, threads)
        self._max_model_len = int(llm.model_config.max_model_len)
        self._num_blocks[0] = int(llm.vllm_config.cache_config.num_gpu_blocks or 0)
        self._tracker.set_total(self._num_blocks[0])
        scheduler = llm.vllm_config.scheduler_config
        self._tracker.set_limits(batched_tokens=int(scheduler.max_num_batched_tokens or 0),
                                 seqs=int(scheduler.max_num_seqs or 0))
        if self.args.kv_offload_gib > 0 and self.args.kv_compression != "none":
            await self._guard_compression()
        if self.args.kv_transfer_compression != "none":
            await self._guard_wire_compression()
        if self.args.warmup:
            await self._warm_up()
        self._start_seconds = time.monotonic() - began
        log.info(
            "vLLM engine ready in %.1fs: model %s, %d KV blocks of %d tokens, context %d",
            self._start_seconds,
            self.args.model,
            self._num_blocks[0],
            self.args.block_size,
            self._max_model_len,
        )

    async def _warm_up(self) -> None:
        """Run one short request through the engine before anyone can send one: the
        first request an engine serves pays for lazy set-up on the request path, and
        on a loaded box that showed as a burst of late first tokens when load began.
        Prompt and output together stay shorter than one block, so no block is ever
        full: nothing enters the prefix cache or a KV pool, and no KV event goes out."""
        progress.report("loading", f"vLLM engine for {self.args.model}: warm-up request")
        began = time.monotonic()
        half = max(self.args.block_size // 2, 1)
        prompt = [1 + i for i in range(half)]
        out_tokens = max(self.args.block_size - half - 1, 1)
        async for _ in self.generate(f"warmup-{os.getpid()}", prompt,
                                     SamplingSpec(max_tokens=out_tokens, temperature=0.0,
                                                  ignore_eos=True)):
            pass
        log.info("warm-up request: %.0f ms", (time.monotonic() - began) * 1000)

    async def _judged(self, calibrated: Callable[[], Awaitable[Any]]) -> Any:
        """``calibrated()``'s quality guard report, checked against this worker's limits;
        the engine is shut down if it or the check raises (the worker refuses to start)."""
        from dynagraph.llm.kv.quality_guard import check

        try:
            report = await calibrated()
            check(report, max_divergence=self.args.kv_compression_max_divergence,
                  min_agreement=self.args.kv_compression_min_agreement)
        except BaseException:
            await self.shutdown()
            raise
        return report

    async def _guard_compression(self) -> None:
        """Run the lossy pool codec's quality guard; refuse to start if it fails."""
        from dynagraph.llm.kv.quality_guard import GuardReport, calibrate

        progress.report("loading", f"kv-compression {self.args.kv_compression}: quality guard")

        async def calibrated() -> GuardReport:
            report = await calibrate(self, self.args.kv_compression, self.args.block_size,
                                     self._llm.reset_prefix_cache)
            log.info("quality guard: %s", report.summary())
            return report

        self.guard_report = await self._judged(calibrated)

    async def _guard_wire_compression(self) -> None:
        """Run the NIXL wire codec's quality guard; refuse to start if it fails."""
        from dynagraph.llm.kv.quality_guard import WIRE_KEY, GuardReport, calibrate_wire
        from dynagraph.llm.kv.wire_codec import ROUNDTRIP_RPC

        codec = self.args.kv_transfer_compression
        progress.report("loading", f"{WIRE_KEY} {codec}: quality guard")

        async def calibrated() -> GuardReport:
            if not (self.args.kv_transfer_config or {}).get("kv_connector_module_path"):
                raise ConfigError(f"{WIRE_KEY} {codec} compresses a remote prefill's KV on "
                                  "the NIXL wire: this engine has no NIXL connector (set it "
                                  "on the disaggregated graphs' VllmWorker and PrefillWorker)",
                                  key=WIRE_KEY)
            if not self.args.enable_prefix_caching:
                raise ConfigError(f"{WIRE_KEY}'s quality guard serves its calibration "
                                  "prompts from the prefix cache: set enable-prefix-caching",
                                  key=WIRE_KEY)
            moved: list[int] = []
            took: list[float] = []

            async def roundtrip() -> None:
                began = time.monotonic()
                moved.extend(await self._llm.collective_rpc(ROUNDTRIP_RPC))
                took.append(time.monotonic() - began)

            report = await calibrate_wire(self, codec, self.args.block_size, roundtrip)
            log.info("quality guard: %s (%.2f GiB of KV round-tripped in %.1f s)",
                     report.summary(), sum(moved) / 2**30, sum(took))
            if sum(moved) <= 0:
                raise ConfigError(f"{WIRE_KEY} {codec}: the engine's KV is not in a wire "
                                  "shadow (it needs a 16-bit KV cache)", key=WIRE_KEY)
            return report

        self.wire_guard_report = await self._judged(calibrated)

    async def shutdown(self) -> None:
        llm, self._llm = self._llm, None
        if llm is None:
            return
        if self._in_flight:  # their streams end with finish_reason "abort"
            await llm.abort(list(self._in_flight))
        # Stop vLLM's output handler before its engine core goes away; otherwise it
        # logs the core's exit as an EngineDeadError.
        handler = getattr(llm, "output_handler", None)
        if isinstance(handler, asyncio.Task):
            handler.cancel()
            await asyncio.wait([handler], timeout=SHUTDOWN_TIMEOUT_S)
        try:
            await asyncio.wait_for(asyncio.to_thread(llm.shutdown, ENGINE_EXIT_WAIT_S),
                                   SHUTDOWN_TIMEOUT_S)
        finally:
            reaper, self._reaper = self._reaper, None
            if reaper is not None:
                await asyncio.to_thread(reaper.close)
        log.info("vLLM engine for %s shut down", self.args.model)

    def load(self) -> EngineLoad:
        return self._tracker.get()

    def observe_kv_transfers(self, listener: Callable[[int, float], None] | None) -> None:
        """Call ``listener(bytes, seconds)`` for each KV transfer this engine receives
        (vLLM's KV connector stats; NixlConnector only)."""
        self._tracker.on_kv_transfer = listener

    async def abort(self, request_id: str) -> None:
        if self._llm is not None:
            await self._llm.abort(request_id)

    def _check(self, prompt_token_ids: list[int]) -> None:
        if self._llm is None:
            raise EngineError("the vLLM engine is not started (call start() first)")
        if not prompt_token_ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if len(prompt_token_ids) >= self._max_model_len:
            raise PromptTooLong(
                f"the prompt has {len(prompt_token_ids)} tokens; the model's context is "
                f"{self._max_model_len} tokens including at least one generated token",
                param="prompt",
                code="context_length_exceeded",
            )

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec,
        *,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> AsyncIterator[EngineOutput]:
        self._check(prompt_token_ids)
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt

        if request_id in self._in_flight:
            raise InvalidRequest(f"request id {request_id!r} is already in flight")
        if sampling.structured_outputs is not None and (
                self.args.structured_outputs_backend == "none"):
            raise InvalidRequest("this worker has structured outputs turned off "
                                 "(structured-outputs-backend: none)", param="response_format")
        try:
            params = _to_sampling_params(sampling, kv_transfer_params)
        except VLLMClientError as exc:
            raise _invalid(exc) from exc
        try:
            prompt = TokensPrompt(prompt_token_ids=list(prompt_token_ids))
            if sampling.cache_salt:
                prompt["cache_salt"] = sampling.cache_salt
            (engine_input,) = self._llm.renderer.render_cmpl([prompt])
        except VLLMClientError as exc:
            raise _invalid(exc) from exc
        priority = sampling.priority if self.args.scheduling_policy == "priority" else 0
        self._tracker.request_arrived()
        started = False
        stream = self._llm.generate(engine_input, params, request_id, priority=priority)
        self._in_flight.add(request_id)
        try:
            async for out in stream:
                if not started:
                    started = True
                    self._tracker.request_started()
                for output in _to_engine_outputs(out, len(prompt_token_ids)):
                    yield output
        except VLLMClientError as exc:
            raise _invalid(exc) from exc
        except (InvalidRequest, EngineError, asyncio.CancelledError, GeneratorExit):
            raise
        except ValueError as exc:  # vLLM's request validation (e.g. a bad JSON schema)
            raise InvalidRequest(f"vLLM refused request {request_id}: {exc}") from exc
        except Exception as exc:
            raise EngineError(f"vLLM failed request {request_id}: {exc}") from exc
        finally:
            # Closing vLLM's generator aborts the request in the engine core if it
            # has not finished (consumer cancelled us or stopped iterating).
            self._in_flight.discard(request_id)
            if not started:
                self._tracker.request_started()
            await stream.aclose()


def _invalid(exc: Exception) -> InvalidRequest:
    """vLLM's client errors as ours, keeping the parameter vLLM names."""
    param = getattr(exc, "parameter", None)
    return InvalidRequest(str(exc), param=param if isinstance(param, str) else None)


def _to_engine_outputs(out: Any, num_prompt_tokens: int) -> list[EngineOutput]:
    """One ``EngineOutput`` per choice in a vLLM ``RequestOutput`` (DELTA mode).

    Runs per token: the plain case (one choice, no logprobs) passes no optional field.
    """
    prompt_logprobs = out.prompt_logprobs
    cached = out.num_cached_tokens or 0
    results = []
    for completion in out.outputs:
        reason = completion.finish_reason
        if reason == "error":
            raise EngineError(f"vLLM reported an error for request {out.request_id}")
        kv = out.kv_transfer_params if reason is not None and out.finished else None
        if not completion.index and completion.logprobs is None and not prompt_logprobs:
            results.append(EngineOutput(
                token_ids=list(completion.token_ids), finish_reason=_finish_reason(reason),
                num_prompt_tokens=num_prompt_tokens, num_cached_tokens=cached,
                kv_transfer_params=kv))
            continue
        results.append(EngineOutput(
            token_ids=list(completion.token_ids), finish_reason=_finish_reason(reason),
            num_prompt_tokens=num_prompt_tokens, num_cached_tokens=cached,
            kv_transfer_params=kv, index=completion.index,
            logprobs=None if completion.logprobs is None else _positions(completion.logprobs),
            prompt_logprobs=_prompt_positions(prompt_logprobs) if prompt_logprobs else None))
        prompt_logprobs = None  # once per request output
    return results


def _positions(flat: Any) -> list[tuple[list[int], list[float]]]:
    """vLLM's ``FlatLogprobs`` -> (ids, logprobs) per position."""
    ids, lps = flat.token_ids, flat.logprobs
    return [(ids[a:b], lps[a:b])
            for a, b in zip(flat.start_indices, flat.end_indices, strict=True)]


def _prompt_positions(flat: Any) -> list[tuple[list[int], list[float], list[int]] | None]:
    ids, lps, ranks = flat.token_ids, flat.logprobs, flat.ranks
    return [(ids[a:b], lps[a:b], [r or 0 for r in ranks[a:b]]) if b > a else None
            for a, b in zip(flat.start_indices, flat.end_indices, strict=True)]


def _finish_reason(reason: str | None) -> FinishReason | None:
    if reason is None:
        return None
    if reason in ("length", "abort"):
        return reason  # type: ignore[return-value]
    return "stop"  # "stop" and vLLM's "repetition" both end the text normally
