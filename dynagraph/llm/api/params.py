"""The structured parts of OpenAI request bodies: messages, tools, output formats.

Shared by :mod:`dynagraph.llm.api.requests` (the request bodies) and the Processor's
modules that read them. Strict types; unknown keys ignored unless noted.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Model(BaseModel):
    """Base of the request models: strict types, aliases accepted both ways, no NaN or
    infinity (JSON parsers accept ``NaN`` literals; no field means anything by them)."""

    model_config = ConfigDict(extra="ignore", strict=True, validate_by_name=True,
                              validate_by_alias=True, serialize_by_alias=True,
                              allow_inf_nan=False)


class StreamOptions(Model):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


# --------------------------------------------------------------------------- messages


class ContentPart(Model):
    """One part of a multi-part message content; only ``type == "text"`` is served."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: str
    text: str | None = None


class ToolCallFunction(Model):
    name: str
    arguments: str = ""


class ToolCallParam(Model):
    """A tool call in an assistant message of the conversation."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(Model):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None


# --------------------------------------------------------------------------- tools


class FunctionDefinition(Model):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolParam(Model):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(Model):
    name: str = Field(min_length=1)


class NamedToolChoice(Model):
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice

# --------------------------------------------------------------------------- structured output


class JsonSchemaFormat(Model):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Model):
    """``{"type": "text" | "json_object" | "json_schema" | "structural_tag", ...}``."""

    model_config = ConfigDict(extra="allow", strict=True, validate_by_name=True,
                              validate_by_alias=True)

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type 'json_schema' needs a 'json_schema' field")
        return self


class StructuredOutputs(Model):
    """vLLM's ``structured_outputs`` request field (``StructuredOutputsParams``)."""

    json_: str | dict[str, Any] | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    def constraints(self) -> list[str]:
        """The names of the constraint fields that are set."""
        names = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
        values = (self.json_, self.regex, self.choice, self.grammar, self.json_object,
                  self.structural_tag)
        return [n for n, v in zip(names, values, strict=True) if v is not None]
