"""Synthetic Mooncake-format traces: shared system prompts, multi-turn conversations,
bursty arrivals. Seeded and deterministic (stdlib ``random`` only).

The model of a workload:

- ``system-prompts`` system prompts of ``system-prompt-tokens-min..max`` tokens; each
  conversation picks one with Zipf-like popularity (``system-prompt-zipf``), so many
  users share a few prefixes.
- Conversations start by an arrival process (``arrival``): ``poisson`` at ``rate`` per
  second, ``gamma`` interarrivals with mean ``1/rate`` and coefficient of variation
  ``gamma-cv`` (> 1 is burstier than Poisson), or ``onoff``: Poisson at ``burst-rate``
  during bursts and ``rate`` between them, burst and gap lengths exponential with means
  ``burst-on-s`` and ``burst-off-s`` (a Markov-modulated Poisson process; it starts in a
  burst).
- A conversation has a geometric number of turns (mean ``mean-turns``, at most
  ``max-turns``), one request per turn, ``think-time-s`` (exponential mean) apart. Turn
  ``j``'s prompt is the system prompt, all earlier user messages and replies, then the new
  user message, so it extends turn ``j-1``'s prompt. User messages and replies have
  log-normal lengths (median, sigma, clipped). A conversation ends early when a turn's
  prompt plus reply would exceed ``max-context-tokens``.

``hash_ids`` are derived from the content, as a real trace's are from tokens: a block is
identified by its parent block's id and the pieces of content it holds, and ids are
numbered in order of first appearance. So equal ids mean equal prefixes, exactly: turns
of one conversation share every full block of the earlier turn's prompt, conversations
with one system prompt share its full blocks, and a partly filled last block never
matches the fuller block at that position in a later turn.
"""

from __future__ import annotations

import argparse
import math
import random
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from benchmarks.traces.trace import DEFAULT_BLOCK_TOKENS, TraceRecord


def _kebab(name: str) -> str:
    return name.replace("_", "-")


class SynthConfig(BaseModel):
    """Parameters of :func:`generate` (kebab-case aliases, unknown keys rejected)."""

    model_config = ConfigDict(extra="forbid", alias_generator=_kebab, validate_by_name=True,
                              validate_by_alias=True)

    seed: int = 0
    duration_s: float = Field(default=60.0, gt=0)
    max_requests: int | None = Field(default=None, ge=1)
    block_tokens: int = Field(default=DEFAULT_BLOCK_TOKENS, ge=1)

    arrival: Literal["poisson", "gamma", "onoff"] = "onoff"
    rate: float = Field(default=1.0, gt=0)
    gamma_cv: float = Field(default=2.0, gt=0)
    burst_rate: float = Field(default=5.0, gt=0)
    burst_on_s: float = Field(default=4.0, gt=0)
    burst_off_s: float = Field(default=10.0, gt=0)

    system_prompts: int = Field(default=4, ge=1)
    system_prompt_tokens_min: int = Field(default=512, ge=1)
    system_prompt_tokens_max: int = Field(default=1536, ge=1)
    system_prompt_zipf: float = Field(default=1.0, ge=0)

    mean_turns: float = Field(default=3.0, ge=1)
    max_turns: int = Field(default=8, ge=1)
    think_time_s: float = Field(default=5.0, ge=0)
    user_tokens_median: float = Field(default=160.0, gt=0)
    user_tokens_sigma: float = Field(default=0.8, ge=0)
    user_tokens_max: int = Field(default=1024, ge=1)
    output_tokens_median: float = Field(default=64.0, gt=0)
    output_tokens_sigma: float = Field(default=0.6, ge=0)
    output_tokens_min: int = Field(default=4, ge=1)
    output_tokens_max: int = Field(default=256, ge=1)
    max_context_tokens: int = Field(default=3584, ge=2)

    @model_validator(mode="after")
    def _ranges(self) -> SynthConfig:
        if self.system_prompt_tokens_max < self.system_prompt_tokens_min:
            raise ValueError("system-prompt-tokens-max < system-prompt-tokens-min")
        if self.output_tokens_max < self.output_tokens_min:
            raise ValueError("output-tokens-max < output-tokens-min")
        if self.system_prompt_tokens_max + 1 + self.output_tokens_min > self.max_context_tokens:
            raise ValueError("max-context-tokens leaves no room after the longest system "
                             "prompt for a user message and the shortest reply")
        return self


