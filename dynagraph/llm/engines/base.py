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
    """How to sample one request. ``temperature == 0`` means greedy.

    An engine honours every field or refuses the request with ``InvalidRequest`` naming
    the field; it never ignores one. ``n`` > 1 runs that many choices of one prompt (the
    outputs carry their ``index``); ``logprobs`` / ``prompt_logprobs`` ask for the
    chosen token's logprob plus that many top alternatives per position;
    ``structured_outputs`` is one constraint in the shape of
    ``dynagraph.llm.protocol.StructuredOutputsSpec`` (a dict).
    """

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
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] = Field(default_factory=list)
    allowed_token_ids: list[int] | None = None
    n: int = Field(default=1, ge=1)
    logprobs: int | None = Field(default=None, ge=-1)
    prompt_logprobs: int | None = Field(default=None, ge=-1)
    structured_outputs: dict[str, Any] | None = None
    cache_salt: str | None = None
    """Isolates the prefix cache: blocks are shared only between requests with the same salt."""
    priority: int = 0
    """Scheduling priority (lower first) where the engine schedules by priority."""

    @model_validator(mode="after")
    def _min_le_max(self) -> SamplingSpec:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        return self


class EngineOutput(BaseModel):
    """One step of one choice of a request: the tokens generated since the previous one.

    ``index`` is the choice (0 .. n-1). A choice's last output has ``finish_reason``
    set; it may carry no new tokens (e.g. after an abort); the stream ends after every
    choice finished. ``kv_transfer_params`` is set on the last output of a request that
    asked for a remote decode (disaggregated prefill). ``logprobs`` (one entry per
    new token: ids with the chosen one first, then the top alternatives, and their
    logprobs) and ``prompt_logprobs`` (first output only; ids, logprobs and ranks per
    prompt position, the first None) are set only when the sampling spec asked.
    """

    model_config = ConfigDict(extra="forbid")

    token_ids: list[int]
    finish_reason: FinishReason | None = None
    index: int = 0
    logprobs: list[tuple[list[int], list[float]]] | None = None
    prompt_logprobs: list[tuple[list[int], list[float], list[int]] | None] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    """Prompt tokens served from the engine's prefix cache (or pulled from a remote one)."""
    kv_transfer_params: dict[str, Any] | None = None


class EngineLoad(BaseModel):
    """A snapshot of the engine's load, as of its most recent scheduler step.

    ``prefix_cache_queries`` / ``prefix_cache_hits`` count prompt tokens since start
    (monotonic), so a hit rate over a window is the ratio of their increases. So do the
    ``*_total`` step counters, from which the Router learns the engine's speeds
    (``dynagraph.llm.router.rates``): every engine step counts once, either as a prefill
    step (it computed prompt tokens, decodes alongside included) or as a decode step.
    Every field has a default, so a reader accepts samples from engines that publish
    fewer fields (0 / ``None`` = not known).
    """

    model_config = ConfigDict(extra="forbid")

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    requests_total: int = 0
    """Requests handed to the engine since start."""
    prefilling: int = 0
    """Requests in the engine that have not had their first token yet (waiting included)."""
    prefill_tokens_total: int = 0
    """Prompt tokens computed (not found in the cache) since start."""
    prefill_seconds_total: float = 0.0
    """Seconds of the steps that computed prompt tokens, since start."""
    decode_steps_total: int = 0
    """Steps that computed no prompt token but decoded, since start."""
    decode_seconds_total: float = 0.0
    """Seconds of those steps."""
    max_num_batched_tokens: int = 0
    """Tokens one step computes at most (longer prompts take several steps)."""
    max_num_seqs: int = 0
    """Requests the engine runs at once; more wait for a place (0 = not known)."""
    nominal_prefill_tokens_per_s: float | None = None
    """The engine's own idea of its prefill speed (a simulated engine's profile)."""
    nominal_decode_step_s: float | None = None
    """The engine's own idea of one decode step's duration."""
    kv_pool_query_tokens: int = 0
    """Prompt tokens past the engine's own prefix looked up in its KV connectors."""
    kv_pool_hit_tokens: int = 0
    """Of those, tokens loaded from the host KV pool (``kv-offload-gib``) or the tier
    under it (``kv-offload-dir``) since start."""
    kv_tier_hit_tokens: int = 0
    """Of those, tokens found in the tier under the pool (``kv-offload-dir``)."""
    kv_tier_read_bytes: int = 0
    """Bytes read from that tier into the pool (before the pool's load into the engine)."""
    kv_tier_read_seconds: float = 0.0
    """Seconds spent on those reads."""
    kv_pool_loaded_bytes: int = 0
    kv_pool_load_seconds: float = 0.0
    kv_pool_stored_bytes: int = 0
    kv_pool_evictions: int = 0
    """Blocks the pool dropped to make room, since start."""
    kv_pool_usage: float = 0.0
    """Fraction of the pool's blocks held, 0.0 to 1.0."""

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
