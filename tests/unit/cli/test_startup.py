"""``dynamo serve``'s start-up lines: which child lines are shown, hidden or turned into
progress, and the exact progress lines (real vLLM 0.32 output lines as input)."""

from __future__ import annotations

import pytest

from dynagraph.cli.startup import HIDE, SHOW, OutputFilter, StartupView, Verdict
from dynagraph.runtime.progress import Event


def quiet() -> OutputFilter:
    return OutputFilter(quiet_vllm=True, hide_benign=True)


@pytest.mark.parametrize(("line", "detail"), [
    ("(MainProcess pid=4112) INFO 11-30 17:12:55 [model.py:733] Resolved architecture: "
     "LlamaForCausalLM", "model LlamaForCausalLM; starting the engine core process"),
    ("(EngineCore pid=4283) INFO 11-30 17:13:16 [core.py:133] Initializing a V1 LLM engine "
     "(v0.32.0) with config: model='models/tiny-llama', speculative_config=None",
     "engine core up (vLLM 0.32.0); starting its model runner"),
    ("(Worker pid=4449) INFO 11-30 17:13:34 [cpu_model_runner.py:68] Starting to load model "
     "models/tiny-llama...", "loading the weights of models/tiny-llama"),
    ("(Worker pid=4449) INFO 11-30 17:13:34 [default_loader.py:501] Loading weights took "
     "0.01 seconds", "weights loaded in 0.01 s"),
    ("(EngineCore pid=4283) INFO 11-30 17:13:36 [kv_cache_utils.py:2327] CPU KV cache size: "
     "524,288 tokens, Maximum concurrency for 4,096 tokens per request: 128.00x",
     "CPU KV cache of 524,288 tokens"),
    ("(EngineCore pid=4283) INFO 11-30 17:13:37 [core.py:402] init engine (profile, create kv "
     "cache, warmup model) took 0.98 s",
     "engine initialised in 0.98 s (profiling, KV cache, warm-up)"),
])
def test_vllm_milestones_become_loading_events(line: str, detail: str) -> None:
    assert quiet().classify(line) == Verdict("event", Event("loading", detail))


def test_vllm_info_is_hidden_only_when_we_chose_its_level() -> None:
    line = ("(EngineCore pid=4283) INFO 11-30 17:13:36 [utils.py:347] Using LBHNC KV cache "
            "layout.")
    assert quiet().classify(line) == HIDE
    assert OutputFilter(quiet_vllm=False, hide_benign=True).classify(line) == SHOW
    early = ("17:10:30 INFO vllm.triton_utils.importing [-] Triton not installed or not "
             "compatible; certain GPU-related functions will not be available.")
    assert quiet().classify(early) == HIDE


@pytest.mark.parametrize("line", [
    "(MainProcess pid=2239) WARNING 11-30 17:10:32 [vllm.py:1703] Enforce eager set, "
    "disabling torch.compile, CUDAGraphs, and JIT kernel warmup.",
    "(Worker pid=2735) WARNING 11-30 17:11:35 [cpu_worker.py:114] libtcmalloc is not found in "
    "LD_PRELOAD. For best performance, please follow the section `set LD_PRELOAD`",
    "17:10:30 WARNING vllm.triton_utils.importing [-] Triton is installed, but doesn't include "
    "CPU backend. Disabling Triton.",
    "Triton is installed, but doesn't include CPU backend. Disabling Triton.",
    "[W1130 17:11:35.408106800 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy for "
    "memory allocation on the NUMA nodes (0).",
    "(MainProcess pid=7428) WARNING 11-30 17:55:37 [arg_utils.py:1945] The global random seed is "
    "set to 0. Since VLLM_ENABLE_V1_MULTIPROCESSING is set to False, this may affect the random "
    "state of the Python process that launched vLLM.",
    "(EngineCore pid=7563) WARNING 11-30 17:55:53 [base.py:214] Initializing KVConnectorBase_V1. "
    "This API is experimental and subject to change in the future as we iterate the design.",
])
def test_expected_cpu_warnings_are_hidden_except_at_debug(line: str) -> None:
    assert quiet().classify(line) == HIDE
    assert OutputFilter(quiet_vllm=False, hide_benign=False).classify(line) == SHOW


def test_a_hidden_python_warning_hides_its_source_line_and_nothing_more() -> None:
    f = quiet()
    assert f.classify("/venv/lib/python3.11/site-packages/vllm/triton_utils/dispatcher.py:138: "
                      "FutureWarning: `torch.distributed.reduce_op` is deprecated, please use "
                      "`torch.distributed.ReduceOp` instead") == HIDE
    assert f.classify('  if hasattr(value, "__dict__"):') == HIDE
    assert f.classify("  an indented line of something else") == SHOW


