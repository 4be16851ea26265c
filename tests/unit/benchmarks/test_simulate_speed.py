from __future__ import annotations

import json
from pathlib import Path

from benchmarks._common import machine_info
from benchmarks.simulate_speed import markdown, run_one


def test_a_tiny_trace_is_simulated_and_reported(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = [{"timestamp": 0, "input_length": 1100, "output_length": 4, "hash_ids": [1, 2, 3]},
             {"timestamp": 50, "input_length": 1100, "output_length": 4, "hash_ids": [1, 2, 4]}]
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    run = run_one(str(trace), 2, "kv")
    s = run["summary"]
    assert s["completed"] == 2 and s["rejected"] == 0
    assert s["cached_prompt_tokens"] >= 1024  # the second request finds the shared blocks
    text = markdown({"argv": "--workers 2", "machine": machine_info(), "runs": [run]})
    assert "| 2 | kv |" in text
