"""The two command-line tools end to end: make_trace writes a trace, trace_replay replays it
against the fake SSE server (in a subprocess) and writes JSON, .md and PNGs."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from benchmarks.make_trace import main as make_trace
from benchmarks.traces.trace import load_trace
from tests.unit.benchmarks.traces.test_replay import Fake, serving

REPO = Path(__file__).resolve().parents[4]


def test_make_trace_and_describe(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "t.jsonl"
    args = ["--out", str(out), "--seed", "3", "--duration-s", "10", "--max-requests", "12"]
    assert make_trace(args) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["stats"]["requests"] == 12 and first["config"]["seed"] == 3
    text = out.read_text()
    assert make_trace(args) == 0 and out.read_text() == text  # same options, same file
    capsys.readouterr()
    assert make_trace(["--describe", str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["stats"] == first["stats"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    assert make_trace(["--describe", str(bad)]) == 2
    assert f"{bad}:1: field 'input_length': missing" in capsys.readouterr().err


@pytest.fixture
async def server() -> AsyncIterator[tuple[Fake, str]]:
    async with serving(Fake(first_token_s=0.02, itl_s=0.002)) as served:
        yield served


async def test_trace_replay_cli(server: tuple[Fake, str], tmp_path: Path) -> None:
    fake, url = server
    fake.kinds = {3: "short"}
    trace = tmp_path / "t.jsonl"
    assert make_trace(["--out", str(trace), "--seed", "1", "--duration-s", "4",
                       "--max-requests", "8", "--output-tokens-max", "8",
                       "--rate", "5", "--burst-rate", "20"]) == 0
    out = tmp_path / "res" / "run"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(REPO / "benchmarks" / "trace_replay.py"), "--url", url,
        "--model", "m", "--trace", str(trace), "--speed", "4", "--token-range", "5:2048",
        "--window-s", "0.5", "--out", str(out), cwd=REPO,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        stdout, _ = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 1, stdout.decode()  # one request was cut short
    data = json.loads((tmp_path / "res" / "run.json").read_text())
    assert data["summary"]["requests"] == 8 and data["summary"]["errors"] == 1
    assert data["requests"][3]["error"].startswith("truncated:")
    assert len(fake.bodies) == 8
    records = load_trace(trace)
    assert [len(fake.bodies[i]["prompt"]) for i in range(8)] == [r.input_length for r in records]
    assert data["client"]["loop_lag_ms"]["n"] > 0
    page = (tmp_path / "res" / "run.md").read_text()
    assert "python benchmarks/trace_replay.py --url" in page
    for name in ("latency_cdf", "ttft_timeline", "goodput"):
        assert (tmp_path / "res" / f"run_{name}.png").stat().st_size > 1000
