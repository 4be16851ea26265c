"""The FfnWorker's data plane: serves "hidden states in, FFN out" to many engines.

``FfnServer`` listens on TCP (any host) and on a Linux abstract Unix socket (same host,
the ``shm`` transport) and runs, per connection, a reader thread (reads a call,
computes it, replies) and a writer thread for large results, so a client that sends its
next micro-batch before reading the previous result never deadlocks on full socket
buffers. Results up to ``DIRECT_REPLY_BYTES`` (a decode step's) go out from the reader
itself when nothing is queued, without a thread switch. Computations from all
connections are serialised by one lock: the kernels use the process's intra-op threads.

What is computed is behind ``FfnCompute`` (``dynagraph.llm.afd.ffn`` builds vLLM's own
FFN / MoE modules; tests pass a plain function). The server is synchronous threads on
purpose: it sits beside the FfnWorker's asyncio loop without touching it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from dynagraph.llm.afd import wire
from dynagraph.llm.afd.channel import uds_address
from dynagraph.llm.afd.errors import ChannelError

log = logging.getLogger(__name__)

DIRECT_REPLY_BYTES = 64 * 1024
"""Results up to this size go out from the reader thread: with at most a few calls in
flight per connection they fit the socket buffer, so that send cannot block for long."""

_Outbox = queue.Queue[tuple[wire.FfnResult, memoryview | None] | None]


class _Replies:
    """Sends one connection's results in order: small ones directly, the rest (or any
    behind a queued one) through the writer thread."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.outbox: _Outbox = queue.Queue()
        self.lock = threading.Lock()
        self.queued = 0

    def send(self, result: wire.FfnResult, payload: memoryview | None) -> None:
        size = 0 if payload is None else len(payload)
        with self.lock:
            if self.queued == 0 and size <= DIRECT_REPLY_BYTES:
                wire.send_frame(self.conn, result, payload)
                return
            self.queued += 1
        self.outbox.put((result, payload))

    def write_loop(self) -> None:
        while True:
            item = self.outbox.get()
            if item is None:
                return
            try:
                with self.lock:
                    wire.send_frame(self.conn, *item)
                    self.queued -= 1
            except ChannelError:
                with contextlib.suppress(OSError):
                    self.conn.shutdown(socket.SHUT_RDWR)
                return


