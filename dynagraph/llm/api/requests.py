"""OpenAI request bodies, as vLLM's OpenAI server accepts them for a text model.

Validated once at the HTTP edge (pydantic, strict types). The field set is vLLM 0.32's
for ``/v1/chat/completions`` and ``/v1/completions``; what each field does is decided
downstream (the Processor and the engine). Three kinds of fields:

* honoured fields, declared with their types and ranges;
* fields vLLM or OpenAI define that we cannot honour: listed in :data:`UNSUPPORTED`;
  :meth:`_RequestBase.unsupported` names the first one a request sets to anything but
  its neutral value, and the Frontend answers 400 with ``param`` set to it (never a
  silent drop);
* anything else is ignored, as OpenAI-compatible servers (vLLM included) do.

vLLM's removed ``guided_*`` fields are honoured as aliases of ``structured_outputs``
(vLLM 0.32 ignores them with a warning; Dynamo and older vLLM honour them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from dynagraph.llm.api.params import (
    ChatMessage,
    ContentPart,
    FunctionDefinition,
    JsonSchemaFormat,
    Model,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    StreamOptions,
    StructuredOutputs,
    ToolCallFunction,
    ToolCallParam,
    ToolChoice,
    ToolParam,
)

__all__ = [
    "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "ContentPart",
    "DetokenizeRequest", "Endpoint", "FunctionDefinition", "JsonSchemaFormat",
    "NamedFunction", "NamedToolChoice", "OpenAIRequest", "ResponseFormat", "StreamOptions",
    "StructuredOutputs", "TokenizeRequest", "ToolCallFunction", "ToolCallParam", "ToolChoice",
    "ToolParam",
]  # fmt: skip

_INT64 = 2**63

# --------------------------------------------------------------------------- requests


def _neutral(*values: Any) -> Callable[[Any], bool]:
    return lambda v: v in values


UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    # field -> "this value asks for nothing we cannot do"
    "use_beam_search": _neutral(None, False),
    "logprob_token_ids": _neutral(None, []),
    "prompt_embeds": _neutral(None, []),
    "kv_transfer_params": _neutral(None),
    "ec_transfer_params": _neutral(None),
    "vllm_xargs": _neutral(None, {}),
    "cache_salt": _neutral(None),
    "priority": _neutral(None, 0),
    "stream_interval": _neutral(None, 1),
    "return_token_ids": _neutral(None, False),
    "return_tokens_as_token_ids": _neutral(None, False),
    "return_prompt_text": _neutral(None, False),
    "repetition_detection": _neutral(None),
    "thinking_token_budget": _neutral(None, -1),
    "watermarking": _neutral(None, False),
    "length_penalty": _neutral(None, 1, 1.0),
    "truncation_side": _neutral(None),
    "mm_processor_kwargs": _neutral(None, {}),
    "media_io_kwargs": _neutral(None, {}),
    "spaces_between_special_tokens": _neutral(None, True),
    "lora_request": _neutral(None),
}
CHAT_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    **UNSUPPORTED,
    "audio": _neutral(None),
    "modalities": _neutral(None, ["text"]),
    "prediction": _neutral(None),
    "web_search_options": _neutral(None),
    "functions": _neutral(None),
    "function_call": _neutral(None),
    "documents": _neutral(None),
    "chat_template": _neutral(None),
    "reasoning_effort": _neutral(None),
}
COMPLETION_UNSUPPORTED: dict[str, Callable[[Any], bool]] = {
    **UNSUPPORTED,
    "suffix": _neutral(None, ""),
    "best_of": _neutral(None, 1),
}


class _RequestBase(Model):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="allow", strict=True, validate_by_name=True,
                              validate_by_alias=True, serialize_by_alias=True,
                              allow_inf_nan=False)
    UNSUPPORTED_FIELDS: ClassVar[dict[str, Callable[[Any], bool]]] = UNSUPPORTED

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=-_INT64, lt=_INT64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    n: int = Field(1, ge=1, le=16384)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    echo: bool | None = False
    prompt_logprobs: int | None = Field(None, ge=-1)
    add_special_tokens: bool | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    user: str | None = None
    request_id: str | None = None

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return stop

    @field_validator("bad_words")
    @classmethod
    def _non_empty_bad_words(cls, words: list[str] | None) -> list[str] | None:
        if words and any(not w for w in words):
            raise ValueError("bad_words must not contain an empty string")
        return words

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            try:
                int(key)
            except ValueError:
                raise ValueError(f"logit_bias key {key!r} is not a token id") from None
        return bias

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _RequestBase:
        if self.stream_options is not None and not self.stream:
            if self.stream_options.include_usage or self.stream_options.continuous_usage_stats:
                raise ValueError("stream_options can only be set when stream is true")
        if self.prompt_logprobs is not None and self.prompt_logprobs != 0 and self.stream:
            raise ValueError("prompt_logprobs are not available when stream is true")
        return self

    # -- derived views -----------------------------------------------------------------

    def stop_list(self) -> list[str]:
        """The stop strings as a list (``stop`` may be a string, a list or absent)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        """Whether every streamed chunk carries the usage so far."""
        return (self.stream_options is not None
                and bool(self.stream_options.continuous_usage_stats))

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        """Top alternatives per sampled token, or None if logprobs were not asked for."""
        return None

    def unsupported(self) -> str | None:
        """The first field set to something we cannot honour, or None."""
        extra = self.model_extra
        if not extra:
            return None
        for name, neutral in self.UNSUPPORTED_FIELDS.items():
            if name in extra and not neutral(extra[name]):
                return name
        return None

    def wants_tools(self) -> bool:
        return False

    def is_plain(self) -> bool:
        """True for requests the streaming fast path can format: one choice, text only."""
        return (self.n == 1 and self.num_logprobs() is None and not self.echo
                and not self.continuous_usage() and not self.wants_tools())

    def body(self) -> dict[str, Any]:
        """The fields the client set, without unknown extras (for the internal hops)."""
        data: dict[str, Any] = self.model_dump(mode="json", exclude_unset=True, by_alias=True)
        for name in self.model_extra or {}:
            data.pop(name, None)
        return data


