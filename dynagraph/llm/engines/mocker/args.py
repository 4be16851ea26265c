"""``MockerEngineArgs``: the mocker engine's typed settings (YAML keys in kebab-case)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


def _kebab(name: str) -> str:
    return name.replace("_", "-")


class MockerEngineArgs(BaseModel):
    """Settings of one simulated engine. Names follow vLLM's where vLLM has one."""

    model_config = ConfigDict(
        extra="forbid", alias_generator=_kebab, validate_by_name=True, validate_by_alias=True
    )

    profile: str = "cpu-tiny"
    """A shipped timing profile by name, or the path of a profile JSON file."""
    num_gpu_blocks: int | None = Field(default=None, ge=2)
    """KV blocks (vLLM's ``num_gpu_blocks_override``; one is vLLM's null block). Default:
    ``kv-cache-space-gib`` divided by the profile's bytes per block."""
    kv_cache_space_gib: float = Field(default=1.0, gt=0)
    """KV cache size when ``num-gpu-blocks`` is not set (as ``VLLM_CPU_KVCACHE_SPACE``)."""
    block_size: int | None = Field(default=None, ge=1)
    """KV block size in tokens; default the profile's. A Router must use the same."""
    max_num_seqs: int = Field(default=128, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    """Tokens per step; longer prompts are prefilled in chunks (vLLM: chunked prefill)."""
    max_model_len: int = Field(default=8192, ge=2)
    enable_prefix_caching: bool = True
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    """As vLLM's: ``priority`` serves requests by their SLO class's priority (lower
    first) and preempts the lowest-priority running request when blocks run out."""
    watermark: float = Field(default=0.0, ge=0.0, lt=1.0)
    speed: float = Field(default=1.0, gt=0)
    """Speed factor: every simulated duration (steps, transfers, leases) is divided by it."""
    seed: int = 0
    """Output tokens are a function of (seed, prompt[, request seed or id])."""
    vocab_size: int = Field(default=2048, ge=1)
    """Output token ids are drawn from ``[0, vocab-size)``; set the served model's."""
    eos_token_ids: list[int] = Field(default_factory=list)
    """Never produced, so requests end by ``max_tokens`` (or the context length)."""
    prefix_caching_hash_algo: Literal["sha256", "sha256_cbor"] = "sha256"
    """As vLLM's; with ``PYTHONHASHSEED`` from the environment, block hashes equal vLLM's."""
    engine_id: str | None = None
    """This engine's id in ``kv_transfer_params`` (default: random ``mocker-<hex>``)."""
    kv_transfer_bandwidth_gbps: float = Field(default=4.0, ge=0)
    """Simulated KV transfer bandwidth into this engine, in GB/s (1e9 bytes/s; 0: instant).
    ENVIRONMENT.md saw served NIXL transfers at 0.1-0.3x of ~15 GiB/s on these machines."""
    kv_transfer_latency_s: float = Field(default=0.0, ge=0)
    """Fixed time added to every simulated transfer (handshake, notification)."""
    kv_lease_seconds: float = Field(default=30.0, gt=0)
    """How long a prefill engine holds a finished request's blocks for its decode peer."""