class FfnCompute(Protocol):
    """The FFN an FfnWorker serves."""

    model: str
    hidden_size: int
    dtype: torch.dtype
    layers: list[int]
    experts: list[int] | None
    """Expert ids held (expert parallel: the output is this worker's partial sum), or
    None when every expert / the whole FFN of each layer is here."""

    def forward(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """FFN output of ``layer`` for ``hidden`` (rows x hidden_size); pure."""
        ...


@dataclass
class ServerStats:
    """Counters read by the FfnWorker's metrics (updated under the compute lock)."""

    calls: int = 0
    rows: int = 0
    compute_seconds: float = 0.0
    connections: int = 0
    """Engine connections open now."""
    errors: int = 0
    per_layer_calls: dict[int, int] = field(default_factory=dict)


class FfnServer:
    """Serves ``compute`` on TCP ``host:0`` and the abstract socket ``@{uds_name}``."""

    def __init__(self, compute: FfnCompute, *, host: str = "127.0.0.1",
                 uds_name: str | None = None, instance: str = "",
                 io_timeout_s: float = 30.0) -> None:
        self.compute = compute
        self.host = host
        self.instance = instance
        self.uds_name = uds_name or f"dynagraph-afd-{os.getpid()}-{id(self):x}"
        self.io_timeout_s = io_timeout_s
        self.stats = ServerStats()
        self._lock = threading.Lock()
        self._listeners: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._stopping = threading.Event()
        self._ids = itertools.count(1)
        self.tcp_address = ""

    @property
    def uds_address(self) -> str:
        """The abstract socket's name as published (``@name``)."""
        return f"@{self.uds_name}"

    def start(self) -> None:
        """Bind both listeners and start accepting (returns at once)."""
        tcp = socket.create_server((self.host, 0))
        host, port = tcp.getsockname()[:2]
        self.tcp_address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        uds = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        uds.bind(uds_address(self.uds_address))
        uds.listen(64)
        self._listeners = [tcp, uds]
        for sock, kind in ((tcp, "tcp"), (uds, "shm")):
            self._spawn(self._accept_loop, sock, kind, name=f"afd-accept-{kind}")
        log.info("FFN server for layers %s%s listening on tcp %s and %s", self.compute.layers,
                 "" if self.compute.experts is None else f" experts {self.compute.experts}",
                 self.tcp_address, self.uds_address)

    def stop(self, timeout: float = 5.0) -> None:
        """Close the listeners and every connection; join the threads."""
        self._stopping.set()
        for sock in self._listeners:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()
        with self._conns_lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------ internals

    def _spawn(self, target: Callable[..., None], *args: object, name: str) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(t)
        t.start()

    def _accept_loop(self, listener: socket.socket, kind: str) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            if kind == "tcp":
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(self.io_timeout_s)
            self._spawn(self._serve, conn, kind, name=f"afd-conn-{next(self._ids)}")

    def _welcome(self, hello: wire.Hello) -> wire.Welcome:
        c = self.compute
        problems = []
        if hello.version != wire.PROTOCOL_VERSION:
            problems.append(
                f"protocol {hello.version} (this worker speaks {wire.PROTOCOL_VERSION})")
        if hello.model != c.model:
            problems.append(f"model {hello.model!r} (this worker serves {c.model!r})")
        if hello.hidden_size != c.hidden_size:
            problems.append(f"hidden size {hello.hidden_size} (here {c.hidden_size})")
        if hello.dtype != wire.dtype_name(c.dtype):
            problems.append(f"dtype {hello.dtype} (here {wire.dtype_name(c.dtype)})")
        if problems:
            return wire.Welcome(ok=False, error="mismatch: " + "; ".join(problems),
                                instance=self.instance)
        return wire.Welcome(ok=True, instance=self.instance, layers=list(c.layers),
                            experts=None if c.experts is None else list(c.experts))

    def _serve(self, conn: socket.socket, kind: str) -> None:
        with self._conns_lock:
            self._conns.add(conn)
            self.stats.connections += 1
        replies = _Replies(conn)
        mm: mmap.mmap | None = None
        shm: torch.Tensor | None = None
        client = "?"
        try:
            msg, fds = wire.recv_header(conn, with_fds=(kind == "shm"))
            if not isinstance(msg, wire.Hello):
                raise ChannelError(f"expected hello, got {type(msg).__name__}")
            client = msg.client
            if msg.shm_bytes:
                if len(fds) != 1:
                    raise ChannelError("shared-memory hello without exactly one descriptor")
                mm = mmap.mmap(fds[0], msg.shm_bytes)
                shm = torch.frombuffer(mm, dtype=torch.uint8)
            for fd in fds:
                os.close(fd)
            welcome = self._welcome(msg)
            wire.send_frame(conn, welcome)
            if not welcome.ok:
                log.warning("refused %s: %s", client, welcome.error)
                return
            log.info("engine %s connected over %s", client, kind)
            self._spawn(replies.write_loop, name=f"afd-write-{client}")
            self._read_loop(conn, mm, shm, replies)
        except ChannelError as exc:
            if not self._stopping.is_set():
                log.info("connection from %s closed: %s", client, exc)
        finally:
            replies.outbox.put(None)
            with self._conns_lock:
                self._conns.discard(conn)
                self.stats.connections -= 1
            with contextlib.suppress(OSError):
                conn.close()
            shm = None
            if mm is not None:
                with contextlib.suppress(BufferError):
                    mm.close()

    def _read_loop(self, conn: socket.socket, mm: mmap.mmap | None, shm: torch.Tensor | None,
                   replies: _Replies) -> None:
        c = self.compute
        row_bytes = c.hidden_size * torch.empty((), dtype=c.dtype).element_size()
        while not self._stopping.is_set():
            msg, _ = wire.recv_header(conn)
            if not isinstance(msg, wire.FfnCall):
                raise ChannelError(f"expected a call, got {type(msg).__name__}")
            if msg.nbytes:
                x = wire.recv_tensor(conn, msg.rows, c.hidden_size, c.dtype, msg.nbytes)
            elif shm is not None and msg.shm_in >= 0:
                x = shm[msg.shm_in:msg.shm_in + msg.rows * row_bytes].view(c.dtype).view(
                    msg.rows, c.hidden_size)
            else:
                raise ChannelError("call without input")
            try:
                began = time.perf_counter()
                with self._lock:
                    y = c.forward(msg.layer, x)
                    took = time.perf_counter() - began
                    self.stats.calls += 1
                    self.stats.rows += msg.rows
                    self.stats.compute_seconds += took
                    self.stats.per_layer_calls[msg.layer] = (
                        self.stats.per_layer_calls.get(msg.layer, 0) + 1)
            except Exception as exc:  # report to the caller; the connection stays usable
                self.stats.errors += 1
                log.exception("FFN call for layer %d failed", msg.layer)
                replies.send(wire.FfnResult(seq=msg.seq, rows=0,
                                            error=f"{type(exc).__name__}: {exc}"), None)
                continue
            us = int(took * 1e6)
            if shm is not None and msg.shm_out >= 0 and msg.nbytes == 0:
                # memcpy, not a torch copy (which may fan out over OpenMP threads)
                assert mm is not None
                memoryview(mm)[msg.shm_out:msg.shm_out + msg.rows * row_bytes] = \
                    wire.tensor_bytes(y.to(c.dtype))
                replies.send(wire.FfnResult(seq=msg.seq, rows=msg.rows, compute_us=us), None)
            else:
                payload = wire.tensor_bytes(y.to(c.dtype))
                replies.send(wire.FfnResult(seq=msg.seq, rows=msg.rows, nbytes=len(payload),
                                            compute_us=us), payload)
