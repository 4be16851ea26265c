"""The hermes tool-call parser, the tool-call constraint and per-choice tool handling."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dynagraph.errors import InvalidRequest
from dynagraph.llm.api.hermes import HermesToolParser
from dynagraph.llm.api.requests import ChatCompletionRequest
from dynagraph.llm.api.tools import ChoiceTools, plan_tools, tool_constraint
from dynagraph.llm.protocol import StructuredOutputsSpec

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def tool(name: str, strict: bool | None = None) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name, "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}
    if strict is not None:
        fn["strict"] = strict
    return {"type": "function", "function": fn}


def request(**fields: Any) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "tools": [tool("get_weather"), tool("get_time")], **fields}
    return ChatCompletionRequest.model_validate(body)


# --------------------------------------------------------------------------- parser


def test_extract_whole_text() -> None:
    assert HermesToolParser.extract("no call") == (None, "no call")
    calls, content = HermesToolParser.extract("Sure. " + CALL + CALL.replace("Paris", "Rome"))
    assert content == "Sure. "
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Paris"}'},
                     {"name": "get_weather", "arguments": '{"city": "Rome"}'}]
    assert HermesToolParser.extract(CALL)[1] is None
    assert HermesToolParser.extract("<tool_call>{oops")[0] is None  # not JSON: plain content


def test_streaming_character_by_character() -> None:
    parser = HermesToolParser()
    text = "Sure. <tool" + CALL[len("<tool"):] + "after"
    content, deltas = "", []
    for ch in text:
        c, d = parser.feed(ch)
        content += c or ""
        deltas += d
    assert content == "Sure. "  # text after the first tool call is never content
    assert deltas[0]["function"] == {"name": "get_weather"} and deltas[0]["type"] == "function"
    assert deltas[0]["id"].startswith("chatcmpl-tool-") and deltas[0]["index"] == 0
    args = "".join(d["function"].get("arguments", "") for d in deltas[1:])
    assert json.loads(args) == {"city": "Paris"}


# --------------------------------------------------------------------------- constraint


def test_plan_needs_a_parser_and_tools() -> None:
    assert plan_tools(request(tool_choice="none"), "hermes") is None
    with pytest.raises(InvalidRequest) as exc:
        plan_tools(request(), None)
    assert exc.value.param == "tool_choice"
    plan = plan_tools(request(), "hermes")
    assert plan is not None and plan.choice == "auto" and plan.parallel


def _tag(spec: StructuredOutputsSpec | None) -> dict[str, Any]:
    assert spec is not None and spec.structural_tag is not None
    tag: dict[str, Any] = json.loads(spec.structural_tag)
    assert tag["type"] == "structural_tag"
    return dict(tag["format"])


def test_required_forces_any_tool_named_forces_one() -> None:
    req = _tag(tool_constraint(plan_tools(request(tool_choice="required"), "hermes"), None))
    assert req["type"] == "tags_with_separator" and req["at_least_one"]
    assert not req["stop_after_first"]
    assert {t["begin"] for t in req["tags"]} == {
        f'<tool_call>{sep}{{"name": "{n}", "arguments": '
        for n in ("get_weather", "get_time") for sep in ("\n", "")}
    assert all(t["content"] == {"type": "json_schema", "json_schema": True} for t in req["tags"])
    named = _tag(tool_constraint(plan_tools(request(
        tool_choice={"type": "function", "function": {"name": "get_time"}}), "hermes"), None))
    assert named["stop_after_first"] and {t["end"] for t in named["tags"]} == {
        "}\n</tool_call>", "}</tool_call>"}
    assert all("get_time" in t["begin"] for t in named["tags"])


def test_auto_is_free_unless_strict_or_single() -> None:
    regex = StructuredOutputsSpec(regex="a+")
    assert tool_constraint(plan_tools(request(), "hermes"), None) is None
    assert tool_constraint(plan_tools(request(), "hermes"), regex) is regex
    strict = request(tools=[tool("get_weather", strict=True)])
    fmt = _tag(tool_constraint(plan_tools(strict, "hermes"), None))
    assert fmt["type"] == "triggered_tags" and fmt["triggers"] == ["<tool_call>"]
    assert fmt["tags"][0]["content"]["json_schema"]["type"] == "object"  # strict: the schema
    either = _tag(tool_constraint(plan_tools(strict, "hermes"), regex))
    assert either["type"] == "or" and either["elements"][1] == {"type": "regex", "pattern": "a+"}
    single = _tag(tool_constraint(plan_tools(request(parallel_tool_calls=False), "hermes"), None))
    assert single["type"] == "triggered_tags" and single["stop_after_first"]


def test_forced_call_with_another_constraint_is_refused() -> None:
    with pytest.raises(InvalidRequest) as exc:
        tool_constraint(plan_tools(request(tool_choice="required"), "hermes"),
                        StructuredOutputsSpec(regex="a"))
    assert exc.value.param == "tool_choice"


# --------------------------------------------------------------------------- per choice


@pytest.mark.parametrize(
    ("choice", "text", "reason", "content", "calls", "finish"),
    [
        ("auto", "Hi " + CALL, "stop", "Hi ", 1, "tool_calls"),
        ("auto", CALL, "length", None, 1, "tool_calls"),
        ("auto", "plain", "stop", "plain", 0, "stop"),
        ("required", CALL, "stop", "", 1, "tool_calls"),
        ("required", "   ", "length", "", 0, "length"),
        ({"type": "function", "function": {"name": "get_weather"}}, CALL, "stop", "", 1, "stop"),
    ],
)
def test_whole_answer(choice: Any, text: str, reason: str, content: str | None, calls: int,
                      finish: str) -> None:
    plan = plan_tools(request(tool_choice=choice), "hermes")
    assert plan is not None
    got_content, got_calls, got_finish = ChoiceTools(plan).whole(text, reason)
    assert (got_content, len(got_calls), got_finish) == (content, calls, finish)
    for call in got_calls:
        assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
        assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_streamed_finish_reason_and_single_call() -> None:
    plan = plan_tools(request(parallel_tool_calls=False), "hermes")
    assert plan is not None
    tools = ChoiceTools(plan)
    _, deltas = tools.delta(CALL + CALL.replace("Paris", "Rome"))
    assert deltas and {d["index"] for d in deltas} == {0}
    assert tools.stream_finish_reason("stop") == "tool_calls"
    assert tools.stream_finish_reason("length") == "length"
