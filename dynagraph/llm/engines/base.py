"""The engine protocol: what a worker needs from an inference engine.

A worker owns one engine. It calls :meth:`Engine.start` once before serving,
:meth:`Engine.generate` per request (token ids in, a stream of token-id deltas
out), :meth:`Engine.load` whenever it publishes load metrics, and
:meth:`Engine.shutdown` once on exit. Closing or cancelling the iterator returned by
``generate`` aborts the request inside the engine and frees its KV blocks; so does
:meth:`Engine.abort` from any other task.

The value types are pydantic models so they can travel as msgpack
(``model_dump()`` / ``model_validate()``) without extra glue.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, model_validator

FinishReason = Literal["stop", "length", "abort"]


class SamplingSpec(BaseModel):
    """How to sample one request. ``temperature == 0`` means greedy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int | None = Field(default=None, ge=1)
    """Upper bound on generated tokens; ``None`` lets the context length decide."""
    min_tokens: int = Field(default=0, ge=0)
    temperature: float = Field(default=1.0, ge=0.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=1)
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)

    @model_validator(mode="after")
    def _min_le_max(self) -> SamplingSpec:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        return self


class EngineOutput(BaseModel):
    """One step of a request's stream: the tokens generated since the previous one.

    The last output of a stream has ``finish_reason`` set; it may carry no new tokens
    (e.g. after an abort). ``kv_transfer_params`` is set on the last output of a
    request that asked for a remote decode (disaggregated prefill).
    """

    model_config = ConfigDict(extra="forbid")

    token_ids: list[int]
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens served from the engine's prefix cache (or pulled from a remote one)."""
    kv_transfer_params: dict[str, Any] | None = None


class EngineLoad(BaseModel):
    """A snapshot of the engine's load, as of its most recent scheduler step.

    ``prefix_cache_queries`` / ``prefix_cache_hits`` count prompt tokens since start
    (monotonic), so a hit rate over a window is the ratio of their increases.
    """

    model_config = ConfigDict(extra="forbid")

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use, 0.0 to 1.0."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


@runtime_checkable
class Engine(Protocol):
    """An inference engine serving token-id requests.

    ``generate`` is an async generator method (``async def ... yield``): call it
    without ``await`` and iterate the result with ``async for``.
    """

    async def start(self) -> None:
        """Load the model and get ready to serve. Called once, before anything else."""
        ...

    async def shutdown(self) -> None:
        """Abort what is in flight and release every resource. Idempotent."""
        ...

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec,
        *,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> AsyncIterator[EngineOutput]:
        """Stream the request's new tokens.

        ``request_id`` must be unique among requests in flight. ``kv_transfer_params``
        is handed to the engine's KV connector unchanged (disaggregated prefill).
        Raises ``InvalidRequest`` / ``PromptTooLong`` for requests the engine refuses
        and ``EngineError`` when the engine fails. Closing the iterator early aborts
        the request.
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Abort a request in flight; its stream ends with ``finish_reason='abort'``.

        Unknown or finished ids are ignored.
        """
        ...

    def load(self) -> EngineLoad:
        """The latest load snapshot. Cheap, never blocks."""
        ...
