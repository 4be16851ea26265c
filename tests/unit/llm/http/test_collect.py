"""Non-streamed answers assembled from interleaved choice chunks."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dynagraph.errors import EngineError
from dynagraph.llm.http.collect import ResponseCollector
from dynagraph.llm.protocol import ChatCompletionRequest, CompletionRequest, TextChunk


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def test_choices_logprobs_and_usage() -> None:
    c = ResponseCollector(CompletionRequest.model_validate(
        {"model": "m", "prompt": "x", "n": 2, "logprobs": 0}))
    lp = {"text_offset": [0], "token_logprobs": [-1.0], "tokens": ["a"], "top_logprobs": [{}]}
    c.add(TextChunk(text="a", index=1, logprobs=lp, prompt_tokens=3, completion_tokens=1))
    c.add(TextChunk(text="b", index=0, logprobs=lp, completion_tokens=2, prompt_tokens=3))
    c.add(TextChunk(text="c", index=1, finish_reason="length", prompt_tokens=3,
                    completion_tokens=3, logprobs={**lp, "tokens": ["c"], "text_offset": [1]}))
    assert not c.done
    c.add(TextChunk(text="", index=0, finish_reason="stop", prompt_tokens=3,
                    completion_tokens=4, cached_tokens=2))
    body = json.loads(c.encode("rid", "m"))
    assert [ch["text"] for ch in body["choices"]] == ["b", "ac"]
    assert body["choices"][1]["logprobs"]["tokens"] == ["a", "c"]
    assert body["choices"][1]["logprobs"]["text_offset"] == [0, 1]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                             "prompt_tokens_details": {"cached_tokens": 2}}
    assert "prompt_logprobs" not in body["choices"][0]


def test_streamed_tool_deltas_merge_and_content_is_null() -> None:
    c = ResponseCollector(chat(tools=[{"type": "function", "function": {"name": "f"}}]))
    c.add(TextChunk(text="", tool_calls=[{"index": 0, "id": "t1", "type": "function",
                                          "function": {"name": "f"}}]))
    c.add(TextChunk(text="", tool_calls=[{"index": 0, "function": {"arguments": '{"a"'}}]))
    c.add(TextChunk(text="", finish_reason="tool_calls",
                    tool_calls=[{"index": 0, "function": {"arguments": ": 1}"}}]))
    message = json.loads(c.encode("r", "m"))["choices"][0]["message"]
    assert message == {"content": None, "role": "assistant", "tool_calls": [
        {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}


def test_forced_tool_choice_keeps_empty_content_and_plain_has_no_tool_calls() -> None:
    c = ResponseCollector(chat(tools=[{"type": "function", "function": {"name": "f"}}],
                               tool_choice="required"))
    c.add(TextChunk(text="", finish_reason="tool_calls", tool_calls=[
        {"id": "t", "type": "function", "function": {"name": "f", "arguments": "{}"}}]))
    assert json.loads(c.encode("r", "m"))["choices"][0]["message"]["content"] == ""
    plain = ResponseCollector(chat())
    plain.add(TextChunk(text="hi", finish_reason="stop"))
    assert json.loads(plain.encode("r", "m"))["choices"][0]["message"] == {
        "content": "hi", "role": "assistant"}


def test_an_unfinished_answer_or_a_stray_index_is_an_error() -> None:
    c = ResponseCollector(chat(n=2, temperature=1.0))
    c.add(TextChunk(text="x", finish_reason="stop"))
    with pytest.raises(EngineError):
        c.encode("r", "m")
    with pytest.raises(EngineError):
        c.add(TextChunk(text="x", index=2))
