"""``dynamo simulate`` end to end: a small trace slice in a subprocess, and its errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dynagraph.cli.main import main
from tests.support.paths import REPO

TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
CONFIG = str(REPO / "configs" / "mocker_mooncake.yaml")


def trace_slice(tmp_path: Path, n: int = 40) -> Path:
    """The real trace's first ``n`` requests (a synthetic stand-in where it is absent)."""
    path = tmp_path / "slice.jsonl"
    if TRACE.exists():
        with TRACE.open() as f:
            path.write_text("".join(next(f) for _ in range(n)))
    else:
        path.write_text("".join(
            json.dumps({"timestamp": 100 * i, "input_length": 1500, "output_length": 20,
                        "hash_ids": [0, 1 + i % 3, 10 + i]}) + "\n" for i in range(n)))
    return path


def test_the_command_writes_summary_requests_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "dynagraph.cli.main", "simulate", "graphs.mocker_router",
         "-f", CONFIG, "--trace", str(trace_slice(tmp_path)), "--out", str(out),
         "--speedup", "4", "--slo-ttft-ms", "2000", "--slo-itl-ms", "50",
         "--MockerWorker.engines-per-process=4"],
        cwd=REPO, capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "requests done" in proc.stderr  # the progress line
    summary = json.loads((out / "summary.json").read_text())
    assert summary["requests"] == 40 and summary["workers"] == 4
    assert summary["completed"] + summary["rejected"] == 40
    assert summary["slo"] == {"ttft_ms": 2000.0, "itl_ms": 50.0, "met": summary["slo"]["met"]}
    assert summary["goodput_rps"] <= summary["throughput_rps"]
    lines = (out / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 40
    assert {"arrival_s", "worker", "prompt_tokens", "cached_tokens", "ttft_ms", "end_s"} <= set(
        json.loads(lines[0]))
    for png in ("ttft_cdf.png", "workers.png", "hit_rate.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_malformed_trace_line_exits_2_naming_the_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(trace_slice(tmp_path, 3).read_text() + '{"timestamp": 5}\n')
    rc = main(["simulate", "graphs.mocker_router", "-f", CONFIG, "--trace", str(bad),
               "--out", str(tmp_path / "out")])
    assert rc == 2
    assert f"{bad}, line 4:" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_graph_with_a_real_engine_exits_2_naming_it(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc = main(["simulate", "graphs.agg", "--trace", str(trace_slice(tmp_path, 2)),
               "--out", str(tmp_path / "out")])
    assert rc == 2
    assert "component VllmWorker runs a real engine" in capsys.readouterr().err
