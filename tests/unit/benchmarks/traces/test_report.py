"""Report math on known numbers: percentiles, mean ITL, goodput, attainment, windows."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from benchmarks.traces.plots import plot_all
from benchmarks.traces.replay import RequestResult
from benchmarks.traces.report import (
    Slo,
    clean,
    client_stats,
    error_kind,
    markdown,
    stats,
    summarize_run,
    windows,
)


def res(i: int, due: float, tokens: list[float], end: float, *, n: int | None = None,
        error: str | None = None, cached: int | None = None) -> RequestResult:
    r = RequestResult(index=i, scheduled_s=due, input_length=100, max_tokens=n or len(tokens))
    r.sent_s = due + 0.001
    r.token_times = tokens
    r.end_s = end
    r.output_tokens = n if n is not None else len(tokens)
    r.prompt_tokens = 100
    r.cached_tokens = cached
    r.error = error
    r.status = 200
    return r


SLO = Slo(ttft_ms=200.0, itl_ms=50.0)


@pytest.fixture
def results() -> list[RequestResult]:
    return [
        # good: TTFT 100 ms, mean ITL (0.18 - 0.10) / 2 = 40 ms
        res(0, 0.0, [0.10, 0.14, 0.18], 0.2, cached=50),
        # TTFT 500 ms: misses the TTFT SLO
        res(1, 1.0, [1.5, 1.52], 1.6, cached=0),
        # mean ITL (6.0 - 5.05) / 1 = 950 ms: misses the ITL SLO
        res(2, 5.0, [5.05, 6.0], 6.2),
        # failed
        res(3, 6.0, [6.1], 6.5, n=1, error="truncated: 1 of 4 tokens"),
        # one token: no ITL, TTFT 150 ms: good
        res(4, 9.0, [9.15], 10.0, n=1),
    ]


def test_request_properties(results: list[RequestResult]) -> None:
    r = results[0]
    assert r.ttft_s == pytest.approx(0.10)
    assert r.mean_itl_s == pytest.approx(0.04)
    assert r.e2e_s == pytest.approx(0.2)
    assert results[4].mean_itl_s is None
    # tokens grouped in fewer events: the mean ITL uses the usage count
    grouped = res(9, 0.0, [0.1, 0.4], 0.5, n=4)
    assert grouped.mean_itl_s == pytest.approx(0.1)


def test_slo(results: list[RequestResult]) -> None:
    assert [SLO.met_by(r) for r in results] == [True, False, False, False, True]


def test_summary(results: list[RequestResult]) -> None:
    s = summarize_run(results, SLO)
    assert (s["requests"], s["ok"], s["errors"], s["good_requests"]) == (5, 4, 1, 2)
    assert s["span_s"] == 10.0
    assert s["goodput_rps"] == pytest.approx(0.2)
    assert s["throughput_rps"] == pytest.approx(0.4)
    assert s["slo_attainment"] == pytest.approx(0.4)
    assert s["errors_by_kind"] == {"truncated": 1}
    assert s["ttft_ms"]["n"] == 4
    assert s["ttft_ms"]["p50"] == pytest.approx(125.0)  # 50, 100, 150, 500 -> mid of 100/150
    assert s["ttft_ms"]["max"] == pytest.approx(500.0)
    assert s["cached_prompt_fraction"] == pytest.approx(0.25)  # 50 of 200 reported
    assert s["output_tokens_per_s"] == pytest.approx((3 + 2 + 2 + 1) / 10)
    # event gaps: 40, 40, 20, 950 ms
    assert s["itl_ms"]["n"] == 4 and s["itl_ms"]["max"] == pytest.approx(950.0)
    assert s["send_lag_ms"]["p50"] == pytest.approx(1.0)


def test_windows(results: list[RequestResult]) -> None:
    w = windows(results, SLO, 5.0)
    assert [x["start_s"] for x in w] == [0.0, 5.0]
    assert [x["arrivals"] for x in w] == [2, 3]
    assert [x["good"] for x in w] == [1, 1]
    assert [x["errors"] for x in w] == [0, 1]
    assert w[0]["goodput_rps"] == pytest.approx(0.2)
    assert w[1]["slo_attainment"] == pytest.approx(1 / 3)
    assert [x["throughput_rps"] for x in w] == [pytest.approx(0.4), pytest.approx(0.4)]
    assert w[0]["output_tokens_per_s"] == pytest.approx(5 / 5)
    with pytest.raises(ValueError):
        windows(results, SLO, 0)


def test_stats_and_helpers() -> None:
    assert stats([]) == {"n": 0, "p50": None, "p90": None, "p99": None, "mean": None,
                         "max": None}
    s = stats([1.0, 2.0, 3.0, 4.0])
    assert (s["p50"], s["mean"], s["max"]) == (2.5, 2.5, 4.0)
    assert error_kind("HTTP 400: bad") == "HTTP 400"
    assert error_kind("timeout: no end after 5 s") == "timeout"
    assert error_kind("stream error: boom") == "stream"
    assert clean({"a": [math.nan, 1.23456789], "b": math.inf}) == {"a": [None, 1.2346],
                                                                   "b": None}


def test_markdown_and_plots(results: list[RequestResult], tmp_path: Path) -> None:
    s = clean(summarize_run(results, SLO))
    json.dumps(s, allow_nan=False)
    client = client_stats([0.001, 0.002, 0.25], cpu_s=3.0, wall_s=10.0)
    assert client["loop_stalls_over_100ms"] == 1 and client["cpu_fraction"] == 0.3
    assert client["loop_lag_ms"]["max"] == pytest.approx(250.0)
    page = markdown("t", s, command="python x.py --a", client=client, images=["a.png"])
    assert "attainment 0.400" in page and "goodput 0.20 req/s" in page
    assert "| TTFT | 125.0 |" in page
    assert "1 stalls > 100 ms" in page and page.endswith("![a.png](a.png)\n")
    paths = plot_all(results, windows(results, SLO, 5.0), SLO, tmp_path / "run", "t")
    assert [p.name for p in paths] == ["run_latency_cdf.png", "run_ttft_timeline.png",
                                       "run_goodput.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
