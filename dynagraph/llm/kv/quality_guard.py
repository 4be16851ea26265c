"""The quality guard of a lossy KV codec, run at start-up: the host pool's
(``kv-compression``) and the NIXL wire's (``kv-transfer-compression``).

Calibration: ``PROMPTS`` seeded prompts of ``PROMPT_BLOCKS`` full blocks and a short
tail are each served twice with greedy decoding and the chosen tokens' logprobs:

1. computed (the engine's cache holds nothing of them);
2. with every full block restored through the codec: for the pool (:func:`calibrate`)
   after the engine's prefix cache was reset, so that the blocks come back from the
   pool; for the wire (:func:`calibrate_wire`) after the engine's cached blocks were
   replaced in place by their round trip through the codec (what a decode engine holds
   after an encoded READ), so that the prefix cache serves them.

Both runs compute the same tail tokens, so what differs is only the KV the codec
restored. :func:`judge` compares them: **agreement** is the share of prompts whose
greedy tokens are identical, **divergence** the mean |logprob difference| (nats) of the
tokens both runs chose, up to where they part. The worker refuses to start when the
divergence is above ``kv-compression-max-divergence`` or the agreement below
``kv-compression-min-agreement``, or when the second run loaded nothing from the pool
(the guard would have tested nothing). :func:`judge` is pure; :func:`calibrate` drives
an engine.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from dynagraph.errors import ConfigError
from dynagraph.llm.engines.base import EngineLoad, EngineOutput, SamplingSpec

PROMPTS = 8
PROMPT_BLOCKS = 4
OUTPUT_TOKENS = 16


@dataclass(frozen=True)
class Sample:
    tokens: list[int]
    logprobs: list[float]
    cached_tokens: int = 0
    """Prompt tokens the engine's prefix cache served."""


@dataclass(frozen=True)
class GuardReport:
    codec: str
    prompts: int
    agreement: float
    divergence: float
    """Mean |logprob difference| in nats per compared token."""
    max_divergence: float
    compared_tokens: int
    restored_tokens: int
    """Prompt tokens of the second run whose KV came through the codec."""
    key: str = "kv-compression"

    def summary(self) -> str:
        source = "from the pool" if self.key == "kv-compression" else "through the codec"
        return (f"{self.key} {self.codec}: greedy tokens agree on {self.agreement:.0%} of "
                f"{self.prompts} calibration prompts, mean |logprob difference| "
                f"{self.divergence:.4f} nats (max {self.max_divergence:.4f}) over "
                f"{self.compared_tokens} tokens, {self.restored_tokens} prompt tokens "
                f"restored {source}")


def judge(codec: str, computed: list[Sample], pooled: list[Sample],
          restored_tokens: int, key: str = "kv-compression") -> GuardReport:
    """Compare the computed and the pool-served runs of the same prompts."""
    if len(computed) != len(pooled) or not computed:
        raise ValueError("the two runs must cover the same, non-empty set of prompts")
    same = 0
    diffs: list[float] = []
    for ref, got in zip(computed, pooled, strict=True):
        same += ref.tokens == got.tokens
        for t_ref, t_got, lp_ref, lp_got in zip(ref.tokens, got.tokens, ref.logprobs,
                                                got.logprobs, strict=False):
            if t_ref != t_got:
                break
            diffs.append(abs(lp_ref - lp_got))
    return GuardReport(
        codec=codec, prompts=len(computed), agreement=same / len(computed),
        divergence=sum(diffs) / len(diffs) if diffs else float("inf"),
        max_divergence=max(diffs, default=float("inf")), compared_tokens=len(diffs),
        restored_tokens=restored_tokens, key=key)


def check(report: GuardReport, *, max_divergence: float, min_agreement: float) -> None:
    """Raise ``ConfigError`` (naming the key and the numbers) when the codec fails."""
    why = []
    if report.restored_tokens <= 0:
        why.append("no prompt token's KV came through the codec, so nothing was checked")
    if report.divergence > max_divergence:
        why.append(f"divergence {report.divergence:.4f} > kv-compression-max-divergence "
                   f"{max_divergence}")
    if report.agreement < min_agreement:
        why.append(f"agreement {report.agreement:.0%} < kv-compression-min-agreement "
                   f"{min_agreement:.0%}")
    if why:
        raise ConfigError(f"the quality guard refused {report.summary()}: " + "; ".join(why)
                          + f". Use {report.key}: none (or a better codec).",
                          key=report.key)


class _Engine(Protocol):
    def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec,
                 ) -> AsyncIterator[EngineOutput]: ...

    def load(self) -> EngineLoad: ...


def calibration_prompts(block_size: int, vocab: int = 1900, seed: int = 20261202
                        ) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(PROMPT_BLOCKS * block_size + 5)]
            for _ in range(PROMPTS)]


async def _serve(engine: _Engine, rid: str, prompt: list[int]) -> Sample:
    tokens: list[int] = []
    logprobs: list[float] = []
    cached = 0
    spec = SamplingSpec(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True, logprobs=0)
    async for out in engine.generate(rid, prompt, spec):
        tokens += out.token_ids
        cached = max(cached, out.num_cached_tokens)
        for _ids, lps in out.logprobs or ():
            logprobs.append(lps[0])
    return Sample(tokens, logprobs, cached)


async def calibrate(engine: _Engine, codec: str, block_size: int,
                    reset_prefix_cache: Callable[[], Any]) -> GuardReport:
    """Serve the calibration prompts computed, then from the pool; judge the pair.

    ``reset_prefix_cache``: an async callable that empties the engine's own prefix
    cache but keeps the pool (vLLM's ``AsyncLLM.reset_prefix_cache()``)."""
    prompts = calibration_prompts(block_size)
    computed = [await _serve(engine, f"kv-guard-a{i}", p) for i, p in enumerate(prompts)]
    # vLLM stores a request's blocks at the start of the engine's next step: one more
    # request makes sure the last prompt's blocks reached the pool.
    await _serve(engine, "kv-guard-flush", prompts[0][:block_size])
    await reset_prefix_cache()
    hits_before = engine.load().kv_pool_hit_tokens
    pooled = [await _serve(engine, f"kv-guard-b{i}", p) for i, p in enumerate(prompts)]
    return judge(codec, computed, pooled, engine.load().kv_pool_hit_tokens - hits_before)


WIRE_KEY = "kv-transfer-compression"


async def calibrate_wire(engine: _Engine, codec: str, block_size: int,
                         roundtrip: Callable[[], Awaitable[Any]]) -> GuardReport:
    """Serve the calibration prompts computed, round-trip the engine's cached KV through
    the wire codec (``roundtrip``), serve them again from the prefix cache; judge."""
    prompts = calibration_prompts(block_size)
    computed = [await _serve(engine, f"kv-wire-guard-a{i}", p) for i, p in enumerate(prompts)]
    await roundtrip()
    restored = [await _serve(engine, f"kv-wire-guard-b{i}", p) for i, p in enumerate(prompts)]
    return judge(codec, computed, restored, sum(s.cached_tokens for s in restored),
                 key=WIRE_KEY)
