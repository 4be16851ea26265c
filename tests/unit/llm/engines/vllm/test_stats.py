"""The stat-logger side of VllmEngine: load snapshots and KV transfers (no vLLM needed)."""

from __future__ import annotations

from enum import Enum
from types import SimpleNamespace

import pytest

from dynagraph.llm.engines.vllm.stats import LoadTracker, kv_transfers, pool_counters

NIXL = {"transfer_duration": [0.002, 0.004], "post_duration": [0.0001, 0.0002],
        "bytes_transferred": [2097152, 8388608], "num_descriptors": [256, 1024],
        "num_failed_transfers": []}


def test_nixl_payload_yields_one_pair_per_transfer() -> None:
    assert list(kv_transfers(NIXL)) == [(2097152, 0.002), (8388608, 0.004)]


def test_multi_connector_payload_is_searched_per_connector() -> None:
    payload = {"NixlConnector": NIXL, "LMCacheConnector": {"hits": [3]}}
    assert list(kv_transfers(payload)) == [(2097152, 0.002), (8388608, 0.004)]


def test_other_connectors_and_empty_payloads_yield_nothing() -> None:
    assert list(kv_transfers({"hits": [1, 2]})) == []
    assert list(kv_transfers({"transfer_duration": [], "bytes_transferred": []})) == []


def test_tracker_passes_transfers_to_its_listener_only_when_set() -> None:
    tracker = LoadTracker()
    tracker.kv_connector_stats(NIXL)  # no listener: ignored
    seen: list[tuple[int, float]] = []
    tracker.on_kv_transfer = lambda n, s: seen.append((n, s))
    tracker.kv_connector_stats(None)
    tracker.kv_connector_stats(NIXL)
    assert seen == [(2097152, 0.002), (8388608, 0.004)]


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _step(tracker: LoadTracker, *, running: int, waiting: int = 0,
          prefill: int | None = 0, decodes: int = 0) -> None:
    tracker.update(running=running, waiting=waiting, kv_usage=0.0, queries=0, hits=0, total=10,
                   prefill_tokens=prefill, decode_seqs=decodes)


def test_steps_are_timed_from_the_arrival_then_back_to_back() -> None:
    clock = Clock()
    t = LoadTracker(clock)
    t.request_arrived()               # idle engine: its next step starts now (t=100)
    assert t.get().prefilling == 1
    clock.t = 100.25
    _step(t, running=1, prefill=2048)  # 0.25 s for a 2048-token chunk
    clock.t = 100.375
    _step(t, running=1, prefill=952)   # 0.125 s, back to back
    t.request_started()
    clock.t = 100.380
    _step(t, running=1, decodes=1)
    clock.t = 100.386
    _step(t, running=0, decodes=1)     # the last step: the engine is idle after it
    load = t.get()
    assert (load.requests_total, load.prefilling, load.prefill_tokens_total) == (1, 0, 3000)
    assert load.prefill_seconds_total == 0.375
    assert load.decode_steps_total == 2
    assert abs(load.decode_seconds_total - 0.011) < 1e-9
    # an idle gap is not a step: the next one is timed from the next arrival
    clock.t = 105.0
    t.request_arrived()
    clock.t = 105.125
    _step(t, running=1, prefill=100)
    assert t.get().prefill_seconds_total == 0.5


def test_untimed_records_and_unknown_starts_add_nothing() -> None:
    clock = Clock()
    t = LoadTracker(clock)
    _step(t, running=1, prefill=500)   # nothing arrived: the start is unknown
    assert (t.get().prefill_tokens_total, t.get().prefill_seconds_total) == (0, 0.0)
    clock.t = 101.0
    _step(t, running=1, prefill=None)  # a record without iteration details
    clock.t = 102.0
    _step(t, running=1, prefill=500)   # timed from the previous step's record (t=100)
    assert t.get().prefill_seconds_total == 2.0
    t.request_started()                # more starts than arrivals: never below zero
    assert t.get().prefilling == 0
    t.set_limits(batched_tokens=2048, seqs=64)
    assert (t.get().max_num_batched_tokens, t.get().max_num_seqs) == (2048, 64)


