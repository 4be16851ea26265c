"""One engine-side connection to one FfnWorker: the transports behind one interface.

``FfnChannel.submit(layer, hidden)`` sends one layer's hidden states and returns at once
(a sequence number); ``collect(seq)`` blocks until that call's FFN output is back. Two
submits before the first collect is the micro-batch ping-pong: the worker computes the
first while the engine computes the second micro-batch's attention.

Transports (``Transport``):

- ``tcp``: header and tensor bytes inline on a TCP connection (TCP_NODELAY). Works
  across hosts.
- ``shm``: same host only. The engine creates an anonymous shared-memory region
  (``memfd_create``) with ``slots`` input/output areas of ``max_rows`` rows each and
  hands its file descriptor to the worker over a Unix socket (``SCM_RIGHTS``) in the
  handshake: no name to clean up, the memory goes when both sides close it. Calls then
  carry only a small header on the Unix socket; the worker reads the rows in place and
  writes its output into the call's output area. A call larger than an area travels
  inline on the same socket.

Every blocking wait has ``timeout_s``; a broken, refused or timed-out connection raises
``ChannelError`` and the channel is unusable afterwards (the connector drops it and
retries the call on another replica).
"""

from __future__ import annotations

import itertools
import mmap
import os
import socket
import time
from collections import deque
from dataclasses import dataclass
from typing import Literal

import torch

from dynagraph.llm.afd.errors import AfdError, ChannelError
from dynagraph.llm.afd.wire import (
    PROTOCOL_VERSION,
    FfnCall,
    FfnResult,
    Hello,
    Welcome,
    dtype_name,
    recv_header,
    recv_tensor,
    send_frame,
    skip_payload,
    tensor_bytes,
)

Transport = Literal["tcp", "shm"]


@dataclass(frozen=True)
class Endpoint:
    """Where one FfnWorker listens."""

    instance: str
    tcp: str
    """``host:port`` of its TCP listener."""
    uds: str | None = None
    """Its Unix socket (Linux abstract name, written with a leading ``@``), for ``shm``."""
    host_id: str = ""
    """The worker's boot id: ``shm`` needs the same host (``same_host``)."""


def uds_address(name: str) -> str | bytes:
    """``@name`` is a Linux abstract socket (no file), anything else a path."""
    return b"\0" + name[1:].encode() if name.startswith("@") else name


