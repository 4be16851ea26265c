"""Timing profiles: how long an engine step takes, as measured data.

A profile is a JSON file (``profiles/<name>.json`` in this package, or any path) with
two tables measured on real hardware:

- ``prefill.seconds[i][j]``: one forward pass prefilling ``new_tokens[i]`` new tokens of
  one sequence on top of ``cached_tokens[j]`` tokens already in its KV cache;
- ``decode.seconds[i][j]``: one decode step of ``batch_size[i]`` sequences whose
  contexts add up to ``context_tokens[j]`` tokens.

Lookups interpolate bilinearly inside a table and extrapolate linearly outside it
(the edge cell's plane is extended); a result below zero is clamped to zero.

**A step's price** (:meth:`Profile.step_seconds`). vLLM runs one forward pass per
step over every scheduled token: prefill chunks and decodes together (chunked
prefill). The mocker prices a step from its :class:`StepWork`:

- ``P`` = the sum over the step's prefill chunks of ``prefill(n, c)`` (``n`` new tokens
  of one sequence over its ``c`` tokens computed before), less the fixed cost of a pass
  (``overhead``, below) for every chunk after the first: each table entry is a pass of
  its own, the step is one pass. Pricing several chunks as one sequence of their total
  length, as the mocker did first, charged their attention as if each attended to all
  the others: on the tiny model 2048 new tokens cost 233 ms as one sequence, and 57% of
  that is the term that grows with the square of the length, so four chunks of 512 came
  to 233 ms where their own rows add up to about 150 ms. (Without chunks, ``N`` new tokens
  at the token-weighted mean cached context are priced as one sequence.)
- ``D`` = ``decode(B, C)`` for the ``B`` decoding sequences whose contexts (including
  the token computed now) add up to ``C``;
- a step with only one kind costs ``P`` or ``D``; a mixed step costs
  ``P + D - min(overhead, P, D)``: both tables include the fixed cost of one pass
  (scheduling, kernel launches, sampling, reading the weights), and a mixed step
  pays it once. ``overhead`` is the profile's ``step_overhead_seconds`` when set,
  else the cheapest measured decode step (the minimum of ``decode.seconds``).

Profiles made by ``benchmarks/profiling/profile_vllm_cpu.py`` also carry ``mixed``: measured mixed
steps, so the rule above can be checked against the engine it imitates
(``Profile.mixed_errors``).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dynagraph.errors import ConfigError

_STRICT = ConfigDict(extra="forbid", frozen=True)


class ModelShape(BaseModel):
    """The model the profile was measured with (informative; not used for timing)."""

    model_config = _STRICT

    name: str
    hidden_size: int = Field(ge=1)
    num_layers: int = Field(ge=1)
    num_heads: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    dtype: str


def _check_axis(name: str, axis: Sequence[int], minimum: int) -> None:
    if not axis:
        raise ValueError(f"{name} is empty")
    if axis[0] < minimum:
        raise ValueError(f"{name} starts at {axis[0]}; must be >= {minimum}")
    if any(b <= a for a, b in zip(axis, axis[1:], strict=False)):
        raise ValueError(f"{name} must be strictly ascending, got {list(axis)}")


def _check_table(name: str, rows: int, cols: int, seconds: Sequence[Sequence[float]]) -> None:
    if len(seconds) != rows or any(len(row) != cols for row in seconds):
        shape = [len(row) for row in seconds]
        raise ValueError(f"{name}.seconds must be {rows} rows of {cols}, got rows of {shape}")
    for row in seconds:
        for v in row:
            if not math.isfinite(v) or v <= 0:
                raise ValueError(f"{name}.seconds holds {v}; every time must be > 0")


class PrefillTable(BaseModel):
    model_config = _STRICT

    new_tokens: list[int]
    cached_tokens: list[int]
    seconds: list[list[float]]

    @model_validator(mode="after")
    def _shape(self) -> PrefillTable:
        _check_axis("prefill.new_tokens", self.new_tokens, 1)
        _check_axis("prefill.cached_tokens", self.cached_tokens, 0)
        _check_table("prefill", len(self.new_tokens), len(self.cached_tokens), self.seconds)
        return self


class DecodeTable(BaseModel):
    model_config = _STRICT

    batch_size: list[int]
    context_tokens: list[int]
    seconds: list[list[float]]

    @model_validator(mode="after")
    def _shape(self) -> DecodeTable:
        _check_axis("decode.batch_size", self.batch_size, 1)
        _check_axis("decode.context_tokens", self.context_tokens, 1)
        _check_table("decode", len(self.batch_size), len(self.context_tokens), self.seconds)
        return self


class MixedPoint(BaseModel):
    """One measured mixed step: a prefill chunk and a batch of decodes in one pass."""

    model_config = _STRICT

    prefill_new_tokens: int = Field(ge=1)
    prefill_cached_tokens: int = Field(ge=0)
    decode_batch_size: int = Field(ge=1)
    decode_context_tokens: int = Field(ge=1)
    seconds: float = Field(gt=0)


@dataclass(frozen=True, slots=True)
class StepWork:
    """What one engine step computes, as the profile needs it for pricing.

    ``prefill_weighted_cached`` is the sum over prefill chunks of
    ``new_tokens * tokens_computed_before_the_chunk``.
    """

    prefill_tokens: int = 0
    prefill_weighted_cached: int = 0
    decode_seqs: int = 0
    decode_context: int = 0
    prefill_chunks: tuple[tuple[int, int], ...] = ()
    """Per prefill chunk: (new tokens, tokens computed before it); empty: one chunk of
    ``prefill_tokens`` at ``prefill_cached_mean``."""

    @property
    def prefill_cached_mean(self) -> float:
        return self.prefill_weighted_cached / self.prefill_tokens if self.prefill_tokens else 0.0

    @property
    def empty(self) -> bool:
        return self.prefill_tokens == 0 and self.decode_seqs == 0


def _segment(axis: Sequence[int], x: float) -> tuple[int, float]:
    """Index ``i`` of the cell ``axis[i]..axis[i+1]`` used for ``x`` and the position
    ``t`` in it (``t < 0`` or ``t > 1`` extrapolates the edge cell)."""
    n = len(axis)
    if n == 1:
        return 0, 0.0
    i = min(max(bisect_right(axis, x) - 1, 0), n - 2)
    lo, hi = axis[i], axis[i + 1]
    return i, (x - lo) / (hi - lo)


def _bilinear(
    xs: Sequence[int], ys: Sequence[int], table: Sequence[Sequence[float]], x: float, y: float
) -> float:
    i, tx = _segment(xs, x)
    j, ty = _segment(ys, y)
    i1 = i + 1 if len(xs) > 1 else i
    j1 = j + 1 if len(ys) > 1 else j
    v = (
        table[i][j] * (1 - tx) * (1 - ty)
        + table[i1][j] * tx * (1 - ty)
        + table[i][j1] * (1 - tx) * ty
        + table[i1][j1] * tx * ty
    )
    return max(v, 0.0)


class Profile(BaseModel):
    """A timing profile. Build with :func:`load_profile` or ``Profile.model_validate``."""

    model_config = _STRICT

    name: str
    description: str = ""
    hardware: str = ""
    measured_with: str = ""
    model: ModelShape
    block_size: int = Field(ge=1)
    kv_bytes_per_token: int = Field(ge=1)
    """KV cache bytes one token occupies (all layers, K and V): what a transfer moves."""
    prefill: PrefillTable
    decode: DecodeTable
    step_overhead_seconds: float | None = Field(default=None, ge=0)
    """The fixed cost of one forward pass, paid once by a mixed step (see module doc)."""
    mixed: list[MixedPoint] = Field(default_factory=list)
    """Measured mixed steps, to check the pricing rule (optional)."""

    def prefill_seconds(self, new_tokens: float, cached_tokens: float) -> float:
        """One pass prefilling ``new_tokens`` of one sequence over ``cached_tokens``."""
        if new_tokens <= 0:
            return 0.0
        p = self.prefill
        return _bilinear(p.new_tokens, p.cached_tokens, p.seconds, new_tokens, cached_tokens)

    def decode_seconds(self, batch_size: float, context_tokens: float) -> float:
        """One decode step of ``batch_size`` sequences with ``context_tokens`` in total."""
        if batch_size <= 0:
            return 0.0
        d = self.decode
        return _bilinear(d.batch_size, d.context_tokens, d.seconds, batch_size, context_tokens)

    @property
    def overhead_seconds(self) -> float:
        """The per-pass cost a mixed step pays once (see the module docstring)."""
        if self.step_overhead_seconds is not None:
            return self.step_overhead_seconds
        return min(min(row) for row in self.decode.seconds)

    def step_seconds(self, work: StepWork) -> float:
        """The duration of one engine step doing ``work`` (0 for an empty step)."""
        p = self._prefill_pass(work)
        d = self.decode_seconds(work.decode_seqs, work.decode_context)
        if p and d:
            return p + d - min(self.overhead_seconds, p, d)
        return p + d

    def _prefill_pass(self, work: StepWork) -> float:
        """The prefill part of a step: each chunk's own price, one pass's fixed cost."""
        if len(work.prefill_chunks) < 2:
            return self.prefill_seconds(work.prefill_tokens, work.prefill_cached_mean)
        each = [self.prefill_seconds(n, c) for n, c in work.prefill_chunks]
        shared = min(self.overhead_seconds, *each)
        return sum(each) - shared * (len(each) - 1)

    def transfer_bytes(self, num_tokens: int) -> int:
        return num_tokens * self.kv_bytes_per_token

    def mixed_errors(self) -> list[float]:
        """Relative error (predicted / measured - 1) of :meth:`step_seconds` on each
        measured mixed step."""
        out: list[float] = []
        for m in self.mixed:
            work = StepWork(
                prefill_tokens=m.prefill_new_tokens,
                prefill_weighted_cached=m.prefill_new_tokens * m.prefill_cached_tokens,
                decode_seqs=m.decode_batch_size,
                decode_context=m.decode_context_tokens,
            )
            out.append(self.step_seconds(work) / m.seconds - 1.0)
        return out


PROFILES_PACKAGE = "dynagraph.llm.engines.mocker.profiles"


def available_profiles() -> list[str]:
    """Names of the profiles shipped with the package."""
    root = resources.files(PROFILES_PACKAGE)
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".json"))


def load_profile(name_or_path: str | Path) -> Profile:
    """A shipped profile by name (``"cpu-tiny"``) or a profile JSON file by path."""
    text: str
    path = Path(name_or_path)
    if isinstance(name_or_path, Path) or path.suffix == ".json" or path.exists():
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read profile {path}: {exc}", key="profile") from exc
    else:
        entry = resources.files(PROFILES_PACKAGE).joinpath(f"{name_or_path}.json")
        if not entry.is_file():
            raise ConfigError(
                f"unknown profile {name_or_path!r}; shipped: {available_profiles()} "
                "(or give a path to a .json file)",
                key="profile",
            )
        text = entry.read_text()
    try:
        return Profile.model_validate_json(text)
    except ValueError as exc:
        raise ConfigError(f"profile {name_or_path}: {exc}", key="profile") from exc
