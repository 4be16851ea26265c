"""Replay results -> latency percentiles, throughput, goodput and SLO attainment.

Pure functions of :class:`~benchmarks.traces.replay.RequestResult` values (no I/O).

Definitions (all latencies from the time a request was due, see :mod:`.replay`):

- TTFT: first token event - due time. E2E: end of the stream - due time.
- Mean ITL of a request: (last token event - first) / (completion tokens - 1); the
  ``itl_ms`` distribution is the gaps between successive token events of all requests.
- A request is **good** when it succeeded, TTFT <= ``ttft_ms`` and mean ITL <=
  ``itl_ms`` (a one-token request has no ITL and meets that part). Failed requests are
  never good.
- Over the run (``span_s``: from 0, the first due time, to the last request's end):
  throughput = successful requests / span, goodput = good requests / span, SLO
  attainment = good / all requests.
- Per window of ``window_s`` seconds, requests are counted in the window they were
  **due** in (arrival rate, goodput, attainment, TTFT); completions in the window they
  ended in; output tokens in the window their token events arrived in.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks._common import percentile
from benchmarks.traces.replay import RequestResult


@dataclass(frozen=True)
class Slo:
    """Service-level objectives: TTFT and mean ITL bounds in milliseconds."""

    ttft_ms: float
    itl_ms: float

    def met_by(self, r: RequestResult) -> bool:
        if not r.ok or r.ttft_s is None:
            return False
        itl = r.mean_itl_s
        return r.ttft_s * 1000.0 <= self.ttft_ms and (itl is None or itl * 1000.0 <= self.itl_ms)


def stats(values: Sequence[float]) -> dict[str, float | int | None]:
    """n, p50, p90, p99, mean, max of ``values`` (None where there are no values)."""
    if not values:
        return {"n": 0, "p50": None, "p90": None, "p99": None, "mean": None, "max": None}
    return {"n": len(values), "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99), "mean": sum(values) / len(values),
            "max": max(values)}


def error_kind(error: str) -> str:
    """The class of an error message: ``HTTP 400``, ``truncated``, ``timeout`` ..."""
    head = error.split(":", 1)[0]
    return head if head.startswith("HTTP ") else head.split(" ", 1)[0]


def span_s(results: Sequence[RequestResult]) -> float:
    """From 0 (the run start) to the last request's end (or due time, if it never ended)."""
    return max((r.end_s if r.end_s is not None else r.scheduled_s) for r in results)


def _ms(values: Sequence[float | None]) -> list[float]:
    return [v * 1000.0 for v in values if v is not None]


def summarize_run(results: Sequence[RequestResult], slo: Slo) -> dict[str, Any]:
    """Whole-run figures (see the module docstring)."""
    if not results:
        raise ValueError("no results")
    ok = [r for r in results if r.ok]
    good = sum(slo.met_by(r) for r in results)
    span = span_s(results)
    errors = [r.error for r in results if r.error is not None]
    prompt = sum(r.prompt_tokens or 0 for r in ok if r.cached_tokens is not None)
    cached = sum(r.cached_tokens or 0 for r in ok if r.cached_tokens is not None)
    gaps = [b - a for r in ok for a, b in zip(r.token_times, r.token_times[1:], strict=False)]
    return {
        "requests": len(results),
        "ok": len(ok),
        "errors": len(errors),
        "errors_by_kind": dict(Counter(error_kind(e) for e in errors)),
        "first_errors": errors[:5],
        "span_s": span,
        "throughput_rps": len(ok) / span if span > 0 else None,
        "goodput_rps": good / span if span > 0 else None,
        "good_requests": good,
        "slo_attainment": good / len(results),
        "slo": {"ttft_ms": slo.ttft_ms, "itl_ms": slo.itl_ms},
        "input_tokens_per_s": sum(r.input_length for r in ok) / span if span > 0 else None,
        "output_tokens_per_s": sum(r.tokens for r in ok) / span if span > 0 else None,
        "cached_prompt_fraction": cached / prompt if prompt else None,
        "ttft_ms": stats(_ms([r.ttft_s for r in ok])),
        "mean_itl_ms": stats(_ms([r.mean_itl_s for r in ok])),
        "itl_ms": stats(_ms(gaps)),
        "e2e_ms": stats(_ms([r.e2e_s for r in ok])),
        "send_lag_ms": stats(_ms([r.sent_s - r.scheduled_s for r in results
                                  if not math.isnan(r.sent_s)])),
    }


