"""The few ASGI pieces the Frontend needs, without a web framework on the token path.

``App`` routes ``(method, path)`` to a handler ``async (Request) -> Response``; an
unknown path is a 404 and a known path with another method a 405 (with ``Allow``),
both as OpenAI error objects. ``Request.body(limit)`` reads the body and raises
:class:`BodyTooLarge` past ``limit`` bytes (announced by ``content-length`` or not), so
a client cannot make the server buffer an unbounded body. ``Response`` sends one
complete body; streaming responses live in ``sse``.

Starlette's middleware stack was about 40% of the Frontend's busy time per token;
this is a dictionary lookup and two ``send`` calls.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from types import SimpleNamespace
from typing import Any

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class BodyTooLarge(Exception):
    """The request body is longer than the limit the handler allows."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the request body is larger than {limit} bytes")
        self.limit = limit


class Request:
    """One HTTP request: method, path, lower-cased headers, and its body on demand."""

    __slots__ = ("scope", "receive", "method", "path", "headers")

    def __init__(self, scope: Scope, receive: Receive) -> None:
        self.scope = scope
        self.receive = receive
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.headers: dict[str, str] = {k.decode("latin-1").lower(): v.decode("latin-1")
                                        for k, v in scope.get("headers", ())}

    async def body(self, limit: int) -> bytes:
        """The whole body; :class:`BodyTooLarge` as soon as it passes ``limit`` bytes."""
        declared = self.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise BodyTooLarge(limit)
        parts: list[bytes] = []
        size = 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(limit)
            parts.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(parts)


class Response:
    """A complete response."""

    def __init__(self, body: bytes = b"", status: int = 200, *,
                 headers: Mapping[str, str] | None = None,
                 media_type: str | None = None) -> None:
        self.body = body
        self.status = status
        self.headers = dict(headers or {})
        if media_type is not None:
            self.headers["content-type"] = media_type

    @property
    def status_code(self) -> int:
        return self.status

    def raw_headers(self, extra: Iterable[tuple[str, str]] = ()) -> list[tuple[bytes, bytes]]:
        return [(k.lower().encode("latin-1"), v.encode("latin-1"))
                for k, v in [*self.headers.items(), *extra]]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status,
                    "headers": self.raw_headers([("content-length", str(len(self.body)))])})
        await send({"type": "http.response.body", "body": self.body})


Handler = Callable[[Request], Awaitable[Response]]
ErrorFactory = Callable[[int, str, Mapping[str, str]], Response]


class App:
    """An ASGI app of exact routes. ``state`` holds whatever the builder wants to expose."""

    def __init__(self, on_error: ErrorFactory) -> None:
        self._routes: dict[str, dict[str, Handler]] = {}
        self._on_error = on_error
        self.state = SimpleNamespace()

    def route(self, method: str, path: str) -> Callable[[Handler], Handler]:
        def register(handler: Handler) -> Handler:
            self._routes.setdefault(path, {})[method.upper()] = handler
            return handler

        return register

    @property
    def routes(self) -> dict[str, list[str]]:
        """path -> its methods (for the OpenAPI document and tests)."""
        return {path: sorted(methods) for path, methods in self._routes.items()}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        methods = self._routes.get(scope["path"])
        method = scope["method"]
        if methods is None:
            response = self._on_error(404, f"{method} {scope['path']}: not found", {})
        elif method not in methods and not (method == "HEAD" and "GET" in methods):
            response = self._on_error(405, f"{method} {scope['path']}: method not allowed",
                                      {"allow": ", ".join(sorted(methods))})
        else:
            handler = methods.get(method) or methods["GET"]
            response = await handler(Request(scope, receive))
        await response(scope, receive, send)


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
