"""VllmEngine pieces that need no vLLM: config parsing, load tracking, output mapping."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pydantic import ValidationError

from dynagraph.errors import ConfigError, EngineError
from dynagraph.llm.engines import SamplingSpec
from dynagraph.llm.engines.vllm.args import OMP_SPIN_COUNT, VllmEngineArgs
from dynagraph.llm.engines.vllm.convert import _finish_reason, to_engine_outputs
from dynagraph.llm.engines.vllm.engine import VllmEngine
from dynagraph.llm.engines.vllm.engine_spin import SPIN_ENV
from dynagraph.llm.engines.vllm.env import (
    DYNAMO_DISABLE_ENV,
    HUGE_PAGES_ENV,
    OMP_SPIN_ENV,
    apply_env,
    huge_pages_for,
)
from dynagraph.llm.engines.vllm.kv_config import kv_transfer_config
from dynagraph.llm.engines.vllm.stats import LoadTracker
from dynagraph.llm.kv.transfer.shm_direct import ENV as KV_SHM_ENV


@pytest.fixture(autouse=True)
def _engine_core_spin_env_undone(monkeypatch: pytest.MonkeyPatch) -> None:
    """``apply_env`` sets the engine core's busy-wait for the processes vLLM spawns; keep
    it out of this test process's later engines and vLLM servers."""
    monkeypatch.delenv(SPIN_ENV, raising=False)


def test_module_import_does_not_import_vllm() -> None:
    # Other tests in the same session may have imported vLLM; check in a clean process.
    code = "import sys, dynagraph.llm.engines.vllm.engine; assert 'vllm' not in sys.modules"
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
    assert a.warmup and "warmup" not in VllmEngine(a).engine_args()  # ours, not vLLM's
    assert a.engine_nice == 19


def test_eager_turns_torch_compile_off_for_vllms_helpers_unless_told_otherwise(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM torch.compiles its logprobs rank count even when eager: 18.5 s on the first
    request with logprobs here. Eager engines run it uncompiled instead."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:  # restored after the test, as is the environment
        monkeypatch.setattr(dynamo.config, "disable", False)
    for env in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND",
                "VLLM_CPU_NUM_OF_RESERVED_CPU", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                "VLLM_NO_USAGE_STATS", "VLLM_DO_NOT_TRACK", HUGE_PAGES_ENV):
        monkeypatch.setenv(env, os.environ.get(env, ""))  # whatever apply_env sets is undone
    monkeypatch.delenv(DYNAMO_DISABLE_ENV, raising=False)
    apply_env(VllmEngineArgs(model="m", enforce_eager=False))
    assert DYNAMO_DISABLE_ENV not in os.environ
    apply_env(VllmEngineArgs(model="m"))
    assert os.environ[DYNAMO_DISABLE_ENV] == "1"
    if dynamo is not None:
        assert dynamo.config.disable
    monkeypatch.setenv(DYNAMO_DISABLE_ENV, "0")  # the operator's choice stands
    apply_env(VllmEngineArgs(model="m"))
    assert os.environ[DYNAMO_DISABLE_ENV] == "0"


def test_huge_pages_only_where_peers_read_the_cache_over_nixl() -> None:
    """Unset, ``huge-pages`` is on only for an engine with a NIXL connector whose KV cache
    stays in PyTorch's memory (a read copies from huge pages about twice as fast); not
    for an engine without one (whatever the environment says), nor one whose cache moves
    to shared memory (huge pages there only cost start-up time). A setting wins."""
    plain = VllmEngineArgs(model="m")
    nixl = VllmEngineArgs(model="m", kv_transfer_config={"kv_connector": "NixlConnector"})
    assert not huge_pages_for(plain, {}) and not huge_pages_for(plain, {KV_SHM_ENV: "0"})
    assert huge_pages_for(nixl, {}) and huge_pages_for(nixl, {KV_SHM_ENV: "0"})
    assert not huge_pages_for(nixl, {KV_SHM_ENV: "1"})
    assert huge_pages_for(plain.model_copy(update={"huge_pages": True}), {})
    assert not huge_pages_for(nixl.model_copy(update={"huge_pages": False}), {})


