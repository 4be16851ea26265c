"""The host KV pool with a tier under it that the workers of a host share (``kv-offload-dir``).

vLLM's ``TieringOffloadingSpec`` with our worker side. The primary tier is the host pool
(vLLM's CPU LRU manager, our :class:`~dynagraph.llm.kv.offload.host_pool.HostPoolWorker` copies)
over one region in ``/dev/shm`` that the engine's worker and its scheduler both map;
under it vLLM's file-system tier writes every block the pool stores through to one file
per block in ``kv-offload-dir``, named by the block's hash and the model's layout (vLLM's
``FileMapper``), and promotes a block it finds there back into the pool when a request
needs it. Block hashes depend only on the tokens (vLLM seeds them with a fixed value),
so every worker of the same model that names the directory finds every other's blocks:

- on a tmpfs (``/dev/shm/...``) the directory is a **host-shared RAM tier**: worker B
  loads the prefix worker A computed, and a disaggregated decode worker can load what a
  prefill worker of its host stored;
- on a disk it is a **disk tier** that outlives the workers.

vLLM's tier never deletes a file: ``kv-offload-dir-gib`` has the workers trim the
directory to a limit (:mod:`dynagraph.llm.kv.offload.tier_trim`); without one its owner clears
it. The engine's arguments name the tier
(``dynagraph.llm.engines.vllm.kv_config.kv_transfer_config``): blocks stored with a codec (``kv-compression``) live in a subdirectory named after it, so
workers with different codecs never read each other's bytes. Imports vLLM: load it only
inside an engine process.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingWorker,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from dynagraph.llm.kv.offload.host_pool import (
    EVICTION_METRIC,
    EvictionCounting,
    HostPoolWorker,
    pool_settings,
)


def _forget_name(region: SharedOffloadRegion) -> None:
    """Once the engine's second side has mapped the region, drop its name: the memory
    then goes with the last process that maps it, however that process ends."""
    if region._creator:
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(region.mmap_path)


def _release(region: SharedOffloadRegion) -> None:
    # the creator removes the name it made, unless the other side already did
    region._creator = region._creator and os.path.exists(region.mmap_path)
    region.cleanup()


class CountingTieringManager(EvictionCounting, TieringOffloadingManager):
    """vLLM's tiering manager that also counts the blocks its primary tier evicts."""


class TieredPoolWorker(HostPoolWorker):
    """:class:`HostPoolWorker` whose pool rows live in the engine's shared region."""

    def __init__(self, kv_caches: CanonicalKVCaches, region: SharedOffloadRegion,
                 **kwargs: Any) -> None:
        self._region = region
        super().__init__(kv_caches, region.num_chunks, pool_rows=region.create_next_worker_view,
                         **kwargs)

    def shutdown(self) -> None:
        super().shutdown()
        _release(self._region)


class TieredHostPoolSpec(TieringOffloadingSpec):
    """The host pool as vLLM's tiering primary tier, ``kv-offload-dir`` as its second."""

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        if not self.secondary_tier_configs:
            raise ValueError("TieredHostPoolSpec needs secondary_tiers in its extra config")
        self.codec, self.dtype = pool_settings(self, config.model.dtype)
        if (self.codec.name != "none" and config.worker_kv_bytes_per_block > 0
                and config.parallel.world_size <= 1):
            self._rows_of_encoded_blocks(config)

    def _rows_of_encoded_blocks(self, config: OffloadingConfig) -> None:
        """A lossy codec's blocks take rows of their encoded size (vLLM sized them for raw
        blocks): more blocks in the pool's memory, and smaller files in the tier, so a
        block moves compressed wherever it goes through the tier."""
        values = config.worker_kv_bytes_per_block // self.dtype.itemsize
        layers = max(sum(len(g.layer_names) for g in config.groups), 1)
        # the worker encodes each KV tensor's rows on their own (a tensor per layer, or
        # per layer and K/V): the larger of both splits, so every tensor's rows fit
        encoded = max(k * self.codec.encoded_bytes(-(-values // k)) for k in (layers, 2 * layers))
        self.cpu_page_size_per_worker = encoded
        self.kv_bytes_per_chunk = -(-encoded // self.BLOCK_SIZE_ALIGNMENT) * (
            self.BLOCK_SIZE_ALIGNMENT)
        self.num_chunks = int(self.extra_config["cpu_bytes_to_use"]) // self.kv_bytes_per_chunk

    @classmethod
    def build_metric_definitions(
            cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return {**super().build_metric_definitions(extra_config),
                **EVICTION_METRIC}

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            built = super().get_manager()
            assert isinstance(built, TieringOffloadingManager)
            self._manager = CountingTieringManager(  # the same tiers, evictions counted
                primary_tier=built.primary_tier, secondary_tiers=built.secondary_tiers)
            if self._scheduler_mmap is not None:
                _forget_name(self._scheduler_mmap)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            region = SharedOffloadRegion(
                engine_id=self._engine_id, num_chunks=self.num_chunks, rank=0,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker)
            _forget_name(region)
            try:
                self._worker = TieredPoolWorker(  # type: ignore[assignment]
                    kv_caches, region, codec=self.codec, dtype=self.dtype)
            except Exception:
                _release(region)
                raise
        return self._worker  # type: ignore[return-value]
