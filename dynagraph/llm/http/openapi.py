"""The OpenAPI document of the HTTP API (``/openapi.json``), built from the request
models the app validates with, so a schema-driven fuzzer tests what is really served."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from dynagraph.llm.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

_BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}
_ERROR = {"$ref": "#/components/schemas/ErrorResponse"}
_ERROR_SCHEMA = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}
_STATUSES = {"400": "invalid request", "404": "unknown model or route",
             "413": "body too large", "429": "too many requests (Retry-After)",
             "503": "no worker ready (Retry-After)"}


def openapi_document(routes: dict[str, list[str]], *, title: str = "dynagraph",
                     version: str = "1") -> dict[str, Any]:
    """OpenAPI 3.1 for ``routes`` (path -> methods), request bodies from the models."""
    schemas: dict[str, Any] = {"ErrorResponse": _ERROR_SCHEMA}
    paths: dict[str, Any] = {}
    for path, methods in sorted(routes.items()):
        ops: dict[str, Any] = {}
        for method in methods:
            op: dict[str, Any] = {"responses": {
                "200": {"description": "OK", "content": {"application/json": {}}}}}
            model = _BODIES.get(path)
            if model is not None and method == "POST":
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(schema.pop("$defs", {}))
                schemas[model.__name__] = schema
                op["requestBody"] = {"required": True, "content": {"application/json": {
                    "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
                if path.startswith("/v1/"):
                    op["responses"]["200"]["content"]["text/event-stream"] = {}
                for status, what in _STATUSES.items():
                    op["responses"][status] = {"description": what, "content": {
                        "application/json": {"schema": _ERROR}}}
            ops[method.lower()] = op
        paths[path] = ops
    return {"openapi": "3.1.0", "info": {"title": title, "version": version},
            "paths": paths, "components": {"schemas": schemas}}
