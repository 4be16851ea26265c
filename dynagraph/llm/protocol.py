"""Wire types of the LLM path: the OpenAI HTTP API and the internal hops behind it.

Three groups, by who produces and consumes them:

* **OpenAI requests** (pydantic, validated once at the HTTP edge):
  :class:`ChatCompletionRequest`, :class:`CompletionRequest`. Unknown fields are ignored
  (as OpenAI-compatible servers do); known fields are type-checked strictly.
* **OpenAI responses** (msgspec Structs, encoded with ``msgspec.json``; cheap enough to
  build per request): non-streamed responses, streamed chunks, usage, model list and
  the error object. The hot streaming path formats chunks from byte templates
  (``dynagraph.llm.http.sse``) that produce exactly these shapes.
* **Internal hops** (msgspec Structs, travel as msgpack dicts via ``to_wire``/``from_wire``):

      Frontend --OpenAIRequestEnvelope--> Processor --PreprocessedRequest--> Worker
      Frontend <--------TextChunk-------- Processor <----LLMEngineOutput---- Worker
"""

from __future__ import annotations

from typing import Any, Literal, Self

import msgspec
from pydantic import BaseModel, ConfigDict, Field, field_validator

# ---------------------------------------------------------------------------
# OpenAI requests
# ---------------------------------------------------------------------------


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False


class _OpenAIRequestBase(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    # Extensions shared with vLLM's OpenAI server.
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported")
        return n

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return stop

    def stop_list(self) -> list[str]:
        """The stop strings as a list (``stop`` may be a string, a list or absent)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return self.stream_options is not None and self.stream_options.include_usage

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class ContentPart(BaseModel):
    """One part of a multi-part message content; only ``type == "text"`` is served."""

    model_config = ConfigDict(extra="ignore", strict=True)

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_OpenAIRequestBase):
    """Body of ``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (the current OpenAI name) wins over ``max_tokens``."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class CompletionRequest(_OpenAIRequestBase):
    """Body of ``POST /v1/completions``.

    ``prompt`` may be a string, a list of token ids, or a one-element list of either;
    batches of several prompts are rejected by the Processor (400).
    """

    prompt: str | list[int] | list[str] | list[list[int]]


OpenAIRequest = ChatCompletionRequest | CompletionRequest
Endpoint = Literal["chat", "completion"]

# ---------------------------------------------------------------------------
# OpenAI responses
# ---------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> Usage:
        details = None if cached_tokens is None else PromptTokensDetails(cached_tokens)
        return cls(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens, details)


class ChatResponseMessage(msgspec.Struct):
    content: str
    role: str = "assistant"


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatResponseMessage
    finish_reason: str | None
    logprobs: None = None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class CompletionResponse(msgspec.Struct):
    """A non-streamed text completion; ``usage`` is None only in streamed chunks."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: str = "text_completion"


CompletionChunk = CompletionResponse  # OpenAI uses the same shape for streamed chunks


class ModelCard(msgspec.Struct):
    id: str
    created: int
    owned_by: str = "dynagraph"
    max_model_len: int | None = None
    object: str = "model"


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


# ---------------------------------------------------------------------------
# Internal hops (msgpack dicts on the request plane)
# ---------------------------------------------------------------------------


class _Wire(msgspec.Struct, kw_only=True):
    """Base of internal wire messages: plain Structs that travel as msgpack dicts.

    Unknown keys are ignored on decode, so a newer peer may add fields.
    """

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = msgspec.to_builtins(self)
        return out

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> Self:
        return msgspec.convert(data, cls)


class OpenAIRequestEnvelope(_Wire):
    """Frontend -> Processor: a validated OpenAI request plus the request id."""

    request_id: str
    endpoint: Endpoint
    body: dict[str, Any]

    @classmethod
    def wrap(cls, request: OpenAIRequest, request_id: str) -> OpenAIRequestEnvelope:
        endpoint: Endpoint = "chat" if isinstance(request, ChatCompletionRequest) else "completion"
        return cls(
            request_id=request_id,
            endpoint=endpoint,
            body=request.model_dump(mode="json", exclude_unset=True),
        )

    def unwrap(self) -> OpenAIRequest:
        if self.endpoint == "chat":
            return ChatCompletionRequest.model_validate(self.body)
        return CompletionRequest.model_validate(self.body)


class SamplingParams(_Wire):
    """Generation parameters for the engine. ``max_tokens`` is always resolved."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    # Extra token ids that end generation (the engine also stops on EOS unless ignore_eos).
    stop_token_ids: list[int] = msgspec.field(default_factory=list)


class PreprocessedRequest(_Wire):
    """Processor -> Worker: a tokenized request.

    ``eos_token_ids`` is what the tokenizer/model config call end-of-sequence (engines with
    no tokenizer of their own, like the mocker, use it). ``stop`` strings are applied by
    the Processor's detokenizer; engines ignore them.
    """

    request_id: str
    token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    stop: list[str] = msgspec.field(default_factory=list)
    skip_special_tokens: bool = True


EngineFinishReason = Literal["stop", "length", "abort", "error"]


class LLMEngineOutput(_Wire):
    """Worker -> Processor: newly generated token ids (a delta) for one request.

    ``finish_reason`` is set on the last output only: ``"stop"`` means EOS or a stop
    token id ended generation (the last id of ``token_ids`` is that token; it counts as a
    completion token but produces no text), ``"length"`` means ``max_tokens`` or the
    context limit, ``"abort"`` that the engine dropped the request, ``"error"`` a
    failure (``error`` says what). ``prompt_tokens`` / ``cached_tokens`` are totals for
    the request, sent at least once (typically on the first output).
    """

    token_ids: list[int]
    finish_reason: EngineFinishReason | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None


class TextChunk(_Wire):
    """Processor -> Frontend: a text delta with an OpenAI ``finish_reason`` and usage.

    The token counts are running totals, so the last chunk carries the final usage.
    """

    text: str
    finish_reason: Literal["stop", "length"] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None
