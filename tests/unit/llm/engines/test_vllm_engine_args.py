"""VllmEngine pieces that need no vLLM: config parsing, load tracking, output mapping."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from dynagraph.errors import ConfigError, EngineError
from dynagraph.llm.engines import SamplingSpec
from dynagraph.llm.engines.vllm_engine import (
    VllmEngine,
    VllmEngineArgs,
    _finish_reason,
    _to_engine_output,
)
from dynagraph.llm.engines.vllm_stats import LoadTracker


def test_module_import_does_not_import_vllm() -> None:
    # Other tests in the same session may have imported vLLM; check in a clean process.
    code = "import sys, dynagraph.llm.engines.vllm_engine; assert 'vllm' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30)


def test_args_accept_kebab_and_snake_case() -> None:
    a = VllmEngineArgs.model_validate(
        {"model": "m", "block-size": 64, "max-model-len": 4096, "kv_cache_space_gib": 2}
    )
    assert (a.block_size, a.max_model_len, a.kv_cache_space_gib) == (64, 4096, 2)


def test_args_defaults() -> None:
    a = VllmEngineArgs(model="m")
    assert a.block_size == 128
    assert a.enforce_eager and a.enable_prefix_caching
    assert a.kv_cache_space_gib == 1
    assert a.kv_events_endpoint is None and a.kv_transfer_config is None


def test_args_reject_unknown_keys() -> None:
    with pytest.raises(ValidationError, match="max-batch"):
        VllmEngineArgs.model_validate({"model": "m", "max-batch": 3})


def test_engine_args_mapping_drops_unset_and_merges_extra() -> None:
    a = VllmEngineArgs(model="m", max_num_seqs=8, extra_engine_args={"swap_space": 0})
    kwargs = VllmEngine(a).engine_args()
    assert kwargs["model"] == "m"
    assert kwargs["block_size"] == 128
    assert kwargs["max_num_seqs"] == 8
    assert kwargs["swap_space"] == 0
    assert kwargs["disable_log_stats"] is True
    assert "max_model_len" not in kwargs  # unset: vLLM takes the model's


def test_engine_args_extra_may_not_shadow_typed_keys() -> None:
    a = VllmEngineArgs(model="m", extra_engine_args={"block_size": 16})
    with pytest.raises(ConfigError, match="block_size"):
        VllmEngine(a).engine_args()


def test_load_tracker_accumulates_prefix_cache_counts() -> None:
    t = LoadTracker()
    t.set_total(100)
    assert t.get().kv_blocks_total == 100
    t.update(running=2, waiting=1, kv_usage=0.25, queries=64, hits=32, total=100)
    t.update(running=1, waiting=0, kv_usage=0.104, queries=10, hits=0, total=100)
    load = t.get()
    assert (load.running, load.waiting, load.kv_blocks_used) == (1, 0, 10)
    assert (load.prefix_cache_queries, load.prefix_cache_hits) == (74, 32)


@pytest.mark.parametrize(
    ("vllm_reason", "ours"),
    [
        (None, None),
        ("stop", "stop"),
        ("length", "length"),
        ("abort", "abort"),
        ("repetition", "stop"),
    ],
)
def test_finish_reason_mapping(vllm_reason: str | None, ours: str | None) -> None:
    assert _finish_reason(vllm_reason) == ours


def _request_output(**kw: Any) -> SimpleNamespace:
    completion = SimpleNamespace(
        token_ids=kw.pop("token_ids", [7]), finish_reason=kw.pop("reason", None)
    )
    base = {
        "request_id": "r",
        "outputs": [completion],
        "finished": False,
        "num_cached_tokens": None,
        "kv_transfer_params": None,
    }
    return SimpleNamespace(**{**base, **kw})


def test_output_mapping() -> None:
    mid = _to_engine_output(_request_output(token_ids=(4, 5)), 9)
    assert mid.token_ids == [4, 5] and mid.finish_reason is None
    assert mid.num_prompt_tokens == 9 and mid.num_cached_tokens == 0
    params = {"remote_engine_id": "e", "remote_block_ids": [1]}
    last = _to_engine_output(
        _request_output(
            finished=True, reason="length", num_cached_tokens=64, kv_transfer_params=params
        ),
        9,
    )
    assert last.finish_reason == "length"
    assert last.num_cached_tokens == 64
    assert last.kv_transfer_params == params


def test_output_mapping_raises_on_engine_error() -> None:
    with pytest.raises(EngineError):
        _to_engine_output(_request_output(finished=True, reason="error"), 1)


async def test_generate_before_start_fails() -> None:
    engine = VllmEngine(VllmEngineArgs(model="m"))
    with pytest.raises(EngineError, match="not started"):
        async for _ in engine.generate("r", [1], SamplingSpec()):
            pass
    assert engine.load().running == 0
    await engine.shutdown()  # no-op when never started


@pytest.mark.parametrize("endpoint", ["tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://[::]:5557"])
def test_kv_events_endpoint_must_not_listen_everywhere(endpoint: str) -> None:
    with pytest.raises(ValidationError, match="every interface"):
        VllmEngineArgs(model="m", kv_events_endpoint=endpoint)


def test_kv_events_endpoint_local_ok() -> None:
    a = VllmEngineArgs.model_validate(
        {"model": "m", "kv-events-endpoint": "ipc:///tmp/x.ipc", "kv-events-topic": "w1"}
    )
    assert a.kv_events_endpoint == "ipc:///tmp/x.ipc" and a.kv_events_topic == "w1"
