"""benchmarks/vllm_bench_serve.py: the command it runs and how it reduces the results."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.vllm_bench_serve import (
    bench_command,
    cpu_per_token,
    markdown,
    met,
    ratios,
    summarize_level,
)


def _args(**kw: object) -> argparse.Namespace:
    base = {"num_prompts": 0, "dataset": "random", "input_len": 128, "output_len": 64,
            "prefix_len": 512, "num_prefixes": 8}
    return argparse.Namespace(**{**base, **kw})


def _row(tok_s: float, p50: float, p99: float) -> dict[str, float]:
    return {"output_tok_s": tok_s, "ttft_p50_ms": p50, "ttft_p99_ms": p99,
            "tpot_p50_ms": 5.0, "itl_p50_ms": 5.0}


def test_the_command_is_vllms_benchmark_through_the_shim() -> None:
    cmd = bench_command("http://127.0.0.1:9", Path("models/m"), 16, 2, Path("/t/r.json"),
                        _args())
    assert cmd[1:5] == ["-m", "tools.vllm_cli", "bench", "serve"]
    joined = " ".join(cmd)
    for part in ("--base-url http://127.0.0.1:9", "--max-concurrency 16", "--num-prompts 64",
                 "--seed 2", "--ignore-eos", "--random-input-len 128",
                 "--random-output-len 64", "--result-dir /t", "--result-filename r.json"):
        assert part in joined


def test_prefix_repetition_sets_its_own_lengths() -> None:
    cmd = " ".join(bench_command("u", Path("m"), 8, 0, Path("/t/r.json"),
                                 _args(dataset="prefix_repetition", num_prompts=10)))
    assert "--dataset-name prefix_repetition" in cmd
    assert "--prefix-repetition-prefix-len 512" in cmd and "--num-prompts 10" in cmd


def test_ratios_are_per_round_and_the_overhead_in_ms() -> None:
    runs = {"ours": [_row(900, 52, 130), _row(1000, 50, 120)],
            "vllm": [_row(1000, 50, 100), _row(1000, 51, 100)]}
    r = ratios(runs["ours"], runs["vllm"])
    assert r["output_tok_s"] == [0.9, 1.0]
    assert r["ttft_p99_ms"] == [1.3, 1.2]
    assert r["ttft_p50_overhead_ms"] == [2.0, -1.0]
    level = summarize_level({**runs, "ours-nice0": [_row(1100, 50, 90)] * 2})
    versus = level["vs_vllm"]["ours"]
    assert versus["ratio_median"]["output_tok_s"] == 0.95
    assert versus["ratio_spread"]["ttft_p99_ms"] == [1.2, 1.3]
    assert met(versus) == {"output_tok_s": False, "ttft_p99": False, "ttft_p50_overhead": True}
    assert met(level["vs_vllm"]["ours-nice0"]) == {
        "output_tok_s": True, "ttft_p99": True, "ttft_p50_overhead": True}
    assert level["median"]["vllm"]["output_tok_s"] == 1000


def test_rounds_where_a_server_stalled_are_counted_and_left_out_of_the_steady_median() -> None:
    runs = {"ours": [_row(1000, 50, 120), _row(1000, 50, 900), _row(1100, 50, 100),
                     _row(900, 50, 100)],
            "vllm": [_row(500, 300, 2000), _row(1000, 50, 100), _row(1000, 50, 100),
                     _row(1000, 50, 100)]}
    versus = summarize_level(runs)["vs_vllm"]["ours"]
    assert versus["stalled_rounds"] == {"ours": [1], "vllm": [0]}
    assert versus["steady_rounds"] == 2
    assert versus["ratio_median"]["output_tok_s"] == 1.05  # 2.0, 1.0, 1.1, 0.9
    assert versus["steady_ratio_median"]["output_tok_s"] == 1.0  # 1.1, 0.9
    assert versus["steady_ratio_median"]["ttft_p50_overhead_ms"] == 0.0
    every = summarize_level({"ours": [_row(1, 1, 600)], "vllm": [_row(1, 1, 100)]})
    assert every["vs_vllm"]["ours"]["steady_ratio_median"] is None


def test_the_report_shows_the_stalls_and_the_steady_ratios() -> None:
    runs = {"ours": [_row(1000, 50, 120), _row(1100, 50, 100)],
            "vllm": [_row(500, 300, 2000), _row(1000, 50, 100)]}
    result = {"command": "c", "machine": {"at": "t", "cpus": 2, "loadavg_1m": 0.5},
              "vllm_version": "v", "failures": [],
              "settings": {"dataset": "random", "input_len": 128, "output_len": 128,
                           "num_prompts": 0, "rounds": 2, "systems": "ours,vllm"},
              "levels": {"16": summarize_level(runs)}, "runs": {"16": runs}}
    text = markdown(result)
    assert "| 16 | ours | 0 / 1 of 2 | 1 | 1.1x | 1.0x | 1.0x | 1.0x | +0 |" in text
    assert "all up for the whole run" in text
    result["settings"]["alone"] = True
    assert "one at a time, each started afresh for every round" in markdown(result)


def test_cpu_per_token_splits_the_engine_from_the_rest_and_leaves_out_infra() -> None:
    used = {"Frontend:11": 2.0, "VllmWorker:12": 1.0, "VLLM::EngineCor:13": 3.0,
            "VLLM::Worker:14": 1.0, "etcd:15": 0.5, "nats-server:16": 0.5}
    assert cpu_per_token(used, 10_000) == {"front_cpu_us_per_token": 300.0,
                                           "engine_cpu_us_per_token": 400.0}
    assert cpu_per_token({}, 0) == {"front_cpu_us_per_token": 0.0,
                                    "engine_cpu_us_per_token": 0.0}
