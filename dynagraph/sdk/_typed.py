"""Wire values to an endpoint's declared types, once per hop. Pure, no I/O.

A request-plane payload arrives as plain msgpack values (a dict for a Struct); the
callee's SDK decodes the request into the endpoint's request type and the caller's
client decodes each item into the endpoint's item type (``EndpointSpec``). A value that
is already of the type (an embedded callee hands its items over without the socket) is
passed through as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
from pydantic import BaseModel, ValidationError


def decoder(kind: type | None, where: str, error: Callable[[str, str | None], Exception]
            ) -> Callable[[Any], Any]:
    """``value -> kind`` (identity for ``None``); a value that does not fit raises
    ``error(message, field)``, the message naming ``where`` and the field."""
    if kind is None:
        return _identity
    if issubclass(kind, BaseModel):
        model: type[BaseModel] = kind

        def from_pydantic(value: Any) -> Any:
            if isinstance(value, model):
                return value
            try:
                return model.model_validate(value)
            except ValidationError as exc:
                err = exc.errors()[0]
                loc = ".".join(str(p) for p in err["loc"])
                raise error(f"{where}: {loc}: {err['msg']}", loc or None) from None

        return from_pydantic

    def from_struct(value: Any) -> Any:
        if isinstance(value, kind):
            return value
        try:
            return msgspec.convert(value, kind)
        except msgspec.ValidationError as exc:
            raise error(f"{where}: {exc}", None) from None

    return from_struct


def _identity(value: Any) -> Any:
    return value
