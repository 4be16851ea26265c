"""Greedy texts made along numerically different paths, compared up to a near tie.

The tiny model runs in bfloat16, so its logits are multiples of 1/16 or 1/32 at their
scale: the two best tokens tie outright at about one step in 75, and are within 0.1 nats
of each other at one in 15 (seven 64-token answers of the agg graph, 448 steps). Greedy
decoding is only defined up to those ties. Two correct runs of one prompt along paths
that round differently (a migrated request recomputing its KV on another worker, expert
partial sums added across FfnWorkers, vLLM's top-k sampler against its argmax) may part
at such a step and then go on differently, and did: a CI machine whose model was trained
in float32 instead of bfloat16 failed four exact comparisons that had passed for weeks.

So a reference run records, for every token, where it starts in the text and how far the
best token's logprob is ahead of the runner-up (a completion requested with
``logprobs``; the starts come from aligning the tokens with the text, not from
``text_offset``, which counts special tokens the text leaves out); another run's text agrees with it when it is the same, or when the first
character where they differ lies in a token whose margin (or, at a token's first
character, the previous token's) is at most ``NEAR_TIE`` nats. A run that parts where
the reference was sure of its token fails, with the place and the margin in the message.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

NEAR_TIE = 0.25  # nats: four bfloat16 steps of a logit between 8 and 16
TOP_LOGPROBS = 5  # what a reference asks for (the runner-up must be among them)


@dataclass(frozen=True)
class Greedy:
    """A reference greedy text with each token's start and its lead over the runner-up."""

    text: str
    offsets: tuple[int, ...]
    margins: tuple[float, ...]

    @classmethod
    def of(cls, choice: Mapping[str, Any]) -> Greedy:
        """From a ``/v1/completions`` choice (a dict) requested with ``logprobs``."""
        lp = choice.get("logprobs")
        if not lp or lp.get("top_logprobs") is None:
            raise ValueError("the reference completion was not requested with logprobs")
        return cls.of_parts(str(choice["text"]), lp["tokens"], lp["top_logprobs"])

    @classmethod
    def of_parts(cls, text: str, tokens: Sequence[str],
                 top_logprobs: Sequence[Mapping[str, float] | None]) -> Greedy:
        if len(tokens) != len(top_logprobs):
            raise ValueError(f"{len(tokens)} tokens with {len(top_logprobs)} top logprobs")
        return cls(text, _offsets(text, tokens), tuple(_margin(t) for t in top_logprobs))

    def parting(self, other: str, near_tie: float = NEAR_TIE) -> str | None:
        """None when ``other`` agrees with this reference; else where and why it does not."""
        if other == self.text:
            return None
        at = _common_prefix(self.text, other)
        if not self.offsets:
            return f"the reference has no tokens, the other text is {other!r}"
        i = max(0, bisect.bisect_right(self.offsets, at) - 1)
        suspects = [i - 1, i] if i > 0 and self.offsets[i] == at else [i]
        margin = min(self.margins[j] for j in suspects)
        if margin <= near_tie:
            return None
        return (f"parts from the reference at character {at} (token {i}), where the reference "
                f"led by {margin:.3f} nats (> {near_tie}): "
                f"{self.text[max(0, at - 30):at]!r} + {self.text[at:at + 30]!r} "
                f"vs {other[at:at + 30]!r}")

    def agrees(self, other: str, near_tie: float = NEAR_TIE) -> bool:
        return self.parting(other, near_tie) is None


def _offsets(text: str, tokens: Sequence[str]) -> tuple[int, ...]:
    """Where each token starts in ``text``. A token the text leaves out (a special token,
    a fragment of a UTF-8 character) starts where the next one does; the next token found
    within a few characters picks the alignment up again."""
    out: list[int] = []
    at = 0
    for token in tokens:
        found = text.find(token, at, at + len(token) + _RESYNC) if token else -1
        if found >= 0:
            at = found
        out.append(at)
        if found >= 0:
            at += len(token)
    return tuple(out)


_RESYNC = 3  # characters a token may start after the previous one's end (split characters)


def _margin(top: Mapping[str, float] | None) -> float:
    """The best logprob's lead over the runner-up (infinite with one candidate)."""
    values = sorted((top or {}).values(), reverse=True)
    return values[0] - values[1] if len(values) > 1 else float("inf")


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((k for k in range(n) if a[k] != b[k]), n)


def assert_agrees(reference: Greedy, other: str, what: str = "") -> None:
    why = reference.parting(other)
    assert why is None, f"{what}: {why}" if what else why
