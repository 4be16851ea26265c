"""Start-up progress events: one marker line under ``dynamo serve``, a log line elsewhere."""

from __future__ import annotations

import pytest

from dynagraph.runtime.progress import Event, parse, report


def test_progress_events_round_trip_and_fall_back_to_the_log(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("DYN_PROGRESS", "1")
    report("loading", "weights", label="W[0]", step=2)
    line = capsys.readouterr().err
    assert parse(line.rstrip("\n")) == Event("loading", "weights", {"step": 2})
    assert parse("not an event") is None and parse("@@dynagraph-progress {bad") is None
    monkeypatch.delenv("DYN_PROGRESS")
    with caplog.at_level("INFO", logger="dynagraph.runtime.progress"):
        report("ready", "instance 1f at 127.0.0.1:9", label="W[0]")
    assert caplog.messages == ["W[0] ready: instance 1f at 127.0.0.1:9"]
    with pytest.raises(ValueError, match="unknown progress phase"):
        report("done")