def _split_hostport(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


@dataclass
class _Pending:
    seq: int
    rows: int
    slot: int | None
    sent_at: float


class FfnChannel:
    """A connection to one FfnWorker (not thread-safe: one forward pass at a time)."""

    def __init__(self, endpoint: Endpoint, transport: Transport, *, model: str,
                 hidden_size: int, dtype: torch.dtype, client: str, max_rows: int,
                 slots: int = 2, timeout_s: float = 10.0) -> None:
        self.endpoint = endpoint
        self.transport = transport
        self.model = model
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.client = client
        self.timeout_s = timeout_s
        self._row_bytes = hidden_size * torch.empty((), dtype=dtype).element_size()
        self._max_rows = max_rows
        self._slots = slots
        self._sock: socket.socket | None = None
        self._mm: mmap.mmap | None = None
        self._free_slots: list[int] = []
        self._seq = itertools.count(1)
        self._pending: deque[_Pending] = deque()
        self._done: dict[int, tuple[torch.Tensor, int]] = {}
        self.welcome: Welcome | None = None
        self.broken: str | None = None

    # ------------------------------------------------------------------ set-up

    def connect(self) -> Welcome:
        """Connect and handshake; raises ChannelError (unreachable) or AfdError (refused)."""
        fds: list[int] = []
        shm_bytes = 0
        try:
            if self.transport == "shm":
                if not self.endpoint.uds:
                    raise ChannelError(f"FfnWorker {self.endpoint.instance} has no Unix socket")
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(self.timeout_s)
                sock.connect(uds_address(self.endpoint.uds))
                shm_bytes = 2 * self._slots * self._max_rows * self._row_bytes
                fd = os.memfd_create(f"dynagraph-afd-{self.client}", os.MFD_CLOEXEC)
                try:
                    os.ftruncate(fd, shm_bytes)
                    self._mm = mmap.mmap(fd, shm_bytes)
                    fds = [fd]
                except BaseException:
                    os.close(fd)
                    raise
                self._free_slots = list(range(self._slots))
            else:
                sock = socket.create_connection(_split_hostport(self.endpoint.tcp),
                                                timeout=self.timeout_s)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as exc:
            self.close()
            raise ChannelError(f"cannot reach FfnWorker {self.endpoint.instance} "
                               f"({self.transport}): {exc}") from exc
        self._sock = sock
        try:
            send_frame(sock, Hello(version=PROTOCOL_VERSION, model=self.model,
                                   hidden_size=self.hidden_size, dtype=dtype_name(self.dtype),
                                   client=self.client, shm_bytes=shm_bytes), fds=fds)
        finally:
            for fd in fds:  # the worker has its own copy now; the mapping keeps ours alive
                os.close(fd)
        try:
            msg, _ = recv_header(sock)
        except ChannelError:
            self.close()
            raise
        if not isinstance(msg, Welcome):
            self.close()
            raise ChannelError(f"FfnWorker {self.endpoint.instance} answered {type(msg).__name__}")
        if not msg.ok:
            self.close()
            raise AfdError(f"FfnWorker {self.endpoint.instance} refused the connection: "
                           f"{msg.error}")
        self.welcome = msg
        return msg

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # a tensor still views it; the GC frees it later
                pass
        self._pending.clear()
        self._done.clear()

    @property
    def connected(self) -> bool:
        return self._sock is not None

    @property
    def in_flight(self) -> int:
        return len(self._pending)

    # ------------------------------------------------------------------ calls

    def _fail(self, exc: ChannelError) -> ChannelError:
        self.broken = str(exc)
        self.close()
        return ChannelError(f"FfnWorker {self.endpoint.instance}: {exc}")

    def _area(self, slot: int, output: bool, rows: int) -> memoryview:
        """The bytes of a slot's input or output area holding ``rows`` rows. Copies in
        and out of it are plain ``memcpy`` (memoryview assignment), not torch copies,
        which may fan out over OpenMP threads and stall on a busy machine."""
        assert self._mm is not None
        cap = self._max_rows * self._row_bytes
        start = (2 * slot + int(output)) * cap
        return memoryview(self._mm)[start:start + rows * self._row_bytes]

    def submit(self, layer: int, hidden: torch.Tensor) -> int:
        """Send layer ``layer``'s FFN input (rows x hidden); returns the call's seq."""
        sock = self._sock
        if sock is None:
            raise ChannelError(f"FfnWorker {self.endpoint.instance}: not connected "
                               f"({self.broken or 'closed'})")
        rows = int(hidden.shape[0])
        seq = next(self._seq)
        slot = None
        if self._mm is not None and rows <= self._max_rows and self._free_slots:
            slot = self._free_slots.pop()
            self._area(slot, False, rows)[:] = tensor_bytes(hidden.to(self.dtype))
            cap = self._max_rows * self._row_bytes
            call = FfnCall(seq=seq, layer=layer, rows=rows, shm_in=2 * slot * cap,
                           shm_out=(2 * slot + 1) * cap)
            payload = None
        else:
            payload = tensor_bytes(hidden.to(self.dtype))
            call = FfnCall(seq=seq, layer=layer, rows=rows, nbytes=len(payload))
        try:
            send_frame(sock, call, payload)
        except ChannelError as exc:
            raise self._fail(exc) from exc
        self._pending.append(_Pending(seq, rows, slot, time.perf_counter()))
        return seq

    def collect(self, seq: int) -> tuple[torch.Tensor, int]:
        """Block until call ``seq``'s output is back: (rows x hidden tensor, worker
        compute time in us). Results arrive in submission order."""
        while seq not in self._done:
            self._read_one()
        return self._done.pop(seq)

    def _read_one(self) -> None:
        sock = self._sock
        if sock is None or not self._pending:
            raise ChannelError(f"FfnWorker {self.endpoint.instance}: nothing to collect "
                               f"({self.broken or 'closed'})")
        pending = self._pending[0]
        try:
            msg, _ = recv_header(sock)
            if not isinstance(msg, FfnResult) or msg.seq != pending.seq:
                raise ChannelError(f"unexpected frame {msg!r} (waiting for {pending.seq})")
            if msg.error is not None:
                skip_payload(sock, msg.nbytes)
                self._pending.popleft()
                self._release(pending)
                raise AfdError(f"FfnWorker {self.endpoint.instance} failed layer call "
                               f"{pending.seq}: {msg.error}")
            if msg.nbytes:
                out = recv_tensor(sock, msg.rows, self.hidden_size, self.dtype, msg.nbytes)
            else:
                if pending.slot is None:
                    raise ChannelError("result without payload for an inline call")
                out = torch.empty((msg.rows, self.hidden_size), dtype=self.dtype)
                tensor_bytes(out)[:] = self._area(pending.slot, True, msg.rows)
        except ChannelError as exc:
            raise self._fail(exc) from exc
        self._pending.popleft()
        self._release(pending)
        self._done[pending.seq] = (out, msg.compute_us)

    def _release(self, pending: _Pending) -> None:
        if pending.slot is not None:
            self._free_slots.append(pending.slot)
