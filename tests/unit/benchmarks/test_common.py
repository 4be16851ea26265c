"""Pure helpers of the benchmark scripts: percentiles, SSE parsing, stream statistics."""

from __future__ import annotations

import math

import pytest

from benchmarks._common import (
    SseLineParser,
    StreamResult,
    chunk_text,
    percentile,
    stream_stats,
    summarize,
)
from benchmarks.serve_lifecycle import parse_importtime


def test_percentile_interpolates() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0, 1.0, 3.0], 0) == 1.0
    assert percentile([5.0, 1.0, 3.0], 100) == 5.0
    assert percentile([7.0], 99) == 7.0
    assert percentile(list(range(101)), 99) == 99.0


def test_percentile_empty_and_bad_q() -> None:
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summarize() -> None:
    s = summarize([1.0, 2.0, 3.0])
    assert s["n"] == 3 and s["p50"] == 2.0 and s["mean"] == 2.0 and s["max"] == 3.0


def test_sse_parser_splits_across_reads() -> None:
    p = SseLineParser()
    assert p.feed(b'data: {"a"') == []
    assert p.feed(b': 1}\n\ndata: [DO') == [b'{"a": 1}']
    assert p.feed(b"NE]\n\n") == [b"[DONE]"]


def test_sse_parser_crlf_comments_and_multiline() -> None:
    p = SseLineParser()
    out = p.feed(b": keep-alive\r\n\r\ndata:x\r\ndata: y\r\n\r\nevent: e\ndata: z\n\n")
    assert out == [b"x\ny", b"z"]


def test_chunk_text_completion_chat_and_usage_only() -> None:
    assert chunk_text({"choices": [{"text": "hi"}]}) == "hi"
    assert chunk_text({"choices": [{"delta": {"content": "yo"}}]}) == "yo"
    assert chunk_text({"choices": [{"delta": {"role": "assistant"}}]}) == ""
    assert chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) is None


def test_stream_stats() -> None:
    a = StreamResult(start=0.0, chunk_times=[0.010, 0.012, 0.016], completion_tokens=3)
    b = StreamResult(start=0.0, chunk_times=[0.020, 0.020, 0.030], completion_tokens=3)
    bad = StreamResult(start=0.0, error="HTTP 500")
    s = stream_stats([a, b, bad], wall_s=0.5)
    assert s["requests"] == 3 and s["errors"] == 1 and s["first_error"] == "HTTP 500"
    assert s["output_tokens"] == 6 and s["output_tokens_per_s"] == pytest.approx(12.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(15.0)
    assert s["itl_ms"]["n"] == 4 and s["itl_ms"]["p50"] == pytest.approx(3.0)
    assert s["tpot_ms"]["p50"] == pytest.approx(4.0)  # 3 ms and 5 ms per token


def test_parse_importtime_keeps_outermost_imports() -> None:
    text = "\n".join([
        "import time: self [us] | cumulative | imported package",
        "import time:       100 |        200 |     encodings.utf_8",
        "import time:       300 |       3000 | site",
        "import time:       900 |       4000 |   pydantic",
        "import time:      1000 |       5000 | dynagraph.sdk",
        "import time:       500 |       1500 | dynagraph.cli",
    ])
    assert parse_importtime(text) == [("dynagraph", 6.5), ("site", 3.0)]
