"""The Router's configuration (``Router:`` in the graph's YAML) and its live settings.

``RouterConfig`` is the component's typed section; ``LIVE`` names the keys that can change
while it runs (``/{ns}/settings/Router/<name>`` in etcd, ``dynamo settings``).
"""

from __future__ import annotations

from pydantic import Field, field_validator

from dynagraph.config import ConfigModel
from dynagraph.llm.router.cost import CostModel, RouterMode
from dynagraph.llm.router.pressure import DEFAULT_CLASS_OVERLAP_WEIGHTS
from dynagraph.runtime.live_settings import LiveSpec

DEFAULT_POOL_BLOCK_SECONDS = 0.0001
"""Seconds to load one 32-token block of the tiny model from the host pool (from
``benchmarks/kv_offload.py``'s result); a larger model's block costs more, but so does
computing it."""

DEFAULT_TIER_BLOCK_SECONDS = 0.0002
"""Seconds to load one such block from the tier under the pools (``kv-offload-dir``): a
file read into the pool, then the pool's load (from ``benchmarks/disagg_served.py
--transports shm``'s result, rounded up: dearer than the pool)."""


class RouterConfig(ConfigModel):
    mode: RouterMode = RouterMode.KV
    cost_model: CostModel = CostModel.TIME
    """``time``: seconds to first token, from speeds learned at run time (no tuning);
    ``blocks``: Dynamo's ``overlap-weight * prefill_blocks + decode_blocks``."""
    overlap_weight: float = Field(default=1.0, ge=0.0)
    """Weight of the request's own prefill against the rest of the cost; 1 (the
    default) prices it at its time under the ``time`` model."""
    temperature: float = Field(default=0.0, ge=0.0)
    block_size: int | None = Field(default=None, ge=1)
    """None: use the block size the workers publish (they must all agree)."""
    seed: int | None = None
    """Seeds the tie-breaking RNG (for reproducible studies)."""
    reconnect_delay: float = Field(default=0.5, gt=0.0)
    track_timeout: float = Field(default=600.0, gt=0.0)
    """Longest a tracked request counts as in flight."""
    pool_block_seconds: float | None = Field(default=DEFAULT_POOL_BLOCK_SECONDS, ge=0.0)
    """Seconds to load one block from a worker's host KV pool (``kv-offload-gib``), the
    price of a pooled block in the ``time`` cost (cheaper than computing it, dearer than
    one already on the engine); null: pooled blocks count as uncached."""
    tier_block_seconds: float | None = Field(default=DEFAULT_TIER_BLOCK_SECONDS, ge=0.0)
    """The same for a block in the tier under the pools that the workers of a host share
    (``kv-offload-dir``): any worker naming that tier can load what another wrote there.
    null: such blocks count as uncached."""
    class_overlap_weights: dict[str, float] = Field(
        default_factory=lambda: dict(DEFAULT_CLASS_OVERLAP_WEIGHTS))
    """SLO class -> factor on ``overlap-weight`` for its requests (unlisted: 1)."""
    rebalance_wait: float | None = Field(default=1.0, gt=0.0)
    """Seconds a request may be expected to wait for a place in its worker's batch while
    places are free on others; those that would wait longer are handed back and placed
    again (``dynagraph.llm.router.rebalance``). null: never."""
    share_inflight: bool = True
    """Follow the other Router replicas' ``inflight`` streams and count what they routed
    (``dynagraph.llm.router.replicas``); false: each replica counts only its own."""
    sync_timeout: float = Field(default=3.0, ge=0.0)
    """At start, longest wait for every live worker's KV snapshot (and every peer's
    in-flight snapshot) before the Router takes requests."""

    @field_validator("class_overlap_weights")
    @classmethod
    def _non_negative(cls, v: dict[str, float]) -> dict[str, float]:
        if any(f < 0 for f in v.values()):
            raise ValueError("class overlap weights must be >= 0")
        return v


LIVE = LiveSpec(RouterConfig, ("mode", "cost-model", "overlap-weight", "temperature"))
"""Router settings that can change at run time (``/{ns}/settings/Router/<name>``)."""
