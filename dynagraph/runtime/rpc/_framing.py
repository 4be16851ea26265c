"""Wire format of the request plane: length-prefixed msgpack frames. Pure, no I/O.

Every frame is a 4-byte big-endian body length followed by a msgpack body. The body
is an array whose first element is the frame kind:

    REQUEST  [0, endpoint: str, headers: {str: str}, payload]     caller -> callee
    ITEM     [1, payload]                                         callee -> caller
    END      [2]                                                  callee -> caller
    ERROR    [3, remote_type: str, message: str, wire_type: str | None, extra: {str: ...}]
    CANCEL   [4]                                                  caller -> callee
    ALIVE    [5]                                                  callee -> caller

A connection carries one stream at a time: REQUEST, then ALIVE (the request was taken:
its handler starts), ITEM* (with ALIVE heartbeats while the handler is quiet), then END
or ERROR.
CANCEL may be sent by the caller at any point of a stream. The callee cancels the
handler and, once it is gone, ends the stream with END (ERROR if the handler raised
something else on its way out); a CANCEL that crossed the stream's END or ERROR is
ignored. Either way exactly one terminal frame follows, so the caller reads up to it
and reuses the connection (or closes it instead of waiting). Payloads are anything msgpack encodes; pydantic models are
encoded as ``model_dump(mode="python")`` and arrive as plain dicts. No pickle.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from typing import Any

import msgpack

from dynagraph.errors import (
    WIRE_ERRORS,
    DynagraphError,
    InstanceUnavailable,
    RemoteError,
    RequestPlaneError,
)

REQUEST = 0
ITEM = 1
END = 2
ERROR = 3
CANCEL = 4
ALIVE = 5

_LEN = struct.Struct(">I")
HEADER_BYTES = _LEN.size

# Errors the request plane itself sends on behalf of the callee (not raised by a handler),
# re-raised on the caller as their own type. InstanceUnavailable means "not processed".
_PLANE_ERRORS: dict[str, type[DynagraphError]] = {"InstanceUnavailable": InstanceUnavailable}

# Scalar attribute types of an exception that are copied across the wire (e.g. InvalidRequest.param).
_SCALARS = (str, int, float, bool, type(None))


class ProtocolError(RequestPlaneError):
    """The peer sent bytes that are not a valid frame sequence; the connection is dropped."""


def _default(obj: Any) -> Any:
    """msgpack hook for types it does not know: pydantic models, msgspec structs,
    dataclasses, enums, sets."""
    dump = getattr(obj, "model_dump", None)
    if dump is not None:
        return dump(mode="python")
    fields = getattr(obj, "__struct_fields__", None)
    if fields is not None:
        return {name: getattr(obj, name) for name in fields}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, set | frozenset):
        return list(obj)
    raise TypeError(f"cannot encode {type(obj).__name__} for the request plane (use msgpack "
                    "types or a pydantic model)")


class FrameEncoder:
    """Encodes frames to bytes (header included). One per connection; not thread-safe."""

    def __init__(self) -> None:
        self._pack = msgpack.Packer(default=_default).pack

    def request(self, endpoint: str, headers: dict[str, str], payload: Any) -> bytes:
        return self._frame((REQUEST, endpoint, headers, payload))

    def item(self, payload: Any) -> bytes:
        return self._frame((ITEM, payload))

    def append_item(self, out: bytearray, payload: Any) -> None:
        """Append an ITEM frame to ``out`` (the hot path: one copy less than ``item``)."""
        data = self._pack((ITEM, payload))
        out += _LEN.pack(len(data))
        out += data

    def end(self) -> bytes:
        return _END_FRAME

    def cancel(self) -> bytes:
        return _CANCEL_FRAME

    def alive(self) -> bytes:
        return _ALIVE_FRAME

    def error(self, exc: BaseException) -> bytes:
        return self._frame(error_body(exc))

    def plane_error(self, kind: type[DynagraphError], message: str) -> bytes:
        """An error frame sent by the plane itself, re-raised as ``kind`` by the caller."""
        name = kind.__name__
        return self._frame((ERROR, name, message, name, {}))

    def _frame(self, body: tuple[Any, ...]) -> bytes:
        data: bytes = self._pack(body)
        return _LEN.pack(len(data)) + data


def _static_frame(body: tuple[Any, ...]) -> bytes:
    data: bytes = msgpack.packb(body)
    return _LEN.pack(len(data)) + data


_END_FRAME = _static_frame((END,))
_CANCEL_FRAME = _static_frame((CANCEL,))
_ALIVE_FRAME = _static_frame((ALIVE,))


def error_body(exc: BaseException) -> tuple[Any, ...]:
    """The ERROR frame body for a handler exception.

    ``wire_type`` is the nearest class in the exception's MRO that is listed in
    ``WIRE_ERRORS`` (so a local subclass of InvalidRequest still arrives as one).
    """
    wire_type: str | None = None
    for cls in type(exc).__mro__:
        if WIRE_ERRORS.get(cls.__name__) is cls:
            wire_type = cls.__name__
            break
    extra: dict[str, Any] = {}
    if wire_type is not None:
        extra = {k: v for k, v in vars(exc).items() if isinstance(v, _SCALARS)}
    return (ERROR, type(exc).__name__, str(exc), wire_type, extra)


def error_from_frame(frame: list[Any]) -> Exception:
    """Rebuild the caller-side exception from an ERROR frame (see ``error_body``)."""
    try:
        _, remote_type, message, wire_type, extra = frame
    except ValueError:
        return ProtocolError(f"malformed error frame: {frame!r}")
    cls: type[DynagraphError] | None = None
    if isinstance(wire_type, str):
        cls = WIRE_ERRORS.get(wire_type) or _PLANE_ERRORS.get(wire_type)
    if cls is None:
        return RemoteError(str(remote_type), str(message))
    # Bypass __init__: wire error classes have different keyword-only constructor
    # arguments; restoring the message and the scalar attributes is what matters.
    exc = cls.__new__(cls)
    Exception.__init__(exc, str(message))
    if isinstance(extra, dict):
        exc.__dict__.update(extra)
    return exc


class FrameDecoder:
    """Accumulates received bytes and decodes complete frames one at a time.

    ``feed`` appends bytes; ``next`` returns the next decoded frame body (a list) or
    None when no complete frame is buffered. Raises ProtocolError on a frame larger
    than ``max_frame_bytes``, a body that is not exactly one msgpack value of the
    announced length, or a body that is not an array. After a ProtocolError the
    decoder is unusable (drop the connection).

    A streaming ``msgpack.Unpacker`` holds the bytes (decoding in C without copies);
    the 4-byte length is read with ``read_bytes`` and checked against ``tell()``.
    """

    def __init__(self, max_frame_bytes: int) -> None:
        self._max = max_frame_bytes
        self._unpacker = msgpack.Unpacker(
            strict_map_key=False, max_buffer_size=max_frame_bytes + _DECODER_SLACK)
        self._avail = 0  # bytes fed and not consumed (headers included)
        self._size: int | None = None  # body length once its header has been read

    @property
    def buffered(self) -> int:
        """Bytes received and not yet decoded."""
        return self._avail

    def feed(self, data: bytes) -> None:
        try:
            self._unpacker.feed(data)
        except msgpack.BufferFull as exc:
            raise ProtocolError(f"more than {self._max} bytes buffered without a "
                                "complete frame") from exc
        self._avail += len(data)

    def next(self) -> list[Any] | None:
        size = self._size
        unpacker = self._unpacker
        if size is None:
            if self._avail < HEADER_BYTES:
                return None
            (size,) = _LEN.unpack(unpacker.read_bytes(HEADER_BYTES))
            self._avail -= HEADER_BYTES
            if size > self._max:
                raise ProtocolError(f"frame of {size} bytes exceeds max_frame_bytes={self._max}")
            self._size = size
        if self._avail < size:
            return None
        start = unpacker.tell()
        try:
            frame = unpacker.unpack()
        except (ValueError, TypeError, msgpack.UnpackException, msgpack.OutOfData) as exc:
            raise ProtocolError(f"undecodable frame: {exc!r}") from exc
        if unpacker.tell() - start != size:
            raise ProtocolError(f"frame body is not one msgpack value of {size} bytes")
        self._avail -= size
        self._size = None
        if type(frame) is not list or not frame:
            raise ProtocolError(f"frame is not a non-empty array: {frame!r}")
        return frame


# Room in the unpacker's buffer beyond one maximal frame: the unread part of a socket read.
_DECODER_SLACK = 4 << 20
