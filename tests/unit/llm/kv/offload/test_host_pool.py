"""The host KV pool's copies and eviction count, on plain tensors: no engine, but vLLM
is imported (~15 s, inside the tests so that collecting the fast set does not pay it),
hence the ``vllm`` marker."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def base() -> ModuleType:
    return importlib.import_module("vllm.v1.kv_offload.base")


@pytest.fixture(scope="module")
def cpu_common() -> ModuleType:
    return importlib.import_module("vllm.v1.kv_offload.cpu.common")


@pytest.fixture(scope="module")
def pool() -> ModuleType:
    return importlib.import_module("dynagraph.llm.kv.offload.host_pool")


def caches(base: ModuleType, pages: tuple[int, ...],
           blocks: int = 8) -> tuple[list[torch.Tensor], Any]:
    """Engine tensors of ``blocks`` rows filled with distinct bytes, as one KV group."""
    tensors = [torch.randint(-128, 127, (blocks, p), dtype=torch.int8) for p in pages]
    canonical = base.CanonicalKVCaches(
        tensors=[base.CanonicalKVCacheTensor(t, p) for t, p in zip(tensors, pages, strict=True)],
        group_data_refs=[[base.CanonicalKVCacheRef(i, p) for i, p in enumerate(pages)]],
    )
    return tensors, canonical


@pytest.mark.parametrize("pages", [(64, 128), (12, 20)], ids=["int64-rows", "int8-rows"])
def test_blocks_stored_then_loaded_elsewhere_come_back_byte_for_byte(
        pages: tuple[int, ...], base: ModuleType, cpu_common: ModuleType,
        pool: ModuleType) -> None:
    tensors, canonical = caches(base, pages)
    before = [t.clone() for t in tensors]
    worker = pool.HostPoolWorker(canonical, num_chunks=6)
    assert worker.pool_bytes == 6 * sum(pages)
    store = worker.submit_store(7, base.GPULoadStoreSpec([1, 3], [2], [0]),
                                cpu_common.CPULoadStoreSpec([5, 0]))
    for t in tensors:
        t.zero_()
    load = worker.submit_load(8, cpu_common.CPULoadStoreSpec([0, 5]),
                              base.GPULoadStoreSpec([2, 4], [2], [0]))
    assert store and load
    for t, b in zip(tensors, before, strict=True):
        assert torch.equal(t[2], b[3]) and torch.equal(t[4], b[1])
        assert not t[[0, 1, 3, 5, 6, 7]].any()
    done = worker.get_finished()
    assert [(r.job_id, r.success, r.transfer_size) for r in done] == [
        (7, True, 2 * sum(pages)), (8, True, 2 * sum(pages))]
    assert worker.get_finished() == []


def test_the_manager_counts_what_it_evicts(base: ModuleType, pool: ModuleType) -> None:
    manager = pool.CountingManager(num_chunks=2, enable_events=True)
    ctx = base.ReqContext(req_id="r")
    manager.on_new_request(ctx)
    keys = [base.make_offload_key(bytes([i]) * 8, 0) for i in range(4)]
    for key in keys:
        out = manager.prepare_store([key], ctx)
        assert out is not None
        manager.complete_store([key], ctx)
    stats = manager.get_stats()
    assert stats is not None and stats.data["data"][pool.EVICTIONS][()] == 2
    again = manager.get_stats()
    assert again is None or pool.EVICTIONS not in again.data["data"]
