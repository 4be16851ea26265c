"""Which output constraint a request asks for, resolved the way vLLM's server does.

Sources, in order: vLLM's ``structured_outputs`` field, the legacy ``guided_*`` fields
(``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``), then
OpenAI's ``response_format`` (``json_object``, ``json_schema``, ``structural_tag``;
``text`` adds nothing). More than one constraint kind is a 400, as in vLLM. Tool
calling may replace the result (``dynagraph.llm.api.tools``).

vLLM 0.32 reads ``disable_any_whitespace`` and ``disable_additional_properties`` from
its server config only and ignores them (and ``whitespace_pattern``) in a request; we
refuse them in a request (400) and take them as VllmWorker settings.
"""

from __future__ import annotations

import json
from typing import Any

from dynagraph.errors import InvalidRequest
from dynagraph.llm.api.requests import OpenAIRequest
from dynagraph.llm.protocol import StructuredOutputsSpec

_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
_GUIDED = frozenset({"structured_outputs", "response_format", "guided_json", "guided_regex",
                     "guided_choice", "guided_grammar", "guided_whitespace_pattern"})


def requested_constraint(request: OpenAIRequest) -> StructuredOutputsSpec | None:
    """The request's constraint for the engine, or None. Raises InvalidRequest."""
    if _GUIDED.isdisjoint(request.model_fields_set):
        return None  # the common case, checked in one set operation
    fields: dict[str, Any] = {}
    param = "structured_outputs"
    so = request.structured_outputs
    if so is not None:
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if getattr(so, name):
                raise InvalidRequest(
                    f"structured_outputs.{name} is a server setting in vLLM, not a request "
                    "option (VllmWorker structured-outputs-" + name.replace("_", "-") + ")",
                    param=f"structured_outputs.{name}")
        if so.whitespace_pattern is not None:
            raise InvalidRequest("structured_outputs.whitespace_pattern is not supported",
                                 param="structured_outputs.whitespace_pattern")
        fields = {
            "json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
            "json_object": so.json_object, "structural_tag": so.structural_tag,
        }
        _one_kind(fields, param)
    guided = {"json": request.guided_json, "regex": request.guided_regex,
              "choice": request.guided_choice, "grammar": request.guided_grammar}
    guided = {k: v for k, v in guided.items() if v is not None}
    if guided:
        param = next(f"guided_{k}" for k in guided)
        fields.update(guided)
    if request.guided_whitespace_pattern is not None:
        raise InvalidRequest("guided_whitespace_pattern is not supported",
                             param="guided_whitespace_pattern")
    rf = request.response_format
    if rf is not None and rf.type != "text":
        param = "response_format"
        if rf.type == "json_object":
            fields["json_object"] = True
        elif rf.type == "json_schema":
            assert rf.json_schema is not None  # the model validator checked it
            if rf.json_schema.json_schema is None:
                raise InvalidRequest("response_format.json_schema needs a 'schema'",
                                     param="response_format")
            fields["json"] = rf.json_schema.json_schema
        else:
            fields["structural_tag"] = json.dumps({"type": "structural_tag",
                                                   **(rf.model_extra or {})})
    if not any(fields.get(k) is not None for k in _CONSTRAINTS):
        if so is not None:
            raise InvalidRequest("structured_outputs sets no constraint "
                                 f"(one of {', '.join(_CONSTRAINTS)})", param=param)
        return None
    _one_kind(fields, param)
    if isinstance(fields.get("json"), dict):
        fields["json"] = json.dumps(fields["json"])
    if fields.get("choice") == []:
        raise InvalidRequest("choice must not be empty", param=param)
    return StructuredOutputsSpec(**{k: v for k, v in fields.items() if v is not None})


def _one_kind(fields: dict[str, Any], param: str) -> None:
    kinds = [k for k in _CONSTRAINTS if fields.get(k) is not None]
    if len(kinds) > 1:
        raise InvalidRequest(
            f"only one kind of output constraint can be used, got {' and '.join(kinds)}",
            param=param)