def _offload(**series: float) -> dict[str, object]:
    """An offloading connector stats payload as vLLM's stat logger receives it."""
    return {"types": {k: "counter" for k in series},
            "data": {k: {(): v} for k, v in series.items()}}


def test_pool_counters_read_the_offloading_payload_also_inside_a_multi_connector() -> None:
    step = _offload(**{"vllm:kv_offload_load_bytes": 4096, "vllm:kv_offload_load_time": 0.5,
                       "vllm:kv_offload_pool_evictions": 3,
                       "vllm:kv_offload_cpu_cache_usage_perc": 0.25,
                       "vllm:kv_offload_lookup_sync_delay_seconds": 9})
    want = {"vllm:kv_offload_load_bytes": 4096.0, "vllm:kv_offload_load_time": 0.5,
            "vllm:kv_offload_pool_evictions": 3.0, "vllm:kv_offload_cpu_cache_usage_perc": 0.25}
    assert pool_counters(step) == want
    assert pool_counters({"NixlConnector": NIXL, "OffloadingConnector": step}) == want
    assert pool_counters(NIXL) == {}


def test_tracker_adds_pool_steps_to_the_load() -> None:
    tracker = LoadTracker()
    lookups = SimpleNamespace(queries=96, hits_by_source={"host": 64})
    tracker.kv_connector_stats(_offload(**{"vllm:kv_offload_store_bytes": 100}), None)
    tracker.kv_connector_stats(_offload(**{"vllm:kv_offload_load_bytes": 40,
                                           "vllm:kv_offload_load_time": 0.25,
                                           "vllm:kv_offload_pool_evictions": 2}), lookups)
    tracker.kv_connector_stats(_offload(**{"vllm:kv_offload_store_bytes": 1,
                                           "vllm:kv_offload_cpu_cache_usage_perc": 0.5}), None)
    load = tracker.get()
    assert (load.kv_pool_query_tokens, load.kv_pool_hit_tokens) == (96, 64)
    assert (load.kv_pool_loaded_bytes, load.kv_pool_load_seconds) == (40, 0.25)
    assert (load.kv_pool_stored_bytes, load.kv_pool_evictions, load.kv_pool_usage) == (101, 2, 0.5)
    assert load.kv_tier_hit_tokens == 0


class CacheHitSource(str, Enum):  # noqa: UP042 (as vLLM's: its hash is the member name's)
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


def test_tier_hits_count_as_pool_hits_and_on_their_own() -> None:
    tracker = LoadTracker()
    tracker.kv_connector_stats(_offload(**{"vllm:kv_offload_tiering_read_bytes": 4096,
                                           "vllm:kv_offload_tiering_read_time": 0.5}),
                               SimpleNamespace(queries=128, hits_by_source={
        CacheHitSource.HOST: 32, CacheHitSource.DISK: 64, CacheHitSource.DEVICE: 7}))
    load = tracker.get()
    assert (load.kv_pool_hit_tokens, load.kv_tier_hit_tokens) == (96, 64)
    assert (load.kv_tier_read_bytes, load.kv_tier_read_seconds) == (4096, 0.5)


@pytest.mark.vllm
def test_vllms_prometheus_logger_is_replaced_by_one_that_records_nothing() -> None:
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    from dynagraph.llm.engines.vllm.stats import no_prometheus_logger

    cls = no_prometheus_logger()
    assert issubclass(cls, PrometheusStatLogger)  # so vLLM does not add its own
    logger = cls(SimpleNamespace(), [0])
    logger.record(None, None)
    logger.log()
    logger.log_engine_initialized()
    assert logger.engine_indexes == [0]
