"""Trace records: parsing, errors naming file/line/field, save/load, scaling, statistics."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.traces.trace import (
    TraceError,
    TraceRecord,
    dump_lines,
    load_trace,
    parse_line,
    save_trace,
    scale,
    trace_stats,
)


def rec(ts: float, n_in: int = 10, n_out: int = 5, ids: tuple[int, ...] = (0,)) -> TraceRecord:
    return TraceRecord(timestamp=ts, input_length=n_in, output_length=n_out, hash_ids=ids)


def test_parse_mooncake_line() -> None:
    r = parse_line('{"timestamp": 3000, "input_length": 1030, "output_length": 7, '
                   '"hash_ids": [0, 14, 15], "extra": "ignored"}')
    assert r == TraceRecord(3000.0, 1030, 7, (0, 14, 15))


@pytest.mark.parametrize(("line", "field", "fragment"), [
    ('{"timestamp": 0, "input_length": 10, "output_length": 5}', "hash_ids", "missing"),
    ('{"timestamp": 0, "input_length": "10", "output_length": 5, "hash_ids": [0]}',
     "input_length", "Expected `int`"),
    ('{"timestamp": -1, "input_length": 10, "output_length": 5, "hash_ids": [0]}',
     "timestamp", ">= 0"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 0, "hash_ids": [0]}',
     "output_length", ">= 1"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [-3]}',
     "hash_ids", ">= 0"),
    ('{"timestamp": 0, "input_length": 1025, "output_length": 5, "hash_ids": [0, 1]}',
     "hash_ids", "expected ceil(1025 / 512) = 3"),
])
def test_parse_errors_name_the_field(line: str, field: str, fragment: str) -> None:
    with pytest.raises(TraceError) as info:
        parse_line(line, path="t.jsonl", line=7)
    err = info.value
    assert (err.path, err.line, err.field) == ("t.jsonl", 7, field)
    assert fragment in str(err)
    assert str(err).startswith(f"t.jsonl:7: field '{field}': ")


def test_parse_error_not_json() -> None:
    with pytest.raises(TraceError) as info:
        parse_line("{not json", path="t.jsonl", line=2)
    assert info.value.field is None and str(info.value).startswith("t.jsonl:2: not a JSON")


def test_block_tokens_changes_the_expected_count() -> None:
    line = '{"timestamp": 0, "input_length": 100, "output_length": 5, "hash_ids": [0, 1, 2, 3]}'
    assert parse_line(line, block_tokens=32).hash_ids == (0, 1, 2, 3)
    with pytest.raises(TraceError, match="expected ceil"):
        parse_line(line)


def test_load_reports_file_line_with_blank_lines(tmp_path: Path) -> None:
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [0]}\n'
                 "\n"
                 '{"timestamp": 5, "input_length": 10, "output_length": 5, "hash_ids": [0, 1]}\n')
    with pytest.raises(TraceError) as info:
        load_trace(p)
    assert (info.value.path, info.value.line, info.value.field) == (str(p), 3, "hash_ids")


def test_load_empty_file_is_an_error(tmp_path: Path) -> None:
    p = tmp_path / "empty.jsonl"
    p.write_text("\n\n")
    with pytest.raises(TraceError, match="no records"):
        load_trace(p)


def test_save_load_roundtrip(tmp_path: Path) -> None:
    records = [rec(0.0, 600, 3, (0, 1)), rec(12.5, 10, 1, (2,))]
    path = save_trace(tmp_path / "sub" / "t.jsonl", records)
    assert load_trace(path) == records
    first = path.read_text().splitlines()[0]
    assert first == '{"timestamp":0,"input_length":600,"output_length":3,"hash_ids":[0,1]}'
    assert dump_lines(records).count("\n") == 2


def test_scale_speed_window_and_limit() -> None:
    records = [rec(3000), rec(1000), rec(2000), rec(5000), rec(4000)]
    assert [r.timestamp for r in scale(records)] == [0, 1000, 2000, 3000, 4000]
    assert [r.timestamp for r in scale(records, speed=2.0)] == [0, 500, 1000, 1500, 2000]
    win = scale(records, start_ms=1500, end_ms=4000)
    assert [r.timestamp for r in win] == [500, 1500]  # 2000 and 3000, from 1500
    assert [r.timestamp for r in scale(records, max_requests=2, speed=4)] == [0, 250]
    assert scale(records, start_ms=9000) == []


@pytest.mark.parametrize("kwargs", [{"speed": 0}, {"speed": -1}, {"max_requests": 0},
                                    {"start_ms": 5, "end_ms": 5}])
def test_scale_rejects_bad_arguments(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        scale([rec(0)], **kwargs)  # type: ignore[arg-type]  # mixed kwargs on purpose


def test_trace_stats_exact() -> None:
    records = [rec(0, 1500, 10, (0, 1, 2)), rec(500, 1100, 20, (0, 1, 3)),
               rec(1000, 100, 30, (4,)), rec(2000, 600, 40, (0, 5))]
    s = trace_stats(records, peak_window_s=1.0)
    assert s.requests == 4 and s.duration_s == 2.0 and s.mean_rate_rps == 2.0
    assert s.peak_rate_rps == 2.0  # two arrivals in [0, 1) s
    # blocks 3 + 3 + 1 + 2 = 9; hits: 0,1 (2nd request), 0 (4th) = 3
    assert s.cache_hit_rate == pytest.approx(3 / 9)
    # hit tokens 512 + 512 + 512 of 1500 + 1100 + 100 + 600 input tokens
    assert s.cache_hit_rate_tokens == pytest.approx(1536 / 3300)
    assert s.distinct_blocks == 6
    assert s.input_tokens_max == 1500 and s.output_tokens_mean == 25.0


def test_trace_stats_prefix_not_just_id() -> None:
    # id 1 after a different parent is not a hit: reuse needs the whole prefix.
    s = trace_stats([rec(0, 1024, 1, (0, 1)), rec(1, 1024, 1, (2, 1))])
    assert s.cache_hit_rate == 0.0
