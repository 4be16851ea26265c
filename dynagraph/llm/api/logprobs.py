"""Logprobs in OpenAI's shapes, with token text exactly as vLLM's OpenAI server gives it.

The engine sends ids and logprobs only (``LLMEngineOutput.logprobs``: per position the
sampled id first, then the top alternatives in rank order). The Processor turns them
into text here, the way vLLM's output processor does:

* a token's text is ``decode([id])`` with special tokens kept; for a Metaspace
  (SentencePiece) tokenizer the leading spaces ``decode`` strips are restored;
* a text ending in U+FFFD (a byte-fallback piece of a multi-byte character) is
  re-derived from up to 4 preceding sampled tokens: the characters the token completes,
  or ``""`` while the character is still incomplete;
* alternatives at one position are deduplicated by id keeping the first position of an
  id (a dict, as vLLM builds it), logprobs are clamped at -9999.0, and ``bytes`` is
  the UTF-8 of that text.

Chat's ``top_logprobs`` lists the first ``top_logprobs`` entries of that dict (the
sampled token first); completions' ``top_logprobs`` maps text to logprob for the first
``logprobs + 1`` entries. Pure: only the tokenizer is touched.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import tokenizers

FLOOR = -9999.0
_CONTEXT = 4
_FFFD = "\ufffd"

Position = tuple[Sequence[int], Sequence[float]]


class TokenTexts:
    """Per-token text for logprobs. One per tokenizer; caches single-token decodes."""

    def __init__(self, backend: tokenizers.Tokenizer) -> None:
        self._backend = backend
        self._cache: dict[int, str] = {}
        self._marker = _space_marker(backend)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._backend.decode(list(ids), skip_special_tokens=False))

    def raw(self, token_id: int) -> str:
        """``decode([token_id])`` (special tokens kept, leading spaces restored)."""
        text = self._cache.get(token_id)
        if text is None:
            text = self.decode([token_id])
            if self._marker is not None:
                piece = self._backend.id_to_token(token_id) or ""
                text = _restore_leading_spaces(piece, text, self._marker)
            self._cache[token_id] = text
        return text

    def text(self, token_id: int, context: Sequence[int]) -> str:
        """The token's text after ``context`` (the preceding sampled ids, oldest first)."""
        text = self.raw(token_id)
        if text.endswith(_FFFD):
            return self._complete(token_id, list(context[-_CONTEXT:]))
        return text

    def _complete(self, token_id: int, context: list[int]) -> str:
        for n in range(1, len(context) + 1):
            ctx = context[-n:]
            full = self.decode([*ctx, token_id])
            if full.endswith(_FFFD):
                continue
            clean_end = len(ctx)
            for j in range(len(ctx) - 1, -1, -1):
                if self.decode([ctx[j]]).endswith(_FFFD):
                    clean_end = j
                else:
                    break
            prefix = self.decode(ctx[:clean_end]) if clean_end else ""
            if full.startswith(prefix):
                return full[len(prefix):]
            common = 0
            for a, b in zip(prefix, full, strict=False):
                if a != b:
                    break
                common += 1
            return full[common:]
        return ""


def _space_marker(backend: tokenizers.Tokenizer) -> str | None:
    try:
        pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    except (ValueError, AttributeError):
        return None
    subs = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    for sub in subs:
        if isinstance(sub, dict) and sub.get("type") == "Metaspace":
            return str(sub.get("replacement", "\u2581"))
    return None


def _restore_leading_spaces(raw: str, text: str, marker: str) -> str:
    markers = len(raw) - len(raw.lstrip(marker))
    if markers == 0:
        return text
    missing = markers - (len(text) - len(text.lstrip(" ")))
    return " " * missing + text if missing > 0 else text


def _floor(logprob: float) -> float:
    return logprob if logprob > FLOOR else FLOOR


