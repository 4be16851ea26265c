from __future__ import annotations

import json

import msgpack
import msgspec
import pytest
from pydantic import ValidationError

from dynagraph.llm.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LLMEngineOutput,
    OpenAIRequestEnvelope,
    PreprocessedRequest,
    SamplingParams,
    TextChunk,
    Usage,
)


def chat(**fields: object) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return ChatCompletionRequest.model_validate_json(json.dumps(body))


def error_locs(exc: pytest.ExceptionInfo[ValidationError]) -> list[tuple[object, ...]]:
    return [tuple(e["loc"]) for e in exc.value.errors()]


def test_chat_request_defaults_and_unknown_fields_ignored() -> None:
    req = chat(frequency_penalty=0.5, logit_bias={"1": 2}, user="u", foo={"x": 1})
    assert req.stream is False
    assert req.n == 1
    assert req.stop_list() == []
    assert req.include_usage() is False
    assert req.requested_max_tokens() is None
    assert req.frequency_penalty == 0.5 and req.logit_bias == {"1": 2}
    assert req.unsupported() is None and req.is_plain()
    assert "foo" not in OpenAIRequestEnvelope.wrap(req, "r").body


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    assert chat(max_tokens=5).requested_max_tokens() == 5
    assert chat(max_tokens=5, max_completion_tokens=7).requested_max_tokens() == 7


@pytest.mark.parametrize(
    ("fields", "loc"),
    [
        ({"max_tokens": -1}, ("max_tokens",)),
        ({"max_tokens": 0}, ("max_tokens",)),
        ({"max_tokens": "10"}, ("max_tokens",)),
        ({"max_completion_tokens": 0}, ("max_completion_tokens",)),
        ({"temperature": 3.0}, ("temperature",)),
        ({"top_p": 0.0}, ("top_p",)),
        ({"n": 0}, ("n",)),
        ({"presence_penalty": 2.5}, ("presence_penalty",)),
        ({"logit_bias": {"x": 1.0}}, ("logit_bias",)),
        ({"top_logprobs": 3}, ()),
        ({"tool_choice": "required"}, ()),
        ({"stream": "yes"}, ("stream",)),
        ({"stop": ""}, ("stop",)),
        ({"stream_options": {"include_usage": "true"}}, ("stream_options", "include_usage")),
        ({"messages": []}, ("messages",)),
        ({"messages": [{"content": "x"}]}, ("messages", 0, "role")),
    ],
)
def test_chat_request_rejects(fields: dict[str, object], loc: tuple[object, ...]) -> None:
    with pytest.raises(ValidationError) as exc:
        chat(**fields)
    assert loc in error_locs(exc)


def test_several_choices_are_not_plain() -> None:
    assert chat(n=3).n == 3 and not chat(n=3).is_plain()
    assert not chat(logprobs=True).is_plain()


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"audio": {"voice": "x"}}, "audio"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"priority": 3}, "priority"),
        ({"modalities": ["text"], "priority": 0, "use_beam_search": False}, None),
    ],
)
def test_unsupported_fields_are_named(fields: dict[str, object], param: str | None) -> None:
    assert chat(**fields).unsupported() == param


def test_completion_unsupported_and_defaults() -> None:
    comp = CompletionRequest.model_validate({"model": "m", "prompt": "x", "suffix": "y"})
    assert comp.unsupported() == "suffix"
    comp = CompletionRequest.model_validate({"model": "m", "prompt": "x", "best_of": 1})
    assert comp.unsupported() is None and comp.max_tokens == 16
    with pytest.raises(ValidationError, match="0 only with echo"):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "max_tokens": 0})
    echo = CompletionRequest.model_validate({"model": "m", "prompt": "x", "max_tokens": 0,
                                             "echo": True})
    assert echo.max_tokens == 0


def test_missing_messages_and_model() -> None:
    with pytest.raises(ValidationError) as exc:
        ChatCompletionRequest.model_validate_json(b"{}")
    assert {("messages",), ("model",)} <= set(error_locs(exc))


def test_stop_forms_and_stream_options() -> None:
    assert chat(stop="x").stop_list() == ["x"]
    assert chat(stop=["a", "b"]).stop_list() == ["a", "b"]
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage()


def test_message_content_parts_accepted() -> None:
    req = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "a"}]}])
    content = req.messages[0].content
    assert isinstance(content, list) and content[0].text == "a"


@pytest.mark.parametrize("prompt", ["text", [1, 2, 3], ["text"], [[1, 2]]])
def test_completion_prompt_forms(prompt: object) -> None:
    req = CompletionRequest.model_validate({"model": "m", "prompt": prompt})
    assert req.prompt == prompt


def test_completion_prompt_rejects_mixed_list() -> None:
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": [1, "a"]})


def test_envelope_round_trips_through_msgpack() -> None:
    req = chat(
        max_tokens=3,
        stop=["x"],
        temperature=1,
        stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": [{"type": "text", "text": "é"}]}],
    )
    env = OpenAIRequestEnvelope.wrap(req, "rid-1")
    wire = msgpack.unpackb(msgpack.packb(env.to_wire()))
    back = OpenAIRequestEnvelope.from_wire(wire)
    assert back.request_id == "rid-1" and back.endpoint == "chat"
    assert back.unwrap() == req

    comp = CompletionRequest.model_validate({"model": "m", "prompt": [1, 2]})
    env2 = OpenAIRequestEnvelope.from_wire(OpenAIRequestEnvelope.wrap(comp, "r").to_wire())
    assert env2.endpoint == "completion" and env2.unwrap() == comp


def test_internal_wire_models_are_plain_msgpack_dicts() -> None:
    pre = PreprocessedRequest(
        request_id="r",
        token_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=4, seed=7),
        eos_token_ids=[2],
        stop=["\n"],
    )
    wire = pre.to_wire()
    assert wire["sampling"]["max_tokens"] == 4 and wire["token_ids"] == [1, 2, 3]
    assert PreprocessedRequest.from_wire(msgpack.unpackb(msgpack.packb(wire))) == pre

    out = LLMEngineOutput(token_ids=[5], finish_reason="length", prompt_tokens=3)
    assert LLMEngineOutput.from_wire(msgpack.unpackb(msgpack.packb(out.to_wire()))) == out
    chunk = TextChunk(text="é", finish_reason="stop", prompt_tokens=3, completion_tokens=1)
    assert TextChunk.from_wire(msgpack.unpackb(msgpack.packb(chunk.to_wire()))) == chunk


def test_wire_models_ignore_unknown_keys_and_check_types() -> None:
    out = LLMEngineOutput.from_wire({"token_ids": [1], "future_field": 1})
    assert out.token_ids == [1]
    with pytest.raises(msgspec.ValidationError):
        LLMEngineOutput.from_wire({"token_ids": ["x"]})
    with pytest.raises(msgspec.ValidationError):
        LLMEngineOutput.from_wire({"token_ids": [1], "finish_reason": "done"})


def test_usage_json_shape() -> None:
    assert msgspec.json.decode(msgspec.json.encode(Usage.of(3, 4, None))) == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "prompt_tokens_details": None,
    }
    assert msgspec.to_builtins(Usage.of(3, 4, 2))["prompt_tokens_details"] == {"cached_tokens": 2}
