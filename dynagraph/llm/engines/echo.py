"""An in-memory :class:`Engine` for unit tests: echoes the prompt back, token by token.

Output token ``i`` is ``prompt[i % len(prompt)]`` (or ``cycle[i % len(cycle)]`` if a
cycle is given), so tests can predict every token. It honours ``max_tokens``,
``min_tokens``, ``ignore_eos``, ``stop_token_ids``, aborts and cancellation, and keeps
``load()`` counts; it refuses (``InvalidRequest`` naming the field) what it cannot honour:
``n`` > 1, logprobs, prompt logprobs and structured outputs. No prefix cache:
``num_cached_tokens`` is always 0.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from dynagraph.errors import EngineError, InvalidRequest, PromptTooLong
from dynagraph.llm.engines.base import EngineLoad, EngineOutput, FinishReason, SamplingSpec


class EchoEngine:
    """Deterministic fake engine. ``step_delay_s`` paces tokens (0 = as fast as possible)."""

    def __init__(
        self,
        *,
        eos_token_ids: Sequence[int] = (),
        max_model_len: int = 8192,
        step_delay_s: float = 0.0,
        cycle: Sequence[int] | None = None,
    ) -> None:
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.step_delay_s = step_delay_s
        self.cycle = list(cycle) if cycle else None
        self.started = False
        self.requests_seen: list[str] = []
        self.kv_transfer_params_seen: list[dict[str, Any] | None] = []
        self._aborted: set[str] = set()
        self._running: set[str] = set()

    async def start(self) -> None:
        self.started = True

    async def shutdown(self) -> None:
        self._aborted |= self._running
        self.started = False

    def load(self) -> EngineLoad:
        return EngineLoad(running=len(self._running))

    async def abort(self, request_id: str) -> None:
        if request_id in self._running:
            self._aborted.add(request_id)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec,
        *,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> AsyncIterator[EngineOutput]:
        if not self.started:
            raise EngineError("the echo engine is not started")
        if not prompt_token_ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        if len(prompt_token_ids) >= self.max_model_len:
            raise PromptTooLong(f"{len(prompt_token_ids)} tokens >= {self.max_model_len}")
        if request_id in self._running:
            raise InvalidRequest(f"request id {request_id!r} is already in flight")
        for name, asked in (("n", sampling.n > 1), ("logprobs", sampling.logprobs is not None),
                            ("prompt_logprobs", sampling.prompt_logprobs is not None),
                            ("structured_outputs", sampling.structured_outputs is not None)):
            if asked:
                raise InvalidRequest(f"the echo engine does not support {name}", param=name)
        self.requests_seen.append(request_id)
        self.kv_transfer_params_seen.append(kv_transfer_params)
        source = self.cycle or prompt_token_ids
        limit = self.max_model_len - len(prompt_token_ids)
        if sampling.max_tokens is not None:
            limit = min(limit, sampling.max_tokens)
        stops = set(sampling.stop_token_ids) | (
            set() if sampling.ignore_eos else self.eos_token_ids
        )
        n = len(prompt_token_ids)
        self._running.add(request_id)
        try:
            for i in range(limit):
                await asyncio.sleep(self.step_delay_s)
                if request_id in self._aborted:
                    yield EngineOutput(token_ids=[], finish_reason="abort", num_prompt_tokens=n)
                    return
                token = source[i % len(source)]
                reason: FinishReason | None = None
                if token in stops and i + 1 > sampling.min_tokens:
                    reason = "stop"
                elif i + 1 == limit:
                    reason = "length"
                yield EngineOutput(token_ids=[token], finish_reason=reason, num_prompt_tokens=n)
                if reason is not None:
                    return
        finally:
            self._running.discard(request_id)
            self._aborted.discard(request_id)
