"""NIXL set-up helpers (no NIXL, no vLLM needed)."""

from __future__ import annotations

import os

import pytest

from dynagraph.errors import ConfigError
from dynagraph.llm.nixl_side import QUIET_MODULE, nixl_key, prepare_nixl


def test_prepare_nixl_sets_side_channel_and_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_PORT", raising=False)
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_HOST", raising=False)
    cfg, ep = prepare_nixl("kv_consumer", engine_id="VllmWorker-1", base={"kv_role": "kv_producer"})
    assert os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert int(os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == ep.port > 0
    assert cfg["kv_role"] == "kv_consumer" and cfg["engine_id"] == "VllmWorker-1"
    assert cfg["kv_connector_module_path"] == QUIET_MODULE
    assert cfg["kv_buffer_device"] == "cpu" and cfg["kv_load_failure_policy"] == "recompute"
    assert ep.record() == {"engine_id": "VllmWorker-1", "host": "127.0.0.1", "port": ep.port,
                           "role": "kv_consumer"}


def test_prepare_nixl_without_quiet_and_bad_connector(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "1")
    cfg, _ = prepare_nixl("kv_producer", engine_id="p", quiet=False, port=5555)
    assert "kv_connector_module_path" not in cfg
    with pytest.raises(ConfigError):
        prepare_nixl("kv_producer", engine_id="p", base={"kv_connector": "LMCacheConnector"})


def test_nixl_key() -> None:
    assert nixl_key("dynamo", "PrefillWorker", 255) == "/dynamo/nixl/PrefillWorker/ff"