def _utf8(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


class LogprobFormatter:
    """Formats one choice's logprobs, position by position, in order.

    ``context`` starts as the tail of the prompt's sampled ids that vLLM would use (it
    uses none: its context holds generated tokens only) and follows the generated ids.
    """

    def __init__(self, texts: TokenTexts, top: int) -> None:
        self._texts = texts
        self._top = top
        self._context: list[int] = []
        self.text_offset = 0

    def _advance(self, token_id: int) -> None:
        self._context.append(token_id)
        if len(self._context) > _CONTEXT:
            del self._context[0]

    def chat(self, token_ids: Sequence[int], positions: Sequence[Position]) -> list[dict[str, Any]]:
        """``logprobs.content`` entries for ``token_ids`` (one position each)."""
        out: list[dict[str, Any]] = []
        texts, top = self._texts, self._top
        for token_id, (ids, lps) in zip(token_ids, positions, strict=False):
            ctx = self._context
            step = dict(zip(ids, lps, strict=True))
            logprob = step.get(token_id)
            if logprob is None:
                token = texts.decode([token_id])
                out.append({"token": token, "logprob": FLOOR, "bytes": _utf8(token),
                            "top_logprobs": []})
            else:
                token = texts.text(token_id, ctx)
                tops = []
                for rank, (alt, alt_lp) in enumerate(step.items()):
                    if top != -1 and rank >= top:
                        break
                    alt_text = texts.text(alt, ctx)
                    tops.append({"token": alt_text, "logprob": _floor(alt_lp),
                                 "bytes": _utf8(alt_text)})
                out.append({"token": token, "logprob": _floor(logprob), "bytes": _utf8(token),
                            "top_logprobs": tops})
            self._advance(token_id)
        return out

    def completion(self, token_ids: Sequence[int], positions: Sequence[Position | None]
                   ) -> dict[str, Any]:
        """A completions ``logprobs`` object for ``token_ids``; ``None`` positions (the
        first prompt token under ``echo``) have no logprob."""
        offsets: list[int] = []
        token_logprobs: list[float | None] = []
        tokens: list[str] = []
        tops: list[dict[str, float] | None] = []
        texts, top = self._texts, self._top
        for token_id, position in zip(token_ids, positions, strict=False):
            if position is None:
                token = texts.decode([token_id])
                token_logprobs.append(None)
                tops.append(None)
            else:
                ids, lps = position
                step = dict(zip(ids, lps, strict=True))
                token = texts.text(token_id, self._context)
                token_logprobs.append(_floor(step[token_id]))
                tops.append({texts.text(alt, self._context): _floor(alt_lp)
                             for rank, (alt, alt_lp) in enumerate(step.items())
                             if top == -1 or top >= rank})
                self._advance(token_id)
            tokens.append(token)
            offsets.append(self.text_offset)
            self.text_offset += len(token)
        return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens,
                "top_logprobs": tops}

    def reset_context(self) -> None:
        """Forget the context (the prompt part of an echo ends, generation starts)."""
        self._context = []


def prompt_logprobs(texts: TokenTexts, prompt_ids: Sequence[int],
                    positions: Sequence[tuple[Sequence[int], Sequence[float], Sequence[int]] | None],
                    ) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per prompt position None (the first) or
    ``{token_id: {"logprob", "rank", "decoded_token"}}`` (ids as JSON keys)."""
    out: list[dict[str, Any] | None] = []
    context: list[int] = []
    for token_id, position in zip(prompt_ids, positions, strict=False):
        if position is None:
            out.append(None)
            continue
        ids, lps, ranks = position
        entry: dict[str, Any] = {}
        for alt, lp, rank in zip(ids, lps, ranks, strict=True):
            entry[str(alt)] = {"logprob": _floor(lp), "rank": rank,
                               "decoded_token": texts.text(alt, context)}
        out.append(entry)
        context.append(token_id)
        del context[:-_CONTEXT]
    return out


def echo_positions(
    positions: Sequence[tuple[Sequence[int], Sequence[float], Sequence[int]] | None],
) -> list[Position | None]:
    """Prompt logprobs as completion positions (``echo``): ids and logprobs only."""
    return [None if p is None else (p[0], p[1]) for p in positions]