class ChatCompletionRequest(_RequestBase):
    """Body of ``POST /v1/chat/completions``."""

    UNSUPPORTED_FIELDS: ClassVar[dict[str, Callable[[Any], bool]]] = CHAT_UNSUPPORTED

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=-1)
    tools: list[ToolParam] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs not in (None, 0) and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be "
                             "true")
        if self.tools is None and self.tool_choice is None:
            return self
        if self.tools == []:
            raise ValueError("tools must not be an empty list; leave it out instead")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice needs tools")
        choice = self.tool_choice
        if choice is not None and not isinstance(choice, str):
            names = {t.function.name for t in self.tools or ()}
            if choice.function.name not in names:
                raise ValueError(f"tool_choice names {choice.function.name!r}, "
                                 "which is not in tools")
        return self

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (the current OpenAI name) wins over ``max_tokens``."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def effective_tool_choice(self) -> str | NamedToolChoice:
        """``tool_choice`` with OpenAI's default: ``auto`` when tools are given, else ``none``."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def wants_tools(self) -> bool:
        return bool(self.tools) and self.effective_tool_choice() != "none"


class CompletionRequest(_RequestBase):
    """Body of ``POST /v1/completions``.

    ``prompt`` may be a string, a list of token ids, or a list of either (a batch: each
    prompt gets ``n`` choices, indexed prompt-major as vLLM does). ``max_tokens``
    defaults to 16 (OpenAI's and vLLM's default); 0 is allowed with ``echo``.
    """

    UNSUPPORTED_FIELDS: ClassVar[dict[str, Callable[[Any], bool]]] = COMPLETION_UNSUPPORTED

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    logprobs: int | None = Field(None, ge=-1)

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1 (0 only with echo)")
        if self.prompt == "" or self.prompt == []:
            raise ValueError("prompt must not be empty")
        return self

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request (one unless it is a batch)."""
        p: Any = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            return list(p)
        return [p]


OpenAIRequest = ChatCompletionRequest | CompletionRequest
Endpoint = Literal["chat", "completion"]


class TokenizeRequest(Model):
    """Body of ``POST /tokenize``: a ``prompt`` or chat ``messages`` (vLLM's shapes)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolParam] | None = None
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(Model):
    model: str | None = None
    tokens: list[int]
