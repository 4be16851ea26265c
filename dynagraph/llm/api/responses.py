"""OpenAI response bodies (msgspec Structs, encoded with ``msgspec.json``).

The shapes are OpenAI's, with vLLM's additions where a client may rely on them
(``prompt_logprobs``, ``/tokenize``). Cheap enough to build per request; the hot
streaming path formats plain chunks from byte templates (``dynagraph.llm.http.sse``)
that produce exactly these shapes.
"""

from __future__ import annotations

from typing import Any

import msgspec

# --------------------------------------------------------------------------- usage


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


# --------------------------------------------------------------------------- logprobs and tools
# Logprobs and tool calls are built by the Processor as plain dicts and lists of exactly
# these shapes (they cross one msgpack hop on the way); the Structs document them and
# type the non-streamed responses.


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[TokenLogprob] | None


class CompletionLogprobs(msgspec.Struct):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str


class ToolCall(msgspec.Struct):
    id: str
    function: FunctionCall
    type: str = "function"


# --------------------------------------------------------------------------- chat


class ChatResponseMessage(msgspec.Struct, omit_defaults=True):
    """``content`` is always present (null when the answer is only tool calls);
    ``tool_calls`` only when there are some."""

    content: str | None
    role: str
    tool_calls: list[dict[str, Any]] = msgspec.field(default_factory=list)


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatResponseMessage
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: str = "chat.completion"
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


# --------------------------------------------------------------------------- completions


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


class CompletionChoiceWithPrompt(CompletionChoice):
    """A choice of a request that asked for ``prompt_logprobs`` (vLLM's field)."""

    prompt_logprobs: list[dict[str, Any] | None] | None = None


class CompletionResponse(msgspec.Struct):
    """A non-streamed text completion; ``usage`` is None only in streamed chunks."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice] | list[CompletionChoiceWithPrompt]
    usage: Usage | None = None
    object: str = "text_completion"


CompletionChunk = CompletionResponse  # OpenAI uses the same shape for streamed chunks

# --------------------------------------------------------------------------- the rest


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


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str
