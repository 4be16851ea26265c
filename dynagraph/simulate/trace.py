"""Reading a request trace in Mooncake's JSONL format.

One JSON object a line: ``timestamp`` (ms since the trace's start), ``input_length``
and ``output_length`` (tokens), ``hash_ids`` (one id per ``block_size``-token block of
the prompt, the last one possibly partial; equal ids at the same place are the same
prefix). Other fields are ignored; blank lines are skipped.

:func:`parse_trace` is pure (lines in, requests out); :func:`read_trace` reads a file.
Both raise ``TraceError`` naming the source and the line number of the first bad line.
Requests come out in arrival order (stable for equal timestamps), numbered by line order.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import msgspec

from dynagraph.errors import TraceError

DEFAULT_TRACE_BLOCK_SIZE = 512
"""Tokens per ``hash_ids`` block in Mooncake's traces."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace. ``index`` is its position in the file (0-based, lines
    that hold a request only); ``arrival_s`` is in seconds from the trace's start."""

    index: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


class _Line(msgspec.Struct):
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


_decoder = msgspec.json.Decoder(_Line)


def parse_trace(lines: Iterable[str | bytes], *, source: str = "<trace>",
                block_size: int = DEFAULT_TRACE_BLOCK_SIZE,
                speedup: float = 1.0) -> list[TraceRequest]:
    """The requests of a trace's lines; arrivals divided by ``speedup``.

    ``block_size`` is the trace's tokens per hash id: every line must have
    ``ceil(input_length / block_size)`` of them.
    """
    if block_size < 1:
        raise TraceError(f"{source}: the block size must be >= 1, got {block_size}")
    if not speedup > 0:
        raise TraceError(f"{source}: the speedup must be > 0, got {speedup}")
    out: list[TraceRequest] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = _decoder.decode(line)
        except msgspec.DecodeError as exc:  # ValidationError included
            raise TraceError(f"{source}, line {number}: not a trace request ({exc}); "
                             "expected timestamp, input_length, output_length, hash_ids"
                             ) from None
        problem = _check(row, block_size)
        if problem is not None:
            raise TraceError(f"{source}, line {number}: {problem}")
        out.append(TraceRequest(len(out), row.timestamp / 1000.0 / speedup, row.input_length,
                                row.output_length, tuple(row.hash_ids)))
    out.sort(key=lambda r: r.arrival_s)
    return out


def _check(row: _Line, block_size: int) -> str | None:
    if row.timestamp < 0:
        return f"timestamp {row.timestamp} is negative"
    if row.input_length < 1:
        return f"input_length must be >= 1, got {row.input_length}"
    if row.output_length < 1:
        return f"output_length must be >= 1, got {row.output_length}"
    need = -(-row.input_length // block_size)
    if len(row.hash_ids) != need:
        return (f"{len(row.hash_ids)} hash_ids for input_length {row.input_length}; blocks of "
                f"{block_size} tokens need {need} (--block-size sets the trace's block size)")
    if any(h < 0 for h in row.hash_ids):
        return "hash_ids must be >= 0"
    return None


def read_trace(path: str | Path, *, block_size: int = DEFAULT_TRACE_BLOCK_SIZE,
               speedup: float = 1.0) -> list[TraceRequest]:
    """:func:`parse_trace` of a file (``TraceError`` if it cannot be read or is empty)."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            requests = parse_trace(f, source=str(p), block_size=block_size, speedup=speedup)
    except OSError as exc:
        raise TraceError(f"cannot read trace {p}: {exc.strerror or exc}") from exc
    if not requests:
        raise TraceError(f"{p}: the trace holds no request")
    return requests
