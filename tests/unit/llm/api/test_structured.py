"""Which output constraint a request asks for."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dynagraph.errors import InvalidRequest
from dynagraph.llm.api.requests import ChatCompletionRequest
from dynagraph.llm.api.structured import requested_constraint

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


def constraint(**fields: Any) -> Any:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return requested_constraint(ChatCompletionRequest.model_validate(body))


def test_no_constraint() -> None:
    assert constraint() is None
    assert constraint(response_format={"type": "text"}) is None


def test_response_formats() -> None:
    spec = constraint(response_format={"type": "json_schema",
                                       "json_schema": {"name": "x", "schema": SCHEMA}})
    assert json.loads(spec.json) == SCHEMA and spec.to_wire() == {"json": json.dumps(SCHEMA)}
    assert constraint(response_format={"type": "json_object"}).json_object is True
    tag = constraint(response_format={"type": "structural_tag", "format": {"type": "any_text"}})
    assert json.loads(tag.structural_tag) == {"type": "structural_tag",
                                              "format": {"type": "any_text"}}


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"structured_outputs": {"regex": "a+"}}, {"regex": "a+"}),
        ({"structured_outputs": {"choice": ["x", "y"]}}, {"choice": ["x", "y"]}),
        ({"structured_outputs": {"grammar": "root ::= 'a'"}}, {"grammar": "root ::= 'a'"}),
        ({"structured_outputs": {"json": SCHEMA}}, {"json": json.dumps(SCHEMA)}),
        ({"guided_regex": "b"}, {"regex": "b"}),
        ({"guided_choice": ["p"]}, {"choice": ["p"]}),
        ({"guided_json": SCHEMA}, {"json": json.dumps(SCHEMA)}),
    ],
)
def test_vllm_extensions(fields: dict[str, Any], expected: dict[str, Any]) -> None:
    assert constraint(**fields).to_wire() == expected


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "guided_choice"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format"),
        ({"structured_outputs": {"disable_any_whitespace": True}},
         "structured_outputs.disable_any_whitespace"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ],
)
def test_refused(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as exc:
        constraint(**fields)
    assert exc.value.param == param
