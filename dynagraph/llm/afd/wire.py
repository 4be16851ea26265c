"""The AFD wire format: typed msgpack headers plus raw tensor bytes, over a stream socket.

Every frame is ``u32 header length (big endian) | msgpack header | payload``; the header
says how many payload bytes follow (``nbytes``, 0 when the tensor travels in shared
memory instead). Tensors are raw row-major bytes of the model's dtype, never pickled.

A connection starts with ``Hello`` (client -> FfnWorker) and ``Welcome`` (the answer:
what the worker serves, or why it refuses). Then the client sends ``FfnCall`` frames
and the worker answers each with one ``FfnResult``, in order. A client may send
several calls before reading their results (micro-batch ping-pong); the worker reads
its socket independently of writing, so this cannot deadlock on full socket buffers.

Blocking sockets on purpose: the caller is vLLM's synchronous forward pass (engine side)
or a dedicated server thread (FfnWorker side).
"""

from __future__ import annotations

import socket
import struct
from typing import Any

import msgspec
import torch

from dynagraph.llm.afd.errors import ChannelError

PROTOCOL_VERSION = 1
_LEN = struct.Struct(">I")
MAX_HEADER_BYTES = 1 << 16

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"AFD does not carry tensors of dtype {dtype}")


class Hello(msgspec.Struct, tag="hello", forbid_unknown_fields=True):
    """First frame of a connection (engine -> FfnWorker)."""

    version: int
    model: str
    """The served model's name (its directory name), checked by the worker."""
    hidden_size: int
    dtype: str
    client: str
    """Who connects (for logs), e.g. ``engine-1234``."""
    shm_bytes: int = 0
    """Size of the shared-memory region whose file descriptor rides along with this
    frame (``SCM_RIGHTS``), 0 for none."""


class Welcome(msgspec.Struct, tag="welcome", forbid_unknown_fields=True):
    """The worker's answer to ``Hello``."""

    ok: bool
    error: str | None = None
    instance: str = ""
    layers: list[int] = msgspec.field(default_factory=list)
    experts: list[int] | None = None
    """The experts this worker holds (expert parallel), None for all of them."""


class FfnCall(msgspec.Struct, tag="call", forbid_unknown_fields=True):
    """Compute layer ``layer``'s FFN on ``rows`` hidden-state rows."""

    seq: int
    layer: int
    rows: int
    nbytes: int = 0
    """Inline payload bytes following the header (0: the input is in shared memory)."""
    shm_in: int = -1
    """Offset of the input rows in shared memory (-1: inline)."""
    shm_out: int = -1
    """Where the worker writes the output rows in shared memory (-1: inline)."""


class FfnResult(msgspec.Struct, tag="result", forbid_unknown_fields=True):
    """The FFN output for call ``seq`` (or the error that prevented it)."""

    seq: int
    rows: int
    nbytes: int = 0
    error: str | None = None
    compute_us: int = 0
    """Time the worker spent computing, for the exchange-latency breakdown."""


Message = Hello | Welcome | FfnCall | FfnResult

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy byte view of a contiguous CPU tensor."""
    array: Any = tensor.contiguous().view(torch.uint8).numpy()
    return memoryview(array).cast("B")


def send_frame(sock: socket.socket, header: Message, payload: memoryview | None = None,
               fds: list[int] | None = None) -> None:
    """Send one frame (header and optional payload, optional file descriptors)."""
    head = _encoder.encode(header)
    parts: list[Any] = [_LEN.pack(len(head)) + head]
    if payload is not None and len(payload):
        parts.append(payload)
    try:
        if fds:
            sent = socket.send_fds(sock, parts[:1], fds)
            _send_rest(sock, parts, sent)
        else:
            sent = sock.sendmsg(parts)
            _send_rest(sock, parts, sent)
    except (OSError, TimeoutError) as exc:
        raise ChannelError(f"send failed: {exc}") from exc


def _send_rest(sock: socket.socket, parts: list[Any], sent: int) -> None:
    """``sendmsg`` may send less than everything on a blocking socket too."""
    total = sum(len(p) for p in parts)
    if sent >= total:
        return
    for part in parts:
        view = memoryview(part).cast("B")
        if sent >= len(view):
            sent -= len(view)
            continue
        sock.sendall(view[sent:])
        sent = 0


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from the socket; EOF or a timeout raise ChannelError."""
    got = 0
    n = len(view)
    try:
        while got < n:
            k = sock.recv_into(view[got:], n - got)
            if k == 0:
                raise ChannelError("connection closed by peer")
            got += k
    except (OSError, TimeoutError) as exc:
        raise ChannelError(f"receive failed: {exc}") from exc


def recv_header(sock: socket.socket, *, with_fds: bool = False) -> tuple[Message, list[int]]:
    """Read one frame's header (its payload, if any, is left for the caller to read
    into the right place). With ``with_fds`` also collects descriptors sent along."""
    fds: list[int] = []
    prefix = bytearray(_LEN.size)
    if with_fds:
        try:
            data, fds, _flags, _addr = socket.recv_fds(sock, _LEN.size, 4)
        except (OSError, TimeoutError) as exc:
            raise ChannelError(f"receive failed: {exc}") from exc
        if not data:
            raise ChannelError("connection closed by peer")
        prefix[: len(data)] = data
        if len(data) < _LEN.size:
            recv_exact(sock, memoryview(prefix)[len(data):])
    else:
        recv_exact(sock, memoryview(prefix))
    (size,) = _LEN.unpack(prefix)
    if size > MAX_HEADER_BYTES:
        raise ChannelError(f"header of {size} bytes is larger than {MAX_HEADER_BYTES}")
    head = bytearray(size)
    recv_exact(sock, memoryview(head))
    try:
        return _decoder.decode(head), fds
    except msgspec.DecodeError as exc:
        raise ChannelError(f"malformed AFD frame: {exc}") from exc


def recv_tensor(sock: socket.socket, rows: int, hidden: int, dtype: torch.dtype,
                nbytes: int) -> torch.Tensor:
    """Read an inline payload of ``rows x hidden`` elements straight into a new tensor."""
    out = torch.empty((rows, hidden), dtype=dtype)
    if out.numel() * out.element_size() != nbytes:
        raise ChannelError(f"payload of {nbytes} bytes does not hold {rows}x{hidden} {dtype}")
    if nbytes:
        recv_exact(sock, tensor_bytes(out))
    return out


def skip_payload(sock: socket.socket, nbytes: int) -> None:
    """Read and drop ``nbytes`` (a payload that has nowhere to go)."""
    buf = bytearray(min(nbytes, 1 << 20))
    while nbytes > 0:
        view = memoryview(buf)[: min(nbytes, len(buf))]
        recv_exact(sock, view)
        nbytes -= len(view)
