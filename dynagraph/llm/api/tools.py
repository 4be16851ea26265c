"""Tool calling for chat completions, as vLLM 0.32's server does it with a tool parser.

The Processor owns it: tools go into the chat template (``Preprocessor``), this module
decides the engine-side constraint and parses each choice's text.

* :func:`plan_tools` reads ``tools`` / ``tool_choice`` / ``parallel_tool_calls``
  (``None`` when nothing is to be parsed: no tools or ``tool_choice: "none"``). Tool
  calling needs a configured parser (Processor key ``tool-call-parser``); without one,
  ``auto``/``required``/named choices are a 400, as in vLLM.
* :func:`tool_constraint` is the structural tag (xgrammar JSON) vLLM applies:
  ``required`` and a named function force one or more
  ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``; ``auto`` is left free
  unless a tool is ``strict`` or ``parallel_tool_calls`` is false (then the text may
  still be free, but a started tool call is well formed). Arguments follow the tool's
  schema only for ``strict`` tools (vLLM's default strictness).
* :class:`ChoiceTools` turns one choice's text into ``content`` plus ``tool_calls``,
  whole (non-streamed) or as deltas, with vLLM's finish reasons: ``"tool_calls"`` when
  ``auto`` called a tool or for ``required``, the engine's reason for a named choice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from dynagraph.errors import InvalidRequest
from dynagraph.llm.api.hermes import HermesToolParser, tool_call_id
from dynagraph.llm.api.requests import ChatCompletionRequest, ToolParam
from dynagraph.llm.protocol import StructuredOutputsSpec

TOOL_PARSERS = ("hermes",)
_TAGS = {"hermes": ("<tool_call>", "</tool_call>")}


@dataclass(frozen=True)
class ToolPlan:
    parser: str
    choice: Literal["auto", "required", "named"]
    named: str | None
    parallel: bool
    tools: tuple[ToolParam, ...]


def plan_tools(request: ChatCompletionRequest, parser: str | None) -> ToolPlan | None:
    """How to handle the request's tools; None if there is nothing to parse."""
    choice = request.effective_tool_choice()
    if not request.tools or choice == "none":
        return None
    if parser is None:
        what = f'"{choice}"' if isinstance(choice, str) else f'function "{choice.function.name}"'
        raise InvalidRequest(
            f"tool_choice {what} needs a tool-call parser; this deployment has none "
            "(set the Processor's tool-call-parser)", param="tool_choice")
    if parser not in _TAGS:
        raise InvalidRequest(f"unknown tool-call parser {parser!r}", param="tool_choice")
    if isinstance(choice, str):
        mode: Literal["auto", "required", "named"] = "auto" if choice == "auto" else "required"
        named = None
    else:
        mode, named = "named", choice.function.name
    return ToolPlan(parser=parser, choice=mode, named=named,
                    parallel=request.parallel_tool_calls is not False,
                    tools=tuple(request.tools))


def tool_constraint(plan: ToolPlan, structured: StructuredOutputsSpec | None
                    ) -> StructuredOutputsSpec | None:
    """The engine constraint once tools are taken into account (may be ``structured``).

    A forced tool call (``required``, named) cannot be combined with another output
    constraint (vLLM ignores the other one; we refuse it).
    """
    forced = plan.choice != "auto"
    if forced and structured is not None:
        raise InvalidRequest("a forced tool call (tool_choice required or a named function) "
                             "cannot be combined with response_format or structured_outputs",
                             param="tool_choice")
    single = not plan.parallel
    any_strict = any(t.function.strict is True for t in plan.tools)
    if not forced and not any_strict and not (single and structured is None):
        return structured
    tools = plan.tools
    if plan.named is not None:
        tools = tuple(t for t in tools if t.function.name == plan.named)
    start, end = _TAGS[plan.parser]
    tags = [tag for t in tools for tag in _tags(start, end, t)]
    fmt: dict[str, Any]
    if plan.choice == "auto" and structured is None:
        fmt = {"type": "triggered_tags", "triggers": [start], "tags": tags,
               "at_least_one": False, "stop_after_first": single}
    else:
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "",
               "at_least_one": True, "stop_after_first": single or plan.named is not None}
    if plan.choice == "auto" and structured is not None:
        fmt = {"type": "or", "elements": [fmt, _as_format(structured)]}
    return StructuredOutputsSpec(structural_tag=json.dumps({"type": "structural_tag",
                                                            "format": fmt}))


def _tags(start: str, end: str, tool: ToolParam) -> list[dict[str, Any]]:
    """A call of ``tool`` on its own lines, or on one line (vLLM's two hermes forms)."""
    fn = tool.function
    schema: Any = fn.parameters if fn.strict is True and fn.parameters is not None else True
    return [{"type": "tag", "begin": f'{start}{sep}{{"name": "{fn.name}", "arguments": ',
             "content": {"type": "json_schema", "json_schema": schema}, "end": "}" + sep + end}
            for sep in ("\n", "")]


def _as_format(spec: StructuredOutputsSpec) -> dict[str, Any]:
    if spec.json_object:
        return {"type": "json_schema", "json_schema": {"type": "object"}}
    if spec.json is not None:
        return {"type": "json_schema", "json_schema": json.loads(spec.json)}
    if spec.regex is not None:
        return {"type": "regex", "pattern": spec.regex}
    if spec.choice is not None:
        return {"type": "or", "elements": [{"type": "const_string", "value": c}
                                           for c in spec.choice]}
    raise InvalidRequest("tool_choice auto with strict tools can be combined with a JSON, "
                         "regex or choice constraint only", param="response_format")


class ChoiceTools:
    """Tool-call parsing for one choice (vLLM's serving logic around its parser)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self._parser = HermesToolParser()
        self.called = False

    def delta(self, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        """Streaming: ``(content, tool_call_deltas)`` for a new piece of text."""
        content, calls = self._parser.feed(text) if text else (None, [])
        if not self.plan.parallel:
            calls = [c for c in calls if c["index"] == 0]
        if calls:
            self.called = True
        return content, calls or None

    def stream_finish_reason(self, reason: str) -> str:
        if self.called and self.plan.choice != "named" and reason == "stop":
            return "tool_calls"
        return reason

    def whole(self, text: str, reason: str
              ) -> tuple[str | None, list[dict[str, Any]], str]:
        """Non-streamed: ``(content, tool_calls, finish_reason)`` for the whole text."""
        calls, content = HermesToolParser.extract(text)
        if calls is not None and content is not None and not content.strip():
            content = None
        if calls is None:
            calls = []
            if self.plan.choice != "auto" and not text.strip():
                content = None
        if not self.plan.parallel:
            calls = calls[:1]
        tool_calls = [{"id": tool_call_id(), "type": "function", "function": c} for c in calls]
        if self.plan.choice != "auto":
            content = content or ""
        if (self.plan.choice == "auto" and tool_calls) or (
                self.plan.choice == "required" and reason == "stop"):
            reason = "tool_calls"
        return content, tool_calls, reason