# A piece of content: (kind, owner, turn) identifies it; kind "s" system prompt,
# "u" user message, "a" assistant reply.
SegmentKey = tuple[str, int, int]


@dataclass(frozen=True)
class SynthRequest:
    """A generated request with where it came from (for tests and statistics)."""

    record: TraceRecord
    conversation: int
    turn: int
    system_prompt: int


@dataclass(frozen=True)
class _Draft:
    timestamp_s: float
    conversation: int
    turn: int
    system_prompt: int
    segments: tuple[tuple[SegmentKey, int], ...]  # (key, tokens), in prompt order
    output_length: int


def arrivals(cfg: SynthConfig, rng: random.Random) -> Iterator[float]:
    """Conversation start times in [0, duration_s), ascending."""
    t = 0.0
    if cfg.arrival == "onoff":
        in_burst = True
        switch_at = rng.expovariate(1.0 / cfg.burst_on_s)
        while True:
            rate = cfg.burst_rate if in_burst else cfg.rate
            gap = rng.expovariate(rate)
            if t + gap >= switch_at:
                # Memoryless: restart the draw at the state change with the new rate.
                t = switch_at
                in_burst = not in_burst
                switch_at = t + rng.expovariate(1.0 / (cfg.burst_on_s if in_burst
                                                       else cfg.burst_off_s))
            else:
                t += gap
                if t >= cfg.duration_s:
                    return
                yield t
            if t >= cfg.duration_s:
                return
    while True:
        if cfg.arrival == "poisson":
            t += rng.expovariate(cfg.rate)
        else:
            shape = 1.0 / (cfg.gamma_cv ** 2)
            t += rng.gammavariate(shape, 1.0 / (cfg.rate * shape))
        if t >= cfg.duration_s:
            return
        yield t


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return max(lo, min(hi, round(rng.lognormvariate(math.log(median), sigma))))


def _conversation(cfg: SynthConfig, rng: random.Random, conv: int, start_s: float,
                  system_lengths: Sequence[int], weights: Sequence[float]) -> list[_Draft]:
    sp = rng.choices(range(len(system_lengths)), weights=weights)[0]
    history: list[tuple[SegmentKey, int]] = [(("s", sp, 0), system_lengths[sp])]
    context = system_lengths[sp]
    turns = 1
    while turns < cfg.max_turns and rng.random() >= 1.0 / cfg.mean_turns:
        turns += 1
    drafts: list[_Draft] = []
    t = start_s
    for turn in range(turns):
        user = _lognormal(rng, cfg.user_tokens_median, cfg.user_tokens_sigma, 1,
                          cfg.user_tokens_max)
        out = _lognormal(rng, cfg.output_tokens_median, cfg.output_tokens_sigma,
                         cfg.output_tokens_min, cfg.output_tokens_max)
        if turn == 0:
            # A first turn always fits: the validator left room for one token and the
            # shortest reply after the longest system prompt.
            out = min(out, cfg.max_context_tokens - context - 1)
        room = cfg.max_context_tokens - context - out
        if user > room:
            if turn > 0:
                break
            user = room
        if turn > 0:
            t += rng.expovariate(1.0 / cfg.think_time_s) if cfg.think_time_s > 0 else 0.0
        segments = (*history, (("u", conv, turn), user))
        drafts.append(_Draft(t, conv, turn, sp, segments, out))
        history = [*segments, (("a", conv, turn), out)]
        context += user + out
    return drafts


