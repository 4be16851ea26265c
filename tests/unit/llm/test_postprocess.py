"""ResponseAssembler: engine outputs of several choices and prompts -> text chunks."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from dynagraph.errors import EngineError
from dynagraph.llm.api.logprobs import TokenTexts
from dynagraph.llm.postprocess import ResponseAssembler, assemble_stream
from dynagraph.llm.preprocess import Preprocessor
from dynagraph.llm.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LLMEngineOutput,
    TextChunk,
)
from dynagraph.llm.tokenizer import Tokenizer


def assembler(tok: Tokenizer, body: dict[str, Any], **pre: Any) -> ResponseAssembler:
    if "messages" in body:
        req: Any = ChatCompletionRequest.model_validate({"model": "m", **body})
    else:
        req = CompletionRequest.model_validate({"model": "m", **body})
    plan = Preprocessor(tok, tool_parser="hermes", **pre).plan(req, "r")
    return ResponseAssembler(tok, TokenTexts(tok.backend), plan)


def out(ids: list[int], **kw: Any) -> LLMEngineOutput:
    return LLMEngineOutput(token_ids=ids, **kw)


def test_choices_are_indexed_and_usage_is_totalled(tok: Tokenizer) -> None:
    he, ll, o = tok.encode("Hello", add_special_tokens=False)
    a = assembler(tok, {"prompt": "x", "n": 2, "max_tokens": 2, "temperature": 1.0})
    first = a.process(0, out([he], index=1, prompt_tokens=1, cached_tokens=0))
    assert first is not None and (first.index, first.text) == (1, "He")
    second = a.process(0, out([ll], index=0))
    assert second is not None and (second.index, second.text) == (0, "ll")
    assert a.process(0, out([o], index=1, finish_reason="length")).finish_reason == "length"  # type: ignore[union-attr]
    assert not a.finished
    last = a.process(0, out([he], index=0, finish_reason="length"))
    assert last is not None and a.finished
    assert (last.prompt_tokens, last.completion_tokens, last.cached_tokens) == (1, 4, 0)


def test_two_prompts_times_n_are_indexed_prompt_major(tok: Tokenizer) -> None:
    a = assembler(tok, {"prompt": ["x", "y z"], "n": 2, "max_tokens": 1, "temperature": 1.0})
    got = [a.process(p, out([5], index=i, finish_reason="length"))
           for p in (1, 0) for i in (1, 0)]
    assert [c.index for c in got if c is not None] == [3, 2, 1, 0] and a.finished


def test_chat_logprobs_only_for_counted_tokens(tok: Tokenizer) -> None:
    he, ll, _ = tok.encode("Hello", add_special_tokens=False)
    eos = tok.eos_token_ids[0]
    a = assembler(tok, {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                        "top_logprobs": 1, "max_tokens": 5})
    c = a.process(0, out([he, ll, eos], finish_reason="stop",
                         logprobs=[([he, he], [-0.1, -0.1]), ([ll, 7], [-0.2, -0.3]),
                                   ([eos, eos], [-0.4, -0.4])]))
    assert c is not None and c.text == "Hello"[:4] and c.finish_reason == "stop"
    assert c.logprobs is not None
    assert [e["token"] for e in c.logprobs["content"]] == ["He", "ll", "</s>"]
    assert [len(e["top_logprobs"]) for e in c.logprobs["content"]] == [1, 1, 1]


def test_missing_logprobs_are_an_engine_error(tok: Tokenizer) -> None:
    a = assembler(tok, {"prompt": "x", "logprobs": 1})
    with pytest.raises(EngineError, match="no logprobs"):
        a.process(0, out([5]))


def test_completion_echo_with_logprobs_and_prompt_logprobs(tok: Tokenizer) -> None:
    a = assembler(tok, {"prompt": "Hello", "echo": True, "logprobs": 0, "max_tokens": 1})
    ids = tok.encode("Hello")
    raw = [None] + [([t], [-1.0], [1]) for t in ids[1:]]
    c = a.process(0, out([5], finish_reason="length", logprobs=[([5], [-0.5])],
                         prompt_logprobs=raw))
    assert c is not None and c.text == "Hello" + tok.decode([5])
    assert c.logprobs is not None and c.logprobs["token_logprobs"][0] is None
    assert len(c.logprobs["tokens"]) == len(ids) + 1
    assert c.prompt_logprobs is not None and len(c.prompt_logprobs) == len(ids)


def test_echo_with_zero_max_tokens_answers_the_prompt_only(tok: Tokenizer) -> None:
    a = assembler(tok, {"prompt": "Hello", "echo": True, "max_tokens": 0})
    c = a.process(0, out([5], finish_reason="length"))
    assert c is not None and c.text == "Hello" and c.completion_tokens == 1


def test_streamed_tool_calls(tok: Tokenizer) -> None:
    call = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    tools = [{"type": "function", "function": {"name": "f"}}]
    a = assembler(tok, {"messages": [{"role": "user", "content": "hi"}], "tools": tools,
                        "stream": True})
    ids = tok.encode(call, add_special_tokens=False) + [tok.eos_token_ids[0]]
    chunks = [a.process(0, out([t], finish_reason="stop" if i == len(ids) - 1 else None))
              for i, t in enumerate(ids)]
    got = [c for c in chunks if c is not None]
    deltas = [d for c in got for d in (c.tool_calls or ())]
    assert deltas[0]["function"] == {"name": "f"}
    assert "".join(d["function"].get("arguments", "") for d in deltas[1:]) == '{"a": 1}'
    assert got[-1].finish_reason == "tool_calls" and all(c.text == "" for c in got)


def test_whole_tool_calls_arrive_with_the_finish(tok: Tokenizer) -> None:
    call = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    tools = [{"type": "function", "function": {"name": "f"}}]
    a = assembler(tok, {"messages": [{"role": "user", "content": "hi"}], "tools": tools})
    ids = tok.encode(call, add_special_tokens=False)
    assert a.process(0, out(ids)) is None
    last = a.process(0, out([tok.eos_token_ids[0]], finish_reason="stop"))
    assert last is not None and last.finish_reason == "tool_calls"
    assert last.tool_calls is not None and last.tool_calls[0]["function"] == {
        "name": "f", "arguments": "{}"}


async def _outputs(items: list[LLMEngineOutput]) -> AsyncIterator[LLMEngineOutput]:
    for item in items:
        yield item


async def test_assemble_stream_merges_prompts_and_checks_the_end(tok: Tokenizer) -> None:
    a = assembler(tok, {"prompt": ["x", "y"], "max_tokens": 1})
    streams = [_outputs([out([5], finish_reason="length")]),
               _outputs([out([6], finish_reason="length")])]
    chunks: list[TextChunk] = [c async for c in assemble_stream(a, streams)]
    assert sorted(c.index for c in chunks) == [0, 1]
    short = assembler(tok, {"prompt": "x", "max_tokens": 3})
    with pytest.raises(EngineError, match="before every choice finished"):
        [c async for c in assemble_stream(short, [_outputs([out([5])])])]