def test_the_engine_processes_get_the_huge_pages_decision(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """PyTorch's ``THP_MEM_ALLOC_ENABLE``, read in the engine processes, says it."""
    monkeypatch.setenv(HUGE_PAGES_ENV, "")
    monkeypatch.setenv(KV_SHM_ENV, "0")
    apply_env(VllmEngineArgs(model="m"))
    assert os.environ[HUGE_PAGES_ENV] == "0"
    apply_env(VllmEngineArgs(model="m", kv_transfer_config={"kv_connector": "NixlConnector"}))
    assert os.environ[HUGE_PAGES_ENV] == "1"
    apply_env(VllmEngineArgs.model_validate(
        {"model": "m", "huge-pages": False, "kv-transfer-config": {"kv_connector": "NixlConnector"}}))
    assert os.environ[HUGE_PAGES_ENV] == "0"


def test_omp_spin_count_sets_libgomps_spin_unless_none(monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    """``omp-spin-count`` becomes ``GOMP_SPINCOUNT`` for the engine processes, short by
    default; ``null`` leaves the environment (an operator's own value) as it is."""
    monkeypatch.setenv(OMP_SPIN_ENV, "777")
    apply_env(VllmEngineArgs.model_validate({"model": "m", "omp-spin-count": None}))
    assert os.environ[OMP_SPIN_ENV] == "777"
    apply_env(VllmEngineArgs(model="m"))
    assert os.environ[OMP_SPIN_ENV] == str(OMP_SPIN_COUNT)
    apply_env(VllmEngineArgs.model_validate({"model": "m", "omp-spin-count": 50000}))
    assert os.environ[OMP_SPIN_ENV] == "50000"
    with pytest.raises(ValidationError, match="omp-spin-count"):
        VllmEngineArgs.model_validate({"model": "m", "omp-spin-count": -1})


def test_prefill_and_decode_engines_both_spin_briefly() -> None:
    """Both disagg engines share a host's cores: each one's spin took them from the other."""
    from components.prefill_worker import PrefillWorkerConfig
    from components.worker import VllmWorkerConfig

    assert PrefillWorkerConfig(model="m").omp_spin_count == OMP_SPIN_COUNT
    assert VllmWorkerConfig(model="m").omp_spin_count == OMP_SPIN_COUNT
    assert VllmWorkerConfig.model_validate(
        {"model": "m", "omp-spin-count": None}).omp_spin_count is None


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


def test_host_pool_alone_or_under_a_multi_connector_with_nixl() -> None:
    assert kv_transfer_config(VllmEngineArgs(model="m")) is None
    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    assert kv_transfer_config(VllmEngineArgs(model="m", kv_transfer_config=nixl)) == nixl
    a = VllmEngineArgs.model_validate({"model": "m", "kv-offload-gib": 0.5,
                                       "num-gpu-blocks-override": 160})
    assert VllmEngine(a).engine_args()["num_gpu_blocks_override"] == 160
    pool = kv_transfer_config(a)
    assert pool is not None and pool["kv_connector"] == "OffloadingConnector"
    extra = pool["kv_connector_extra_config"]
    assert extra["cpu_bytes_to_use"] == 2**29
    assert (extra["spec_module_path"], extra["spec_name"]) == (
        "dynagraph.llm.kv.offload.host_pool", "HostPoolSpec")
    both = kv_transfer_config(a.model_copy(update={"kv_transfer_config": nixl}))
    assert both is not None and both["kv_connector"] == "MultiConnector"
    assert both["kv_connector_extra_config"]["connectors"] == [nixl, pool]
    named = kv_transfer_config(a.model_copy(update={"kv_transfer_config": {
        **nixl, "engine_id": "decode-1"}}))
    assert named is not None and named["engine_id"] == "decode-1"  # children inherit it
    assert named["kv_connector_extra_config"]["connectors"] == [nixl, pool]
    # vLLM's scheduler reads the top connector's failure policy only: a failed NIXL read
    # (a prefill worker gone after its hand-off) is computed, not the request failed
    assert pool["kv_load_failure_policy"] == both["kv_load_failure_policy"] == "recompute"
    strict = kv_transfer_config(a.model_copy(update={"kv_transfer_config": {
        **nixl, "kv_load_failure_policy": "fail"}}))
    assert strict is not None and strict["kv_load_failure_policy"] == "fail"  # the user's


def test_a_tier_dir_puts_vllms_file_tier_under_the_pool_one_directory_per_codec(
        tmp_path: Path) -> None:
    args = VllmEngineArgs.model_validate({"model": "m", "kv-offload-gib": 0.5,
                                          "kv-offload-dir": str(tmp_path)})
    extra = kv_transfer_config(args)["kv_connector_extra_config"]  # type: ignore[index]
    assert (extra["spec_module_path"], extra["spec_name"]) == (
        "dynagraph.llm.kv.offload.host_tiers", "TieredHostPoolSpec")
    [tier] = extra["secondary_tiers"]
    assert tier["type"] == "fs" and tier["root_dir"] == str(tmp_path / "none")
    coded = kv_transfer_config(args.model_copy(update={"kv_compression": "pkg.mod:Codec"}))
    assert coded["kv_connector_extra_config"]["secondary_tiers"][0][  # type: ignore[index]
        "root_dir"] == str(tmp_path / "pkg.mod-Codec")


def test_a_tier_dir_needs_the_pool() -> None:
    with pytest.raises(ValueError, match="kv-offload-dir.*set kv-offload-gib"):
        VllmEngineArgs.model_validate({"model": "m", "kv-offload-dir": "/dev/shm/kv"})
    with pytest.raises(ValueError, match="kv-offload-dir-gib.*set kv-offload-dir"):
        VllmEngineArgs.model_validate({"model": "m", "kv-offload-gib": 0.5,
                                       "kv-offload-dir-gib": 1})
    with pytest.raises(ValueError, match="kv-offload-dir-gib"):
        VllmEngineArgs.model_validate({"model": "m", "kv-offload-dir-gib": -1})


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
        index=0, token_ids=kw.pop("token_ids", [7]), finish_reason=kw.pop("reason", None),
        logprobs=None,
    )
    base = {
        "request_id": "r",
        "outputs": [completion],
        "finished": False,
        "num_cached_tokens": None,
        "kv_transfer_params": None,
        "prompt_logprobs": None,
    }
    return SimpleNamespace(**{**base, **kw})


def test_output_mapping() -> None:
    (mid,) = to_engine_outputs(_request_output(token_ids=(4, 5)), 9)
    assert mid.token_ids == [4, 5] and mid.finish_reason is None and mid.index == 0
    assert mid.num_prompt_tokens == 9 and mid.num_cached_tokens == 0
    assert mid.logprobs is None and mid.prompt_logprobs is None
    params = {"remote_engine_id": "e", "remote_block_ids": [1]}
    (last,) = to_engine_outputs(
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
        to_engine_outputs(_request_output(finished=True, reason="error"), 1)


def test_output_mapping_of_choices_and_logprobs() -> None:
    """n > 1: one output per choice, each finishing on its own; vLLM's flat logprobs
    become (ids, logprobs) per position; prompt logprobs go on the first output only."""
    flat = SimpleNamespace(start_indices=[0, 2], end_indices=[2, 3], token_ids=[5, 6, 7],
                           logprobs=[-0.1, -2.0, -0.5], ranks=[1, 2, 1])
    prompt = SimpleNamespace(start_indices=[0, 0], end_indices=[0, 2], token_ids=[8, 9],
                             logprobs=[-3.0, -1.0], ranks=[4, None])
    first = SimpleNamespace(index=1, token_ids=[5, 7], finish_reason="stop", logprobs=flat)
    second = SimpleNamespace(index=0, token_ids=[3], finish_reason=None, logprobs=None)
    a, b = to_engine_outputs(_request_output(outputs=[first, second],
                                              prompt_logprobs=prompt), 2)
    assert (a.index, a.finish_reason, b.index, b.finish_reason) == (1, "stop", 0, None)
    assert a.logprobs == [([5, 6], [-0.1, -2.0]), ([7], [-0.5])]
    assert a.prompt_logprobs == [None, ([8, 9], [-3.0, -1.0], [4, 0])]
    assert b.prompt_logprobs is None and b.logprobs is None


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


def test_spread_puts_each_worker_on_its_own_core() -> None:
    from dynagraph.llm.engines.vllm.env import spread_bind

    assert [spread_bind("spread", i, 2) for i in range(3)] == ["0", "1", "0"]
    assert spread_bind("0-1", 1, 2) == "0-1" and spread_bind(None, 1, 2) is None
