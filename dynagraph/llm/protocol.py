"""Wire types of the LLM path: the OpenAI HTTP API and the internal hops behind it.

Three groups, by who produces and consumes them:

* **OpenAI requests** (pydantic, validated once at the HTTP edge; defined in
  :mod:`dynagraph.llm.api.requests`, re-exported here).
* **OpenAI responses** (msgspec Structs; :mod:`dynagraph.llm.api.responses`).
* **Internal hops** (msgspec Structs, travel as msgpack dicts via ``to_wire``/``from_wire``;
  fields at their defaults are left out, so a plain request pays only for what it uses)::

      Frontend --OpenAIRequestEnvelope--> Processor --PreprocessedRequest--> Worker
      Frontend <--------TextChunk-------- Processor <----LLMEngineOutput---- Worker
      Frontend --TokenizeEnvelope--> Processor (``tokenize`` endpoint)
      Router   --Release-------------> Worker    (``release``) <--Released--
"""

from __future__ import annotations

from typing import Any, Literal, Self

import msgspec

from dynagraph.llm.api.requests import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    ContentPart,
    DetokenizeRequest,
    Endpoint,
    OpenAIRequest,
    StreamOptions,
    TokenizeRequest,
)
from dynagraph.llm.api.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatResponseMessage,
    CompletionChoice,
    CompletionChunk,
    CompletionResponse,
    DetokenizeResponse,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TokenizeResponse,
    Usage,
)
from dynagraph.llm.tenants.identity import TenantToken

__all__ = [
    "ChatChoice", "ChatChunkChoice", "ChatCompletionChunk", "ChatCompletionRequest",
    "ChatCompletionResponse", "ChatDelta", "ChatMessage", "ChatResponseMessage",
    "CompletionChoice", "CompletionChunk", "CompletionRequest", "CompletionResponse",
    "ContentPart", "DetokenizeRequest", "DetokenizeResponse", "EngineFinishReason",
    "Endpoint", "ErrorInfo", "Release", "Released", "Subscribe", "ErrorResponse", "LLMEngineOutput", "ModelCard", "ModelList",
    "OpenAIRequest", "OpenAIRequestEnvelope", "PreprocessedRequest", "PromptTokensDetails",
    "Resume",
    "SamplingParams", "StreamOptions", "StructuredOutputsSpec", "TextChunk",
    "TokenizeAnswer", "TokenizeEnvelope", "TokenizeKind", "TokenizeRequest", "TokenizeResponse", "Usage",
]  # fmt: skip

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


class Resume(_Wire):
    """What a client already has of a request whose Processor failed mid-stream: the
    new Processor continues after it (Frontend-level migration, ``dynagraph.llm.resume``)."""

    token_ids: list[int]
    """The completion token ids behind the text already sent (``TextChunk.token_ids``)."""
    prompt_tokens: int
    cached_tokens: int | None = None


class OpenAIRequestEnvelope(_Wire):
    """Frontend -> Processor: a validated OpenAI request plus the request id."""

    request_id: str
    endpoint: Endpoint
    body: dict[str, Any]
    tenant: TenantToken | None = None
    """The caller (signed by the Frontend; None when the service has no tenants)."""
    resume: Resume | None = None
    """Set when the request continues a stream another Processor began."""

    @classmethod
    def wrap(cls, request: OpenAIRequest, request_id: str,
             tenant: TenantToken | None = None) -> OpenAIRequestEnvelope:
        endpoint: Endpoint = "chat" if isinstance(request, ChatCompletionRequest) else "completion"
        return cls(request_id=request_id, endpoint=endpoint, body=request.body(), tenant=tenant)

    def unwrap(self) -> OpenAIRequest:
        if self.endpoint == "chat":
            return ChatCompletionRequest.model_validate(self.body)
        return CompletionRequest.model_validate(self.body)


TokenizeKind = Literal["tokenize", "detokenize"]


class TokenizeEnvelope(_Wire):
    """Frontend -> Processor (``tokenize`` endpoint): a ``/tokenize`` or ``/detokenize`` body.

    The answer is one ``TokenizeAnswer``.
    """

    kind: TokenizeKind
    model: str
    body: dict[str, Any]


