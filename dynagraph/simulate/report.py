"""The numbers of a simulation: its summary, its per-request lines and its time series.

Pure: a :class:`~.fleet.SimResult` in, plain JSON-able values out (the files and plots
are ``output.py``'s). Definitions callers may rely on:

- percentiles interpolate linearly between the two nearest values (numpy's default);
- ``ttft_ms``: arrival to first token; ``itl_ms``: a request's mean time between two of
  its output tokens (requests with one output token have none); both over completed
  requests;
- ``prompt_tokens`` / ``cached_prompt_tokens``: over admitted requests, the latter being
  the prompt tokens found in the engine's prefix cache at admission;
- ``goodput_rps``: completed requests that meet every SLO given (TTFT and mean ITL; one
  not given is not checked) per simulated second; ``simulated_s`` runs from 0 to the
  last arrival or end;
- ``worker_seconds``: the sum over workers of simulated seconds alive (the fleet is
  fixed: workers x ``simulated_s``).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from .fleet import RequestRecord, SimResult


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ascending values (NaN when there are none)."""
    n = len(sorted_values)
    if n == 0:
        return math.nan
    pos = (n - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def distribution_ms(values_s: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 and max of values in seconds, in milliseconds (None: no value)."""
    if not values_s:
        return {"mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    v = sorted(values_s)
    return {"mean": round(1000 * sum(v) / len(v), 3),
            **{f"p{q}": round(1000 * percentile(v, q), 3) for q in (50, 90, 99)},
            "max": round(1000 * v[-1], 3)}


def _kind(why: str) -> str:
    if "context" in why:
        return "context"
    return "queue-timeout" if "queue-timeout" in why else "queue-full"


def meets_slo(rec: RequestRecord, ttft_ms: float | None, itl_ms: float | None) -> bool:
    ttft, itl = rec.ttft_s, rec.itl_s
    if not rec.completed or ttft is None:
        return False
    if ttft_ms is not None and ttft * 1000 > ttft_ms:
        return False
    return itl_ms is None or itl is None or itl * 1000 <= itl_ms


def summarize(result: SimResult, *, slo_ttft_ms: float | None = None,
              slo_itl_ms: float | None = None) -> dict[str, Any]:
    """The summary (see the module docstring); ``wall_s`` is the run's own."""
    recs = result.records
    done = [r for r in recs if r.completed]
    admitted = [r for r in recs if r.rejected is None]
    ttfts = [t for r in done if (t := r.ttft_s) is not None]
    itls = [t for r in done if (t := r.itl_s) is not None]
    prompt = sum(r.prompt_tokens for r in admitted)
    cached = sum(r.cached_tokens for r in admitted)
    span = result.span_s
    good = sum(1 for r in done if meets_slo(r, slo_ttft_ms, slo_itl_ms))
    return {
        "requests": len(recs),
        "completed": len(done),
        "rejected": sum(1 for r in recs if r.rejected is not None),
        "rejected_by": dict(Counter(_kind(r.rejected) for r in recs if r.rejected is not None)),
        "unfinished": len(admitted) - len(done),
        "mode": result.mode,
        "workers": result.engines,
        "ttft_ms": distribution_ms(ttfts),
        "itl_ms": distribution_ms(itls),
        "prompt_tokens": prompt,
        "cached_prompt_tokens": cached,
        "cache_hit_rate": round(cached / prompt, 6) if prompt else None,
        "output_tokens": sum(r.output_tokens for r in done),
        "preemptions": sum(r.preemptions for r in recs),
        "slo": {"ttft_ms": slo_ttft_ms, "itl_ms": slo_itl_ms, "met": good},
        "goodput_rps": round(good / span, 6) if span > 0 else None,
        "throughput_rps": round(len(done) / span, 6) if span > 0 else None,
        "simulated_s": round(span, 6),
        "worker_seconds": round(result.engines * span, 6),
        "busy_fraction": round(result.busy_seconds / (result.engines * span), 6)
        if span > 0 else None,
        "engine_steps": result.steps,
        "wall_s": round(result.wall_s, 3),
        "cpu_s": round(result.cpu_s, 3),
    }


def request_line(rec: RequestRecord) -> dict[str, Any]:
    """One line of ``requests.jsonl`` (times in seconds from the start, latencies in ms)."""
    ttft, itl = rec.ttft_s, rec.itl_s
    return {
        "index": rec.index,
        "arrival_s": round(rec.arrival_s, 6),
        "worker": rec.worker,
        "prompt_tokens": rec.prompt_tokens,
        "cached_tokens": rec.cached_tokens,
        "output_tokens": rec.output_tokens,
        "ttft_ms": None if ttft is None else round(ttft * 1000, 3),
        "itl_ms": None if itl is None else round(itl * 1000, 3),
        "end_s": None if rec.end_s is None else round(rec.end_s, 6),
        "preemptions": rec.preemptions,
        "rejected": rec.rejected,
    }


def hit_rate_series(records: Sequence[RequestRecord], bin_s: float
                    ) -> list[tuple[float, float]]:
    """(bin start, cached / prompt tokens of the requests admitted in it), for every bin
    of ``bin_s`` seconds with an admitted request."""
    sums: dict[int, list[int]] = {}
    for r in records:
        if r.rejected is None and r.prompt_tokens:
            acc = sums.setdefault(int(r.arrival_s // bin_s), [0, 0])
            acc[0] += r.cached_tokens
            acc[1] += r.prompt_tokens
    return [(b * bin_s, c / p) for b, (c, p) in sorted(sums.items())]
