"""NIXL set-up helpers (no NIXL, no vLLM needed)."""

from __future__ import annotations

import os

import pytest

from dynagraph.errors import ConfigError
from dynagraph.llm.kv.transfer.nixl_settle import DEFAULT_SETTLE_US
from dynagraph.llm.kv.transfer.nixl_settle import ENV as SETTLE_ENV
from dynagraph.llm.kv.transfer.nixl_side import (
    CONNECTOR_MODULE,
    DEFAULT_DELAY_US,
    DELAY_ENV,
    delayed_agent_config,
    nixl_key,
    prepare_nixl,
    progress_delay_from_env,
    settle_budget_from_env,
)

pytestmark = pytest.mark.usefixtures("restored_env")


def test_prepare_nixl_sets_side_channel_and_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_PORT", raising=False)
    monkeypatch.delenv("VLLM_NIXL_SIDE_CHANNEL_HOST", raising=False)
    cfg, ep = prepare_nixl("kv_consumer", engine_id="VllmWorker-1", base={"kv_role": "kv_producer"})
    assert os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # engine core in-process
    assert int(os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"]) == ep.port > 0
    assert cfg["kv_role"] == "kv_consumer" and cfg["engine_id"] == "VllmWorker-1"
    assert cfg["kv_connector_module_path"] == CONNECTOR_MODULE
    assert cfg["kv_buffer_device"] == "cpu" and cfg["kv_load_failure_policy"] == "recompute"
    assert ep.record() == {"engine_id": "VllmWorker-1", "host": "127.0.0.1", "port": ep.port,
                           "role": "kv_consumer"}


def test_prepare_nixl_passes_the_progress_delay_and_rejects_other_connectors(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "1")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.delenv(DELAY_ENV, raising=False)
    monkeypatch.delenv(SETTLE_ENV, raising=False)
    prepare_nixl("kv_producer", engine_id="p", port=5555)
    assert progress_delay_from_env() == DEFAULT_DELAY_US
    assert settle_budget_from_env() == DEFAULT_SETTLE_US / 1e6
    prepare_nixl("kv_consumer", engine_id="d", port=5556, settle_us=0)
    assert settle_budget_from_env() == 0.0
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"  # a choice already made stays
    prepare_nixl("kv_producer", engine_id="p", port=5555, progress_delay_us=0)
    assert progress_delay_from_env() == 0
    cfg, _ = prepare_nixl("kv_producer", engine_id="p", port=5555,
                          base={"kv_connector_module_path": "my.module"})
    assert cfg["kv_connector_module_path"] == "my.module"  # the user's choice wins
    with pytest.raises(ConfigError):
        prepare_nixl("kv_producer", engine_id="p", base={"kv_connector": "LMCacheConnector"})


def test_nixl_key() -> None:
    assert nixl_key("dynamo", "PrefillWorker", 255) == "/dynamo/nixl/PrefillWorker/ff"


def test_progress_delay_from_env_defaults_and_bad_values() -> None:
    assert progress_delay_from_env({}) == DEFAULT_DELAY_US
    assert progress_delay_from_env({DELAY_ENV: "250"}) == 250
    assert progress_delay_from_env({DELAY_ENV: "-5"}) == 0
    assert progress_delay_from_env({DELAY_ENV: "fast"}) == DEFAULT_DELAY_US


class FakeAgentConfig:
    """Stands in for the ``nixlAgentConfig`` binding: nixl._api sets fields one by one."""

    pthrDelay = 7
    lthrDelay = 0


def test_delayed_agent_config_replaces_only_the_hard_coded_zero() -> None:
    cls = delayed_agent_config(FakeAgentConfig, 1000)
    assert issubclass(cls, FakeAgentConfig)
    cfg = cls()
    cfg.pthrDelay = 0  # what nixl._api does
    cfg.lthrDelay = 0
    assert (cfg.pthrDelay, cfg.lthrDelay) == (1000, 0)
    cfg.pthrDelay = 5  # an explicit non-zero value is kept
    assert cfg.pthrDelay == 5
    assert delayed_agent_config(cls, 50) is cls  # idempotent, delay updated
    again = cls()
    again.pthrDelay = 0
    assert again.pthrDelay == 50