class TokenizeAnswer(_Wire, omit_defaults=True):
    """Processor -> Frontend (``tokenize`` endpoint): the one of the two set for the
    envelope's ``kind``."""

    tokenized: TokenizeResponse | None = None
    detokenized: DetokenizeResponse | None = None

    def body(self) -> dict[str, Any]:
        """The HTTP response body."""
        answer = self.tokenized if self.tokenized is not None else self.detokenized
        out: dict[str, Any] = msgspec.to_builtins(answer)
        return out


class StructuredOutputsSpec(_Wire, omit_defaults=True):
    """One output constraint for the engine (vLLM's ``StructuredOutputsParams``).

    Exactly one of ``json`` (a JSON schema, serialized), ``regex``, ``choice``, ``grammar``
    (EBNF/Lark), ``json_object`` or ``structural_tag`` (xgrammar's JSON) is set.
    """

    json: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None


class SamplingParams(_Wire, omit_defaults=True):
    """Generation parameters for the engine. ``max_tokens`` is always resolved.

    An engine honours every field or refuses the request (``InvalidRequest`` naming it).
    ``n`` choices come back as outputs tagged with their ``index``; ``logprobs`` asks for
    the sampled token's logprob plus that many alternatives per position,
    ``prompt_logprobs`` the same for every prompt position.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    # Extra token ids that end generation (the engine also stops on EOS unless ignore_eos).
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    bad_words: list[str] = msgspec.field(default_factory=list)
    allowed_token_ids: list[int] | None = None
    n: int = 1
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsSpec | None = None


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
    tenant: TenantToken | None = None
    """The caller, as the Frontend signed it: the worker verifies it and salts the prefix
    cache per tenant (and schedules by its SLO class)."""


class Subscribe(_Wire):
    """Opens a subscription stream (``kv_events``, ``load_metrics``): no parameters."""


class Release(_Wire):
    """Router -> Worker (``release``): hand back up to ``count`` waiting requests."""

    count: int


class Released(_Wire):
    """Worker -> Router: how many requests were handed back."""

    released: int


EngineFinishReason = Literal["stop", "length", "abort", "error"]

PositionLogprobs = tuple[list[int], list[float]]
"""One generated position: token ids (the sampled one first, then the top alternatives
in rank order; an id may repeat) and their logprobs."""
PromptPositionLogprobs = tuple[list[int], list[float], list[int]]
"""One prompt position: ids (the prompt token first), logprobs and ranks."""


class LLMEngineOutput(_Wire, omit_defaults=True):
    """Worker -> Processor: newly generated token ids (a delta) for one choice.

    ``index`` is the choice (0 .. n-1). ``finish_reason`` is set on the choice's last
    output only: ``"stop"`` means EOS or a stop token id ended generation (the last id
    of ``token_ids`` is that token; it counts as a completion token but produces no
    text), ``"length"`` means ``max_tokens`` or the context limit, ``"abort"`` that the
    engine dropped the request, ``"error"`` a failure (``error`` says what).
    ``prompt_tokens`` / ``cached_tokens`` are totals for the request, sent at least once
    (typically on the first output). ``logprobs`` has one entry per id in ``token_ids``
    when the request asked for them; ``prompt_logprobs`` (first output only) one per
    prompt position, the first None.
    """

    token_ids: list[int]
    finish_reason: EngineFinishReason | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None
    index: int = 0
    logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PromptPositionLogprobs | None] | None = None


class TextChunk(_Wire, omit_defaults=True):
    """Processor -> Frontend: a text delta of one choice, with finish reason and usage.

    The token counts are running totals over all choices, so the request's last chunk
    carries the final usage. ``logprobs`` (the OpenAI object for this delta's tokens,
    chat or completion shape), ``tool_calls`` (OpenAI delta tool calls) and
    ``prompt_logprobs`` (vLLM's shape, first chunk of a choice) are set only when the
    request asked for them. ``finish_reason`` may be ``"tool_calls"`` in chat.
    """

    text: str
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int | None = None
    index: int = 0
    logprobs: dict[str, Any] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    token_ids: list[int] | None = None
    """The completion token ids this chunk's text completes (every id consumed since the
    previous chunk); set on plain requests only, so the Frontend can resume the request
    on another Processor (``Resume``). Never sent to the client."""
