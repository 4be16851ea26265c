"""Exceptions -> OpenAI error objects with the right HTTP status."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import msgspec
from pydantic import ValidationError

from dynagraph.errors import (
    InstanceUnavailable,
    InvalidRequest,
    NoInstancesError,
    RemoteError,
    RequestShed,
)
from dynagraph.llm.http.asgi import Response
from dynagraph.llm.protocol import ErrorInfo, ErrorResponse

log = logging.getLogger(__name__)

_encode = msgspec.json.Encoder().encode

# pydantic puts union member names into error locations; they are not request fields.
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "function-after"})


class HTTPError(Exception):
    """An error with a fixed status and OpenAI error body, raised inside the app."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = dict(headers or {})


def error_body(info: ErrorInfo) -> ErrorResponse:
    return ErrorResponse(error=info)


def json_response(
    status: int, content: msgspec.Struct, headers: Mapping[str, str] | None = None
) -> Response:
    return Response(_encode(content), status, headers=headers, media_type="application/json")


def error_response(
    status: int, info: ErrorInfo, headers: Mapping[str, str] | None = None
) -> Response:
    return json_response(status, ErrorResponse(error=info), headers)


def from_validation_error(exc: ValidationError) -> HTTPError:
    """A 400 naming the first offending field (dotted path, e.g. ``messages.0.role``)."""
    first = exc.errors(include_url=False)[0]
    if first["type"] == "json_invalid":
        return HTTPError(400, f"the request body is not valid JSON: {first['msg']}")
    parts: list[str] = []
    for item in first["loc"]:
        if isinstance(item, int):
            parts.append(str(item))
        elif item.isidentifier() and item not in _UNION_TAGS:
            parts.append(item)
        else:
            break
    param = ".".join(parts) or None
    message = first["msg"]
    if message.startswith("Value error, "):
        message = message[len("Value error, ") :]
    if first["type"] == "model_type":
        message = "the request body must be a JSON object"
    return HTTPError(400, f"{param}: {message}" if param else message, param=param)


def from_exception(exc: BaseException) -> HTTPError:
    """Map an error raised by the backend to its HTTP status and OpenAI error."""
    if isinstance(exc, HTTPError):
        return exc
    if isinstance(exc, RequestShed):
        return HTTPError(429, str(exc), type="rate_limit_exceeded", code=exc.code,
                         headers={"retry-after": str(max(1, int(exc.retry_after)))})
    if isinstance(exc, InvalidRequest) and (exc.code == "forged_tenant"):
        return HTTPError(403, str(exc), type="permission_error", param=exc.param, code=exc.code)
    if isinstance(exc, InvalidRequest):
        status = 404 if exc.code == "model_not_found" else 400
        return HTTPError(status, str(exc), param=exc.param, code=exc.code)
    if isinstance(exc, NoInstancesError | InstanceUnavailable):
        return HTTPError(
            503,
            f"no model worker is available: {exc}",
            type="service_unavailable",
            code="no_instances",
        )
    if isinstance(exc, RemoteError) and exc.remote_type in ("InvalidRequest", "PromptTooLong"):
        return HTTPError(400, exc.remote_message)
    if isinstance(exc, RemoteError) and exc.remote_type == "NoInstancesError":
        return HTTPError(503, exc.remote_message, type="service_unavailable", code="no_instances")
    log.error("request failed: %s: %s", type(exc).__name__, exc)
    return HTTPError(500, f"{type(exc).__name__}: {exc}", type="internal_server_error")
