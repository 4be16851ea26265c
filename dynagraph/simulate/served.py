"""A simulation's served twin: the same trace requests sent to the served graph, and the
numbers of both runs side by side.

What a fidelity check needs besides ``dynamo simulate`` itself, pure (no I/O but
:func:`write_trace`):

- :func:`window` cuts a slice of a trace and starts it at 0;
- :func:`shrink` scales a trace's lengths down (``token_scale`` tokens become one: a
  trace block of 512 tokens becomes one of ``512 // token_scale``, so the prefix sharing
  the trace describes is kept block for block) for a served graph that cannot keep up
  with the real lengths;
- :func:`completion_body` is the ``/v1/completions`` body of a trace request: the very
  prompt token ids the simulation feeds its engines (``prompts.block_tokens``),
  ``max_tokens`` the output length, ``ignore_eos`` and streaming with usage, so the
  served engine runs the same sequence;
- :func:`served_summary` turns per-request results of a served run into the figures of
  the simulator's summary (same percentile rule), and :func:`compare` sets the two side
  by side against targets.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .prompts import block_tokens
from .report import distribution_ms
from .trace import DEFAULT_TRACE_BLOCK_SIZE, TraceRequest


def window(requests: Sequence[TraceRequest], start_s: float, seconds: float
           ) -> list[TraceRequest]:
    """The requests arriving in ``[start_s, start_s + seconds)``, arrivals shifted so the
    window starts at 0, renumbered from 0 in arrival order."""
    got = [r for r in requests if start_s <= r.arrival_s < start_s + seconds]
    return [replace(r, index=i, arrival_s=r.arrival_s - start_s) for i, r in enumerate(got)]


def shrink(requests: Iterable[TraceRequest], *, token_scale: int, output_scale: float = 1.0,
           block_size: int = DEFAULT_TRACE_BLOCK_SIZE) -> list[TraceRequest]:
    """The requests with ``ceil(input / token_scale)`` prompt tokens (same block ids, each
    now ``block_size // token_scale`` tokens) and ``ceil(output / output_scale)`` output
    tokens. ``token_scale`` must divide ``block_size``."""
    if token_scale < 1 or block_size % token_scale:
        raise ValueError(f"token_scale {token_scale} must divide the block size {block_size}")
    if not output_scale > 0:
        raise ValueError(f"output_scale must be > 0, got {output_scale}")
    return [replace(r, input_length=-(-r.input_length // token_scale),
                    output_length=max(1, math.ceil(r.output_length / output_scale)))
            for r in requests]


def write_trace(path: str | Path, requests: Iterable[TraceRequest]) -> None:
    """``requests`` as a Mooncake JSONL trace (``timestamp`` in ms), for ``read_trace``."""
    with Path(path).open("w") as f:
        for r in requests:
            f.write(json.dumps({"timestamp": r.arrival_s * 1000.0, "input_length": r.input_length,
                                "output_length": r.output_length,
                                "hash_ids": list(r.hash_ids)}) + "\n")


def prompt_token_ids(request: TraceRequest, *, trace_block_size: int, vocab_size: int
                     ) -> list[int]:
    """The prompt token ids the simulation gives ``request`` (see ``prompts``)."""
    tokens: list[int] = []
    for h in request.hash_ids:
        tokens += block_tokens(h, trace_block_size, vocab_size)
    return tokens[:request.input_length]


def completion_body(request: TraceRequest, *, model: str, trace_block_size: int,
                    vocab_size: int) -> dict[str, Any]:
    """The streamed ``/v1/completions`` body that runs ``request`` on the served graph."""
    return {"model": model,
            "prompt": prompt_token_ids(request, trace_block_size=trace_block_size,
                                       vocab_size=vocab_size),
            "max_tokens": request.output_length, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


@dataclass(slots=True)
class ServedRequest:
    """What a client saw of one trace request on the served graph (seconds from the
    run's start; ``rejected``: the HTTP status and reason when it was refused)."""

    index: int
    arrival_s: float
    prompt_tokens: int
    sent_s: float | None = None
    first_token_s: float | None = None
    end_s: float | None = None
    cached_tokens: int | None = None
    completion_tokens: int = 0
    rejected: str | None = None
    error: str | None = None

    @property
    def ttft_s(self) -> float | None:
        """From the trace's arrival time (as the simulation counts it) to the first token."""
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s


def served_summary(results: Sequence[ServedRequest]) -> dict[str, Any]:
    """The simulator's summary figures (``report.summarize``) for a served run."""
    done = [r for r in results if r.end_s is not None and r.error is None]
    admitted = [r for r in results if r.rejected is None]
    ttfts = [t for r in done if (t := r.ttft_s) is not None]
    late = [r.sent_s - r.arrival_s for r in results if r.sent_s is not None]
    prompt = sum(r.prompt_tokens for r in admitted)
    cached = sum(r.cached_tokens or 0 for r in admitted)
    return {
        "requests": len(results), "completed": len(done),
        "rejected": sum(1 for r in results if r.rejected is not None),
        "errors": sum(1 for r in results if r.error is not None),
        "first_error": next((r.error for r in results if r.error), None),
        "ttft_ms": distribution_ms(ttfts),
        "prompt_tokens": prompt, "cached_prompt_tokens": cached,
        "cache_hit_rate": round(cached / prompt, 6) if prompt else None,
        "send_late_ms": distribution_ms(late),
    }


TARGETS = {"ttft_p50": 0.15, "ttft_p90": 0.15, "cached_prompt_tokens": 0.05}
"""Issue 49's bounds: served within this fraction of simulated."""


def compare(simulated: dict[str, Any], served: dict[str, Any],
            targets: dict[str, float] | None = None) -> list[dict[str, Any]]:
    """One row per metric: simulated, served, ratio (served / simulated), target (the
    largest ``|ratio - 1|`` allowed) and ``ok``. Both sides are summaries (the
    simulator's or :func:`served_summary`'s)."""
    targets = TARGETS if targets is None else targets
    values = {
        "ttft_p50": (simulated["ttft_ms"]["p50"], served["ttft_ms"]["p50"]),
        "ttft_p90": (simulated["ttft_ms"]["p90"], served["ttft_ms"]["p90"]),
        "cached_prompt_tokens": (simulated["cached_prompt_tokens"],
                                 served["cached_prompt_tokens"]),
    }
    rows = []
    for metric, bound in targets.items():
        sim, srv = values[metric]
        ratio = srv / sim if sim else math.nan
        rows.append({"metric": metric, "simulated": sim, "served": srv,
                     "ratio": round(ratio, 4), "target": bound,
                     "ok": bool(abs(ratio - 1.0) <= bound)})
    return rows
