"""Mooncake-format request traces: the record type, JSONL load/save, scaling, statistics.

One JSON object per line (the format of the FAST'25 Mooncake traces)::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2]}

- ``timestamp``: arrival time in milliseconds since the trace began (int or float, >= 0;
  several requests may share one).
- ``input_length`` / ``output_length``: prompt and completion length in tokens (>= 1).
- ``hash_ids``: one id per ``block_tokens``-token block of the prompt (512 in Mooncake's
  traces), the last block possibly partial, so ``len(hash_ids) == ceil(input_length /
  block_tokens)``. Equal leading ids mean equal prompt prefixes: two requests whose
  ``hash_ids`` start with ``[0, 7]`` share their first ``2 * block_tokens`` tokens.

Fields beyond these four are ignored (other producers add some). Every problem is
reported as :class:`TraceError` naming the file, the line and the field.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import msgspec

DEFAULT_BLOCK_TOKENS = 512

NonNegative = Annotated[float, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]
HashId = Annotated[int, msgspec.Meta(ge=0)]


class TraceRecord(msgspec.Struct, frozen=True):
    """One request of a trace (see the module docstring for the fields' meaning)."""

    timestamp: NonNegative
    input_length: Positive
    output_length: Positive
    hash_ids: tuple[HashId, ...]

    def to_json(self) -> dict[str, Any]:
        """The record as Mooncake writes it (an integral timestamp as an int)."""
        ts: float | int = int(self.timestamp) if self.timestamp.is_integer() else self.timestamp
        return {"timestamp": ts, "input_length": self.input_length,
                "output_length": self.output_length, "hash_ids": list(self.hash_ids)}


class TraceError(ValueError):
    """A trace line that cannot be used: ``path:line: field 'name': what is wrong``."""

    def __init__(self, path: str, line: int, field: str | None, message: str) -> None:
        self.path, self.line, self.field, self.message = path, line, field, message
        where = f"{path}:{line}"
        super().__init__(f"{where}: field '{field}': {message}" if field else f"{where}: {message}")


_decoder = msgspec.json.Decoder(TraceRecord)
_FIELD_AT = re.compile(r" - at `\$\.(\w+)(?:\[\d+\])?`$")
_MISSING = re.compile(r"missing required field `(\w+)`")


def expected_blocks(input_length: int, block_tokens: int) -> int:
    """How many hash ids a prompt of ``input_length`` tokens has."""
    return math.ceil(input_length / block_tokens)


def parse_line(text: str | bytes, *, path: str = "<trace>", line: int = 1,
               block_tokens: int = DEFAULT_BLOCK_TOKENS) -> TraceRecord:
    """Decode and check one JSONL line; raises :class:`TraceError`."""
    try:
        record = _decoder.decode(text)
    except msgspec.ValidationError as exc:
        msg = str(exc)
        if m := _FIELD_AT.search(msg):
            raise TraceError(path, line, m.group(1), msg[: m.start()]) from None
        if m := _MISSING.search(msg):
            raise TraceError(path, line, m.group(1), "missing") from None
        raise TraceError(path, line, None, msg) from None
    except msgspec.DecodeError as exc:
        raise TraceError(path, line, None, f"not a JSON object: {exc}") from None
    want = expected_blocks(record.input_length, block_tokens)
    if len(record.hash_ids) != want:
        raise TraceError(
            path, line, "hash_ids",
            f"{len(record.hash_ids)} ids for input_length {record.input_length}; expected "
            f"ceil({record.input_length} / {block_tokens}) = {want} (is the block size "
            f"{block_tokens}? see --block-tokens)")
    return record


def load_trace(path: str | Path, *, block_tokens: int = DEFAULT_BLOCK_TOKENS
               ) -> list[TraceRecord]:
    """All records of a JSONL trace file, in file order (blank lines are skipped)."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    p = Path(path)
    records: list[TraceRecord] = []
    with p.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if raw.strip():
                records.append(parse_line(raw, path=str(p), line=number,
                                          block_tokens=block_tokens))
    if not records:
        raise TraceError(str(p), 0, None, "the trace has no records")
    return records


def dump_lines(records: Iterable[TraceRecord]) -> str:
    """The JSONL text of ``records`` (one compact object per line)."""
    enc = msgspec.json.Encoder()
    return "".join(enc.encode(r.to_json()).decode() + "\n" for r in records)


def save_trace(path: str | Path, records: Iterable[TraceRecord]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(dump_lines(records))
    return p


def scale(records: Sequence[TraceRecord], *, speed: float = 1.0,
          start_ms: float | None = None, end_ms: float | None = None,
          max_requests: int | None = None) -> list[TraceRecord]:
    """The records to replay, sorted by timestamp (stable), times rebased and scaled.

    Keeps records with ``start_ms <= timestamp < end_ms`` (trace time), then the first
    ``max_requests`` of them, shifts their timestamps so the window starts at 0 (at
    ``start_ms`` when given, else at the first kept record), and divides them by
    ``speed`` (2.0 replays twice as fast: half the gaps, twice the arrival rate).
    """
    if not speed > 0:
        raise ValueError(f"speed must be > 0, got {speed}")
    if max_requests is not None and max_requests < 1:
        raise ValueError(f"max_requests must be >= 1, got {max_requests}")
    if start_ms is not None and end_ms is not None and end_ms <= start_ms:
        raise ValueError(f"the window [{start_ms}, {end_ms}) ms is empty")
    kept = sorted((r for r in records
                   if (start_ms is None or r.timestamp >= start_ms)
                   and (end_ms is None or r.timestamp < end_ms)),
                  key=lambda r: r.timestamp)
    if max_requests is not None:
        kept = kept[:max_requests]
    if not kept:
        return []
    origin = start_ms if start_ms is not None else kept[0].timestamp
    return [msgspec.structs.replace(r, timestamp=(r.timestamp - origin) / speed) for r in kept]


@dataclass(frozen=True)
class TraceStats:
    """Shape of a trace: size, timing, lengths and the prefix reuse an infinite cache sees.

    ``cache_hit_rate`` is the fraction of prompt blocks whose hash id (with all ids before
    it, i.e. the whole prefix) appeared in an earlier request: the prefix-cache hit rate of
    an unbounded cache, in blocks. ``cache_hit_rate_tokens`` weighs each block by its
    tokens (a partial last block counts less), comparable to a server's cached prompt
    tokens / prompt tokens.
    """

    requests: int
    duration_s: float
    mean_rate_rps: float
    peak_rate_rps: float
    input_tokens_mean: float
    input_tokens_max: int
    output_tokens_mean: float
    output_tokens_max: int
    distinct_blocks: int
    cache_hit_rate: float
    cache_hit_rate_tokens: float

    def as_dict(self) -> dict[str, float | int]:
        return dict(self.__dict__)


def trace_stats(records: Sequence[TraceRecord], *, peak_window_s: float = 1.0,
                block_tokens: int = DEFAULT_BLOCK_TOKENS) -> TraceStats:
    """:class:`TraceStats` of ``records`` (in timestamp order, as :func:`scale` returns)."""
    if not records:
        raise ValueError("no records")
    ordered = sorted(records, key=lambda r: r.timestamp)
    duration = (ordered[-1].timestamp - ordered[0].timestamp) / 1000.0
    counts: dict[int, int] = {}
    for r in ordered:
        w = int((r.timestamp - ordered[0].timestamp) / 1000.0 // peak_window_s)
        counts[w] = counts.get(w, 0) + 1
    # A prefix trie as a dict: (parent node, hash id) -> node.
    trie: dict[tuple[int, int], int] = {}
    hits = blocks = hit_tokens = 0
    for r in ordered:
        node = -1
        for i, h in enumerate(r.hash_ids):
            blocks += 1
            child = trie.get((node, h))
            if child is None:
                child = trie[(node, h)] = len(trie)
            else:
                hits += 1
                hit_tokens += min(block_tokens, r.input_length - i * block_tokens)
            node = child
    n = len(ordered)
    return TraceStats(
        requests=n,
        duration_s=duration,
        mean_rate_rps=n / duration if duration > 0 else math.inf,
        peak_rate_rps=max(counts.values()) / peak_window_s,
        input_tokens_mean=sum(r.input_length for r in ordered) / n,
        input_tokens_max=max(r.input_length for r in ordered),
        output_tokens_mean=sum(r.output_length for r in ordered) / n,
        output_tokens_max=max(r.output_length for r in ordered),
        distinct_blocks=len({h for r in ordered for h in r.hash_ids}),
        cache_hit_rate=hits / blocks if blocks else 0.0,
        cache_hit_rate_tokens=hit_tokens / sum(r.input_length for r in ordered),
    )