def windows(results: Sequence[RequestResult], slo: Slo, window_s: float
            ) -> list[dict[str, Any]]:
    """Per-window figures from 0 to the end of the run (see the module docstring)."""
    if not window_s > 0:
        raise ValueError(f"window_s must be > 0, got {window_s}")
    if not results:
        return []
    count = max(1, math.ceil(span_s(results) / window_s))

    def slot(t: float) -> int:
        return min(count - 1, max(0, int(t // window_s)))

    due: list[list[RequestResult]] = [[] for _ in range(count)]
    completed = [0] * count
    tokens = [0.0] * count
    for r in results:
        due[slot(r.scheduled_s)].append(r)
        if r.ok and r.end_s is not None:
            completed[slot(r.end_s)] += 1
        if r.ok and r.token_times:
            per_event = r.tokens / len(r.token_times)
            for t in r.token_times:
                tokens[slot(t)] += per_event
    out = []
    for w in range(count):
        rs = due[w]
        good = sum(slo.met_by(r) for r in rs)
        ttft = _ms([r.ttft_s for r in rs if r.ok])
        itl = _ms([r.mean_itl_s for r in rs if r.ok])
        out.append({
            "start_s": w * window_s,
            "arrivals": len(rs),
            "errors": sum(not r.ok for r in rs),
            "good": good,
            "arrival_rps": len(rs) / window_s,
            "goodput_rps": good / window_s,
            "throughput_rps": completed[w] / window_s,
            "output_tokens_per_s": tokens[w] / window_s,
            "slo_attainment": good / len(rs) if rs else None,
            "ttft_p50_ms": percentile(ttft, 50) if ttft else None,
            "ttft_p90_ms": percentile(ttft, 90) if ttft else None,
            "mean_itl_p50_ms": percentile(itl, 50) if itl else None,
        })
    return out


def client_stats(loop_lag_s: Sequence[float], cpu_s: float, wall_s: float) -> dict[str, Any]:
    """How busy and how stalled the replaying client was (see ``ReplayRun.loop_lag_s``)."""
    return {
        "cpu_s": cpu_s,
        "cpu_fraction": cpu_s / wall_s if wall_s > 0 else None,
        "loop_lag_ms": stats(_ms(loop_lag_s)),
        "loop_stalls_over_100ms": sum(v > 0.1 for v in loop_lag_s),
    }


def clean(value: Any) -> Any:
    """``value`` with NaN/inf floats replaced by None (strict JSON), floats rounded."""
    if isinstance(value, float):
        return None if not math.isfinite(value) else round(value, 4)
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [clean(v) for v in value]
    return value


def _f(v: Any, digits: int = 0) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def markdown(title: str, summary: dict[str, Any], *, command: str, notes: Sequence[str] = (),
             client: dict[str, Any] | None = None, images: Sequence[str] = ()) -> str:
    """A short results page: the command, ``notes``, the headline numbers, a percentile
    table, then ``images`` (file names next to the page)."""
    s = summary
    lines = [
        f"# {title}", "",
        "```bash", command, "```", "",
        *notes, *([""] if notes else []),
        f"- requests {s['requests']}, ok {s['ok']}, errors {s['errors']}"
        + (f" {s['errors_by_kind']}" if s["errors"] else "")
        + f"; span {s['span_s']:.1f} s",
        f"- SLO: TTFT <= {s['slo']['ttft_ms']:g} ms and mean ITL <= {s['slo']['itl_ms']:g} ms:"
        f" attainment {s['slo_attainment']:.3f}, goodput {_f(s['goodput_rps'], 2)} req/s"
        f" (throughput {_f(s['throughput_rps'], 2)} req/s)",
        f"- tokens/s: input {_f(s['input_tokens_per_s'])}, output "
        f"{_f(s['output_tokens_per_s'])}; cached prompt fraction "
        f"{_f(s['cached_prompt_fraction'], 3)}",
        f"- client send lag p99 {_f(s['send_lag_ms']['p99'], 1)} ms, max "
        f"{_f(s['send_lag_ms']['max'], 1)} ms"
        + ("" if client is None else
           f"; client event-loop lag p99 {_f(client['loop_lag_ms']['p99'], 1)} ms, max "
           f"{_f(client['loop_lag_ms']['max'], 1)} ms, "
           f"{client['loop_stalls_over_100ms']} stalls > 100 ms; client CPU "
           f"{_f(client['cpu_fraction'], 2)} cores"), "",
        "| ms | p50 | p90 | p99 | mean | max |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for key, name in (("ttft_ms", "TTFT"), ("mean_itl_ms", "mean ITL (per request)"),
                      ("itl_ms", "ITL (event gaps)"), ("e2e_ms", "E2E")):
        d = s[key]
        lines.append(f"| {name} | " + " | ".join(
            _f(d[q], 1) for q in ("p50", "p90", "p99", "mean", "max")) + " |")
    if images:
        lines += ["", *(f"![{name}]({name})" for name in images)]
    return "\n".join(lines) + "\n"