def test_real_problems_and_our_lines_are_shown() -> None:
    f = quiet()
    for line in (
        "(EngineCore pid=1) ERROR 11-30 17:13:37 [core.py:1] EngineCore failed to start.",
        "(EngineCore pid=1) WARNING 11-30 17:13:37 [x.py:1] something new to look at",
        "17:11:44 INFO components.worker [-] engine ready in 98.2s (max_model_len 4096)",
        "Traceback (most recent call last):",
    ):
        assert f.classify(line) == SHOW, line
    assert f.classify("") == HIDE
    assert f.classify('@@dynagraph-progress {"phase":"ready","detail":"x","address":"a:1"}') \
        == Verdict("event", Event("ready", "x", {"address": "a:1"}))


def test_nixl_info_lines_are_hidden_with_vllms() -> None:
    line = "2026-11-30 17:55:54 NIXL INFO    _api.py:405 Backend UCX was instantiated"
    assert quiet().classify(line) == HIDE
    assert OutputFilter(quiet_vllm=False, hide_benign=False).classify(line) == SHOW


def test_a_bar_redrawn_with_carriage_returns_counts_by_its_last_state() -> None:
    v = quiet().classify("\rLoading safetensors checkpoint shards:   0% Completed | 0/1 [00:00<?]"
                         "\rLoading safetensors checkpoint shards: 100% Completed | 1/1 [00:00<00:00]"
                         "\r\n")
    assert v.event == Event("loading", "safetensors checkpoint shards 1/1 (100%)",
                            {"repeat": "shards", "final": True})


def test_checkpoint_shard_bars_become_throttled_progress() -> None:
    f = quiet()
    v = f.classify("Loading safetensors checkpoint shards:  50% Completed | 2/4 [00:01<00:01]")
    assert v.event == Event("loading", "safetensors checkpoint shards 2/4 (50%)",
                            {"repeat": "shards", "final": False})
    view = StartupView(0.0, ["W[0]"])
    assert view.event("W[0]", v.event, 1.0) == "[    1.0s] W[0]  loading: safetensors " \
        "checkpoint shards 2/4 (50%)"
    again = f.classify("Loading safetensors checkpoint shards:  75% Completed | 3/4 [00:02<00:01]")
    assert again.event is not None and view.event("W[0]", again.event, 2.0) is None
    done = f.classify("Loading safetensors checkpoint shards: 100% Completed | 4/4 [00:02<00:00]")
    assert done.event is not None
    assert view.event("W[0]", done.event, 2.5) == "[    2.5s] W[0]  loading: safetensors " \
        "checkpoint shards 4/4 (100%)"
    assert view.event("W[0]", done.event, 2.6) is None  # tqdm prints its last state twice
    assert f.classify("Loading safetensors checkpoint shards:   0% Completed | 0/4 [00:00<?]") \
        == HIDE


def test_view_lines_for_a_graph_starting() -> None:
    view = StartupView(100.0, ["Frontend[0]", "VllmWorker[0]"])
    assert view.started("Frontend[0]", 11, 100.2) == "[    0.2s] Frontend[0]    started, pid 11"
    assert view.started("VllmWorker[0]", 12, 100.3) == \
        "[    0.3s] VllmWorker[0]  started, pid 12"
    assert view.event("Frontend[0]", Event("ready", "instance 1 at 127.0.0.1:5", {
        "address": "127.0.0.1:5", "url": "http://127.0.0.1:8000"}), 103.0) == \
        "[    3.0s] Frontend[0]    ready in 2.8s, http://127.0.0.1:8000"
    assert view.event("VllmWorker[0]", Event("loading", "weights loaded in 0.01 s"), 110.0) == \
        "[   10.0s] VllmWorker[0]  loading: weights loaded in 0.01 s"
    assert view.waiting(129.9) is None  # something was printed 19.9 s ago
    assert view.waiting(130.0) == "[   30.0s] waiting for 1 of 2: VllmWorker[0] (loading, 30s)"
    assert view.waiting(140.0) is None  # and then not again for another 20 s
    assert not view.all_ready()
    assert view.event("VllmWorker[0]", Event("ready", "", {"address": "127.0.0.1:6"}),
                      145.0) == "[   45.0s] VllmWorker[0]  ready in 44.7s, 127.0.0.1:6"
    assert view.all_ready()
    assert view.waiting(500.0) is None


def test_a_restarted_process_is_waited_for_again() -> None:
    view = StartupView(0.0, ["A[0]"])
    view.started("A[0]", 1, 0.0)
    view.event("A[0]", Event("ready"), 1.0)
    view.exited("A[0]")
    assert not view.all_ready()
    assert view.started("A[0]", 2, 5.0, restart=1) == "[    5.0s] A[0]  started, pid 2, restart 1"
