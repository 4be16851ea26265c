"""The stat-logger side of VllmEngine: load snapshots and KV transfers (no vLLM needed)."""

from __future__ import annotations

from dynagraph.llm.engines.vllm_stats import LoadTracker, kv_transfers

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