def _blocks(segments: Sequence[tuple[SegmentKey, int]], input_length: int, block_tokens: int
            ) -> Iterator[tuple[tuple[SegmentKey, int, int], ...]]:
    """The content of each block: (segment, start, end) pieces, the last block partial."""
    pieces: list[tuple[SegmentKey, int, int]] = []
    filled = 0
    for key, length in segments:
        offset = 0
        while offset < length:
            take = min(length - offset, block_tokens - filled)
            pieces.append((key, offset, offset + take))
            offset += take
            filled += take
            if filled == block_tokens:
                yield tuple(pieces)
                pieces, filled = [], 0
    if pieces:
        yield tuple(pieces)
    assert sum(n for _, n in segments) == input_length


def generate(cfg: SynthConfig) -> list[SynthRequest]:
    """The requests of the synthetic trace, in timestamp order (ties: conversation order).

    Timestamps are whole milliseconds; requests at or after ``duration_s`` are dropped,
    then only the first ``max_requests`` are kept.
    """
    rng = random.Random(cfg.seed)
    system_lengths = [rng.randint(cfg.system_prompt_tokens_min, cfg.system_prompt_tokens_max)
                      for _ in range(cfg.system_prompts)]
    weights = [1.0 / (k + 1) ** cfg.system_prompt_zipf for k in range(cfg.system_prompts)]
    drafts = [d for conv, start in enumerate(arrivals(cfg, rng))
              for d in _conversation(cfg, rng, conv, start, system_lengths, weights)]
    drafts = [d for d in drafts if d.timestamp_s < cfg.duration_s]
    drafts.sort(key=lambda d: (round(d.timestamp_s * 1000.0), d.conversation, d.turn))
    if cfg.max_requests is not None:
        drafts = drafts[: cfg.max_requests]
    ids: dict[tuple[int, tuple[tuple[SegmentKey, int, int], ...]], int] = {}
    out: list[SynthRequest] = []
    for d in drafts:
        input_length = sum(n for _, n in d.segments)
        hash_ids: list[int] = []
        parent = -1
        for content in _blocks(d.segments, input_length, cfg.block_tokens):
            parent = ids.setdefault((parent, content), len(ids))
            hash_ids.append(parent)
        record = TraceRecord(timestamp=float(round(d.timestamp_s * 1000.0)),
                             input_length=input_length, output_length=d.output_length,
                             hash_ids=tuple(hash_ids))
        out.append(SynthRequest(record, d.conversation, d.turn, d.system_prompt))
    return out


def generate_trace(cfg: SynthConfig) -> list[TraceRecord]:
    """The records of :func:`generate`."""
    return [r.record for r in generate(cfg)]


# -- command-line options -------------------------------------------------------------------

def add_synth_args(parser: argparse.ArgumentParser, *, prefix: str = "",
                   exclude: frozenset[str] = frozenset()) -> None:
    """One ``--{prefix}{kebab-name}`` option per :class:`SynthConfig` field not in
    ``exclude`` (default: unset, i.e. the model's default); :func:`synth_config_from_args`
    reads them back."""
    group = parser.add_argument_group("synthetic trace (see benchmarks/traces/synth.py)")
    hints = typing.get_type_hints(SynthConfig)
    for name, field in SynthConfig.model_fields.items():
        if name in exclude:
            continue
        choices = typing.get_args(hints[name]) if typing.get_origin(hints[name]) is Literal else None
        group.add_argument(f"--{prefix}{_kebab(name)}", dest=f"synth_{name}", default=None,
                           choices=choices, metavar=None if choices else "X",
                           help=f"default {field.default}")


def synth_config_from_args(args: argparse.Namespace, **fixed: Any) -> SynthConfig:
    """The :class:`SynthConfig` of the options given (strings, validated by pydantic) and
    the ``fixed`` values (for fields the caller excluded from the options)."""
    given: dict[str, Any] = {name: getattr(args, f"synth_{name}")
                             for name in SynthConfig.model_fields
                             if getattr(args, f"synth_{name}", None) is not None}
    return SynthConfig.model_validate({**given, **fixed})
