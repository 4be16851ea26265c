"""Reading Mooncake JSONL traces: requests, arrival order, speedup, and errors naming the line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dynagraph.errors import TraceError
from dynagraph.simulate.trace import parse_trace, read_trace


def line(ts: float = 0, n: int = 1000, out: int = 10, ids: list[int] | None = None) -> str:
    return json.dumps({"timestamp": ts, "input_length": n, "output_length": out,
                       "hash_ids": ids if ids is not None else list(range(-(-n // 512)))})


def test_requests_in_arrival_order_numbered_by_line() -> None:
    reqs = parse_trace([line(2000, 600, 5, [0, 1]), "", line(0, 512, 7, [2]),
                        line(2000, 10, 1, [3])])
    assert [(r.index, r.arrival_s) for r in reqs] == [(1, 0.0), (0, 2.0), (2, 2.0)]
    first = reqs[0]
    assert (first.input_length, first.output_length, first.hash_ids) == (512, 7, (2,))


def test_speedup_and_block_size() -> None:
    reqs = parse_trace([line(3000, 100, 1, [0, 1, 2, 3])], block_size=32, speedup=4.0)
    assert reqs[0].arrival_s == 0.75


def test_extra_fields_are_ignored() -> None:
    row = json.loads(line())
    row["session"] = "abc"
    assert len(parse_trace([json.dumps(row)])) == 1


@pytest.mark.parametrize(("bad", "says"), [
    ("{not json", "not a trace request"),
    (json.dumps({"timestamp": 0, "input_length": 10, "hash_ids": [0]}), "output_length"),
    (json.dumps({"timestamp": 0, "input_length": "x", "output_length": 1, "hash_ids": [0]}),
     "not a trace request"),
    (line(0, 1000, 5, [0]), "1 hash_ids for input_length 1000"),
    (line(0, 10, 0, [0]), "output_length must be >= 1"),
    (line(-5, 10, 1, [0]), "negative"),
])
def test_a_bad_line_names_the_file_and_line(tmp_path: Path, bad: str, says: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(line() + "\n" + line() + "\n\n" + bad + "\n" + line() + "\n")
    with pytest.raises(TraceError) as err:
        read_trace(path)
    assert f"{path}, line 4:" in str(err.value)
    assert says in str(err.value)


def test_unreadable_or_empty_trace(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read trace"):
        read_trace(tmp_path / "missing.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceError, match="holds no request"):
        read_trace(tmp_path / "empty.jsonl")
