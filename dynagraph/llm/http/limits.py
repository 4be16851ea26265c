"""Limits on what one request may ask for: a hostile or broken client gets a 400 naming
the field, not an unbounded amount of work in the Processor or the engine."""

from __future__ import annotations

from pydantic import Field

from dynagraph.config import ConfigModel
from dynagraph.llm.http.errors import HTTPError
from dynagraph.llm.protocol import ChatCompletionRequest, OpenAIRequest


class RequestLimits(ConfigModel):
    """The Frontend's request limits (its config keys of the same names)."""

    max_body_bytes: int = Field(default=4 << 20, ge=1024)
    """A larger body is refused with 413 before it is read."""
    max_prompt_bytes: int = Field(default=1 << 20, ge=1)
    """Text of all messages (or prompts) together, in UTF-8 bytes."""
    max_messages: int = Field(default=1024, ge=1)
    max_stop: int = Field(default=64, ge=0)
    max_stop_chars: int = Field(default=512, ge=1)
    max_stop_token_ids: int = Field(default=1024, ge=0)
    max_bad_words: int = Field(default=1024, ge=0)
    max_logit_bias: int = Field(default=4096, ge=0)
    max_n: int = Field(default=128, ge=1)
    max_tools: int = Field(default=128, ge=0)


def check_limits(req: OpenAIRequest, limits: RequestLimits) -> None:
    """Raise ``HTTPError(400)`` naming the first field over its limit."""
    def over(field: str, what: str, limit: int) -> HTTPError:
        return HTTPError(400, f"{field}: at most {limit} {what} allowed", param=field,
                         code="limit_exceeded")

    stops = req.stop_list()
    if len(stops) > limits.max_stop:
        raise over("stop", "stop strings are", limits.max_stop)
    if any(len(s) > limits.max_stop_chars for s in stops):
        raise over("stop", "characters per stop string are", limits.max_stop_chars)
    if len(req.stop_token_ids or ()) > limits.max_stop_token_ids:
        raise over("stop_token_ids", "token ids are", limits.max_stop_token_ids)
    if len(req.bad_words or ()) > limits.max_bad_words:
        raise over("bad_words", "words are", limits.max_bad_words)
    if len(req.logit_bias or ()) > limits.max_logit_bias:
        raise over("logit_bias", "entries are", limits.max_logit_bias)
    if req.n > limits.max_n:
        raise over("n", "choices are", limits.max_n)
    if isinstance(req, ChatCompletionRequest):
        if len(req.messages) > limits.max_messages:
            raise over("messages", "messages are", limits.max_messages)
        if len(req.tools or ()) > limits.max_tools:
            raise over("tools", "tools are", limits.max_tools)
        field = "messages"
    else:
        field = "prompt"
    size = prompt_text_bytes(req)
    if size > limits.max_prompt_bytes:
        raise HTTPError(400, f"{field}: {size} bytes of prompt text; at most "
                        f"{limits.max_prompt_bytes} allowed", param=field, code="limit_exceeded")


def prompt_text_bytes(req: OpenAIRequest) -> int:
    """UTF-8 bytes of the request's prompt text (all messages, or all prompts)."""
    if isinstance(req, ChatCompletionRequest):
        return sum(_text_bytes(m.content) for m in req.messages)
    return _text_bytes(req.prompt)


def _text_bytes(value: object) -> int:
    """UTF-8 size of the text in a prompt / message content (token ids count 4 bytes)."""
    if value is None:
        return 0
    if isinstance(value, str):
        return len(value.encode("utf-8", errors="surrogatepass"))
    if isinstance(value, int):
        return 4
    if isinstance(value, list | tuple):
        if value and type(value[0]) is int:  # token ids (a validated prompt's lists are uniform)
            return 4 * len(value)
        return sum(_text_bytes(v) for v in value)
    text = getattr(value, "text", None)
    return _text_bytes(text) if text is not None else 0
