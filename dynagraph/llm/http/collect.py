"""A non-streamed answer, assembled from the backend's text chunks.

Chunks of every choice arrive interleaved (``TextChunk.index``); each choice's text,
logprobs (chat ``content`` entries or completions' parallel lists), tool calls (whole
calls, or streamed deltas merged by their ``index``) and ``prompt_logprobs`` are
gathered until every expected choice has its finish reason. Usage comes from the last
chunk (running totals).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from dynagraph.errors import EngineError
from dynagraph.llm.api.responses import CompletionChoiceWithPrompt
from dynagraph.llm.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    OpenAIRequest,
    TextChunk,
    Usage,
)


def expected_choices(request: OpenAIRequest) -> int:
    """How many choices (finish reasons) the answer to ``request`` has."""
    if isinstance(request, CompletionRequest):
        return request.n * len(request.prompts())
    return request.n


class _Choice:
    __slots__ = ("parts", "logprobs", "calls", "finish", "prompt_logprobs")

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.logprobs: dict[str, Any] | None = None
        self.calls: list[dict[str, Any]] = []
        self.finish: str | None = None
        self.prompt_logprobs: list[dict[str, Any] | None] | None = None


class ResponseCollector:
    """Feed it every chunk (:meth:`add`) until :attr:`done`, then take :meth:`encode`."""

    def __init__(self, request: OpenAIRequest) -> None:
        self._request = request
        self._choices = [_Choice() for _ in range(expected_choices(request))]
        self._open = len(self._choices)
        self.last: TextChunk | None = None

    @property
    def done(self) -> bool:
        return self._open == 0

    def add(self, chunk: TextChunk) -> None:
        if not 0 <= chunk.index < len(self._choices):
            raise EngineError(f"the backend answered for choice {chunk.index} of "
                              f"{len(self._choices)}")
        self.last = chunk
        ch = self._choices[chunk.index]
        if chunk.text:
            ch.parts.append(chunk.text)
        if chunk.logprobs is not None:
            if ch.logprobs is None:
                ch.logprobs = {k: list(v) for k, v in chunk.logprobs.items()}
            else:
                for key, values in chunk.logprobs.items():
                    ch.logprobs[key].extend(values)
        for call in chunk.tool_calls or ():
            _merge_call(ch.calls, call)
        if chunk.prompt_logprobs is not None and ch.prompt_logprobs is None:
            ch.prompt_logprobs = chunk.prompt_logprobs
        if chunk.finish_reason is not None and ch.finish is None:
            ch.finish = chunk.finish_reason
            self._open -= 1

    def encode(self, response_id: str, model: str) -> bytes:
        last = self.last
        if last is None or not self.done:
            raise EngineError("the backend stream ended without a finish reason")
        usage = Usage.of(last.prompt_tokens, last.completion_tokens, last.cached_tokens)
        created = int(time.time())
        req = self._request
        if isinstance(req, ChatCompletionRequest):
            forced = req.effective_tool_choice() not in ("auto", "none")
            choices = []
            for i, ch in enumerate(self._choices):
                text = "".join(ch.parts)
                content = text if (text or not ch.calls or forced) else None
                choices.append(ChatChoice(
                    index=i, message=ChatResponseMessage(content=content, role="assistant",
                                                 tool_calls=ch.calls),
                    finish_reason=ch.finish, logprobs=ch.logprobs))
            prompt_lp = self._choices[0].prompt_logprobs if self._choices else None
            return msgspec.json.encode(ChatCompletionResponse(
                id=f"chatcmpl-{response_id}", created=created, model=model, choices=choices,
                usage=usage, prompt_logprobs=prompt_lp))
        with_prompt = req.prompt_logprobs is not None or any(
            ch.prompt_logprobs is not None for ch in self._choices)
        out: list[Any] = []
        for i, ch in enumerate(self._choices):
            text = "".join(ch.parts)
            out.append(CompletionChoiceWithPrompt(i, text, ch.finish, ch.logprobs,
                                                  ch.prompt_logprobs)
                       if with_prompt else CompletionChoice(i, text, ch.finish, ch.logprobs))
        return msgspec.json.encode(CompletionResponse(
            id=f"cmpl-{response_id}", created=created, model=model, choices=out, usage=usage))


def _merge_call(calls: list[dict[str, Any]], call: dict[str, Any]) -> None:
    """Add a whole tool call, or merge a streamed delta into the call with its index."""
    index = call.get("index")
    if index is None:
        calls.append(call)
        return
    while len(calls) <= index:
        calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
    target = calls[index]
    if call.get("id"):
        target["id"] = call["id"]
    fn = call.get("function") or {}
    if fn.get("name"):
        target["function"]["name"] = fn["name"]
    if fn.get("arguments"):
        target["function"]["arguments"] += fn["arguments"]
