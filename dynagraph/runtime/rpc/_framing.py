"""Wire format of the request plane: length-prefixed msgpack frames. Pure, no I/O.

Every frame is a 4-byte big-endian body length followed by a msgpack body. The body
is an array: the frame kind, then the id of the stream it belongs to (``sid``, chosen
by the caller, unique among the open streams of its connection):

    REQUEST  [0, sid, endpoint: str, headers: {str: str}, payload]   caller -> callee
    ITEM     [1, sid, payload]                                       callee -> caller
    END      [2, sid]                                                callee -> caller
    ERROR    [3, sid, remote_type: str, message: str, wire_type: str | None, extra: {str: ...}]
    CANCEL   [4, sid]                                                caller -> callee
    ALIVE    [5, sid]                                                callee -> caller
    CREDIT   [6, sid, nbytes: int]                                   caller -> callee

A connection carries many streams at once, their frames interleaved. A stream is
REQUEST, then ALIVE (the request was taken: its handler starts), ITEM* (with ALIVE
heartbeats while the handler is quiet), then END or ERROR, after which its sid may be
used again. Flow control is per stream: the callee stops asking the handler for items
while the ITEM bytes it sent (headers included) and the caller has not yet credited
reach a window; the caller sends CREDIT for the bytes its reader has taken.

CANCEL may be sent by the caller at any point of a stream. The callee cancels the
handler and, once it is gone, ends the stream with END (ERROR if the handler raised
something else on its way out); a CANCEL (or CREDIT) that crossed the stream's END or
ERROR is ignored. Either way exactly one terminal frame follows, so the caller can
forget the sid. Payloads are anything msgpack encodes; msgspec Structs are encoded as
``msgspec.to_builtins`` makes them (fields at their defaults left out where the Struct
says ``omit_defaults``) and pydantic models as ``model_dump(mode="python")``; both arrive
as plain dicts. No pickle.
"""

from __future__ import annotations

import dataclasses
import enum
import struct
from collections.abc import Sequence
from typing import Any

import msgpack
import msgspec

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
CREDIT = 6

STREAM_WINDOW = 256 * 1024
"""ITEM bytes a callee may have sent on a stream, not yet credited by the caller, before
it holds the stream's handler (both sides size their buffers by it)."""

_LEN = struct.Struct(">I")
HEADER_BYTES = _LEN.size

# Errors the request plane itself sends on behalf of the callee (not raised by a handler),
# re-raised on the caller as their own type. InstanceUnavailable means "not processed".
_PLANE_ERRORS: dict[str, type[DynagraphError]] = {"InstanceUnavailable": InstanceUnavailable}

_RAW = (bytes, bytearray, memoryview)
"""Left as they are by ``to_builtins`` (msgpack carries them as bin)."""

# Scalar attribute types of an exception that are copied across the wire (e.g. InvalidRequest.param).
_SCALARS = (str, int, float, bool, type(None))


class ProtocolError(RequestPlaneError):
    """The peer sent bytes that are not a valid frame sequence; the connection is dropped."""


def _default(obj: Any) -> Any:
    """msgpack hook for types it does not know: pydantic models, msgspec structs,
    dataclasses, enums, sets."""
    if isinstance(obj, msgspec.Struct):
        return msgspec.to_builtins(obj, builtin_types=_RAW)
    dump = getattr(obj, "model_dump", None)
    if dump is not None:
        return dump(mode="python")
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

    def request_tail(self, endpoint: str, headers: dict[str, str], payload: Any) -> bytes:
        """A REQUEST body without its kind and sid (``request`` completes it): encoded
        when the call is made, before its connection and sid are known."""
        pack = self._pack
        tail: bytes = pack(endpoint) + pack(headers) + pack(payload)
        return tail

    def request(self, sid: int, tail: bytes) -> bytes:
        data: bytes = _REQUEST_HEAD + self._pack(sid) + tail
        return _LEN.pack(len(data)) + data

    def item(self, sid: int, payload: Any) -> bytes:
        return self._frame((ITEM, sid, payload))

    def append_item(self, out: bytearray, sid: int, payload: Any) -> int:
        """Append an ITEM frame to ``out`` (the hot path: one copy less than ``item``);
        returns its size, header included."""
        data = self._pack((ITEM, sid, payload))
        out += _LEN.pack(len(data))
        out += data
        return len(data) + HEADER_BYTES

    def end(self, sid: int) -> bytes:
        return self._frame((END, sid))

    def cancel(self, sid: int) -> bytes:
        return self._frame((CANCEL, sid))

    def alive(self, sid: int) -> bytes:
        return self._frame((ALIVE, sid))

    def credit(self, sid: int, nbytes: int) -> bytes:
        return self._frame((CREDIT, sid, nbytes))

    def error(self, sid: int, exc: BaseException) -> bytes:
        return self._frame((ERROR, sid, *error_body(exc)))

    def plane_error(self, sid: int, kind: type[DynagraphError], message: str) -> bytes:
        """An error frame sent by the plane itself, re-raised as ``kind`` by the caller."""
        name = kind.__name__
        return self._frame((ERROR, sid, name, message, name, {}))

    def _frame(self, body: tuple[Any, ...]) -> bytes:
        data: bytes = self._pack(body)
        return _LEN.pack(len(data)) + data


# A 5-element array, then REQUEST (a positive fixint): how every REQUEST body begins.
_REQUEST_HEAD = b"\x95" + msgpack.packb(REQUEST)


def error_body(exc: BaseException) -> tuple[str, str, str | None, dict[str, Any]]:
    """An ERROR frame's fields after its sid, for a handler exception:
    ``(remote_type, message, wire_type, extra)``.

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
    return (type(exc).__name__, str(exc), wire_type, extra)


def error_from_body(body: Sequence[Any]) -> Exception:
    """Rebuild the caller-side exception from an ERROR frame's fields after its sid
    (``error_body``'s tuple)."""
    try:
        remote_type, message, wire_type, extra = body
    except ValueError:
        return ProtocolError(f"malformed error frame: {list(body)!r}")
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
        self.last_size = 0
        """The size of the frame ``next`` returned last, header included."""

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
        self.last_size = size + HEADER_BYTES
        if type(frame) is not list or not frame:
            raise ProtocolError(f"frame is not a non-empty array: {frame!r}")
        return frame


# Room in the unpacker's buffer beyond one maximal frame: the unread part of a socket read.
_DECODER_SLACK = 4 << 20
