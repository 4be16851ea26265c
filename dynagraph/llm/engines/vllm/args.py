"""The vLLM engine's settings (``VllmWorker`` / ``PrefillWorker`` config keys).

:class:`VllmEngineArgs` is the typed, validated schema; YAML may spell its keys in
kebab-case. Importing this module does not import vLLM.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

OMP_SPIN_COUNT = 10_000
"""Engines' OpenMP threads spin ~0.2 ms after a parallel region instead of libgomp's
~9 ms. Where the model runs in the engine-core process (the NIXL-connected engines of the
disagg graphs) it has one OpenMP thread per core, and a thread spinning after its work
takes a core from the other engine, the KV hand-off and the graph's own processes; the
regions within a forward pass follow each other far closer than 0.2 ms, so the engine's
own work is as fast. (An agg engine's model runner has one thread: no effect there.)"""


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
    """Host KV pool (``dynagraph.llm.kv.offload.host_pool``): blocks that leave the engine's cache
    are kept in this much host memory and loaded back for a later request with the same
    prefix instead of recomputed. 0: off. Combined with a NIXL connector if one is set."""
    kv_offload_dir: str | None = None
    """A tier under the host KV pool (``dynagraph.llm.kv.offload.host_tiers``): every block the
    pool stores is also written here, one file per block named by its hash, and a block
    found here is loaded back through the pool. Every worker of the model that names the
    same directory shares it: on a tmpfs (``/dev/shm/...``) a host-shared RAM tier, on a
    disk a disk tier. Needs ``kv-offload-gib``. ``None``: off."""
    kv_offload_dir_gib: float = Field(default=0.0, ge=0.0)
    """Size limit of ``kv-offload-dir`` (``dynagraph.llm.kv.offload.tier_trim``): every few
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
    """How a remote prefill's KV crosses the NIXL wire (``dynagraph.llm.kv.transfer.wire_codec``):
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
    engine_processes: Literal["forkserver", "spawn"] = "forkserver"
    """How the engine's processes (engine core, model runner) start with vLLM's CPU build:
    ``forkserver``, forked from one server that imported vLLM while this process did
    (``dynagraph.llm.engines.vllm.forkserver``); ``spawn``, vLLM's own way, a fresh
    interpreter each that imports vLLM again. The same processes either way; with a GPU
    build vLLM's choice is kept."""
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
    runs OpenMP's default, a thread per core, and is not bound (that made its prefills
    slower). vLLM's NIXL worker does bind such an engine's main thread, to the last
    core (``dynagraph.llm.kv.transfer.nixl_connector`` says why that is kept)."""
    cpu_reserved_cores: int | None = Field(default=None, ge=0)
    """``VLLM_CPU_NUM_OF_RESERVED_CPU``; set 0 on 2-core machines with a KV connector."""
    engine_nice: int = Field(default=19, ge=0, le=19)
    """Niceness added to the engine's own processes (engine core, model runner) once it
    is up, so the graph's light processes and etcd run first where they share cores with
    it (``dynagraph.runtime.nice``). 0: unchanged. No effect on an in-process engine.
    19 by default: a fully loaded engine at 0 can starve etcd past the graph's leases and
    break streams on their idle timeout (``benchmarks/engine_nice_probe.py``). Under ``dynamo serve`` (``--engine-cores keep-off``) the worker leaves it to the
    core keeper (``dynagraph.cli.core_keeper``): the engine stays at 0 while the graph
    keeps off its model runner's cores, and gets this value where it cannot."""
    huge_pages: bool | None = None
    """The engine's large CPU tensors (its KV cache, the weights) in transparent huge pages
    (PyTorch's ``THP_MEM_ALLOC_ENABLE``; a no-op where the kernel's THP is ``never``).
    Unset: on only where the KV cache stays in PyTorch's memory and peers read it over
    NIXL (``kv-transport: nixl``); off elsewhere (``huge_pages_for``).

    A KV read between engines (``process_vm_readv`` under NIXL's UCX) copies from 2 MiB
    pages faster than from 4 KiB ones (fewer page walks of the source), but huge pages
    can cost start-up time (a VM that hands free memory back to its host faults them in
    again). With ``kv-transport`` ``shm`` or ``auto`` the cache is moved to a memfd
    (4 KiB pages, ``shm_direct``), and elsewhere they buy nothing, hence the default."""
    omp_spin_count: int | None = Field(default=OMP_SPIN_COUNT, ge=0)
    """How long the engine's OpenMP threads spin after a parallel region before they sleep
    (``GOMP_SPINCOUNT``, in spins of libgomp's wait loop, the OpenMP vLLM preloads on the
    CPU); ``None`` keeps OpenMP's own (~9 ms of a core after every region) or the
    operator's ``GOMP_SPINCOUNT``. Short by default: see ``OMP_SPIN_COUNT``."""
    engine_core_spin_s: float | None = Field(default=0.0, ge=0)
    """How long vLLM's engine core busy-waits (``sched_yield``) for its model runner's
    answer after the last one; past it, it looks every 0.1 ms
    (``dynagraph.llm.engines.vllm.engine_spin``). ``None`` keeps vLLM's 1 s (or the operator's
    ``DYNAGRAPH_ENGINE_CORE_SPIN_S``), under which the engine core spins through every
    model step. 0 by default: on a few cores the agg graph serves more output tokens per
    second at 0 than at 1 (``benchmarks/results/vllm_bench_serve_nap_clean.md``). No
    effect on an engine whose model runs in its engine-core process."""
    warmup: bool = True
    """Serve one short request before the worker registers (``VllmEngine._warm_up``)."""
    log_stats: bool = False
    """Also run vLLM's periodic stats log lines."""
    vllm_metrics: bool = True
    """vLLM's own ``vllm:*`` Prometheus metrics (prompt tokens by source, NIXL transfer
    bytes, ...) in the worker's registry; false skips their recording on every engine
    step."""
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
