"""Merging a worker's outputs that piled up while the Processor was busy. Pure, no I/O.

A worker streams one ``LLMEngineOutput`` (a wire dict) per engine step. When the reader
falls behind (a Processor serving 64 streams on a shared core), several of a stream's
outputs wait whole in its socket; taking them as one output (tokens, and their
logprobs, joined) detokenizes, frames and writes them once, the way vLLM's own server
merges the outputs its reader has not taken yet. Nothing waits for more: only what has
already arrived is merged (``EndpointClient.direct``'s ``merge``).
"""

from __future__ import annotations

from typing import Any

_MERGEABLE = frozenset({"token_ids", "finish_reason", "prompt_tokens", "cached_tokens",
                        "index", "logprobs", "prompt_logprobs"})
"""Keys of an ``LLMEngineOutput`` merge knows (``error``, or anything newer: kept apart)."""
_LATEST = ("finish_reason", "prompt_tokens", "cached_tokens")


def merge_outputs(first: Any, then: Any) -> dict[str, Any] | None:
    """One output equal to ``first`` followed by ``then``, or None where they must stay
    apart: ``first`` is the choice's last, another choice, an error or an unknown key,
    logprobs on one only, or prompt logprobs on the second."""
    if not isinstance(first, dict) or not isinstance(then, dict):
        return None
    if first.keys() - _MERGEABLE or then.keys() - _MERGEABLE:
        return None
    if first.get("finish_reason") is not None or "prompt_logprobs" in then:
        return None
    if first.get("index", 0) != then.get("index", 0):
        return None
    if ("logprobs" in first) != ("logprobs" in then):
        return None
    first_ids, then_ids = first.get("token_ids"), then.get("token_ids")
    if not isinstance(first_ids, list) or not isinstance(then_ids, list):
        return None
    out = dict(first)
    out["token_ids"] = first_ids + then_ids
    if "logprobs" in first:
        a, b = first["logprobs"], then["logprobs"]
        if not isinstance(a, list) or not isinstance(b, list):
            return None
        out["logprobs"] = a + b
    for key in _LATEST:
        if key in then:
            out[key] = then[key]
    return out
