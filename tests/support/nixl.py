"""One stand-in for a NIXL agent (``nixl._api.nixl_agent``), for the tests of the layers
vLLM's NIXL connector calls through (``shm_direct.ShmNixl``, ``wire_codec.CodecNixl``).

It records what it is asked (``calls``: READs made and posted, notifications, removed
peers; ``registered`` memory, ``remotes`` added, ``reads`` done) and keeps descriptor
lists as their rows. With ``moves_bytes`` a READ copies the bytes its descriptors name
(both sides in this process) when it is posted and is done at once; without, a READ is
an opaque ``"nixl-handle"`` that stays in flight (``"PROC"``), as a real one to a peer
that never answers. A handle put in ``left`` (handle -> polls) answers ``"PROC"`` to that
many polls of ``check_xfer_state`` (the last one included: ``"DONE"`` at 0); every poll
is recorded in ``checked``.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from dynagraph.llm.kv.transfer.nixl_descs import Telemetry

NIXL_HANDLE = "nixl-handle"
"""The handle of a READ left to NIXL (``moves_bytes`` off)."""


class Descs:
    """A descriptor list: its rows (address, length, device[, tag])."""

    def __init__(self, rows: list[Any]) -> None:
        self.rows = rows


def _rows(descs: Any) -> list[Any]:
    return descs.rows if isinstance(descs, Descs) else np.asarray(descs).tolist()


class FakeNixlAgent:
    """A NIXL agent of this process (see the module docstring)."""

    def __init__(self, name: str = "decode-agent", *, moves_bytes: bool = False) -> None:
        self.name = name
        self.moves_bytes = moves_bytes
        self.calls: list[tuple[Any, ...]] = []
        self.registered: list[tuple[int, int]] = []
        self.remotes: list[bytes] = []
        self.reads: list[tuple[str, int, bytes]] = []  # (kind, bytes, notification)
        self.checked: list[Any] = []
        self.left: dict[Any, int] = {}

    # -- memory and peers -----------------------------------------------------------------

    def get_reg_descs(self, descs: list[tuple[int, int, int, str]], mem_type: str) -> Descs:
        return Descs(list(descs))

    def register_memory(self, descs: Any, backends: list[str] | None = None) -> None:
        self.registered += [(d[0], d[1]) for d in _rows(descs)]

    def get_agent_metadata(self) -> bytes:
        return f"md:{self.name}".encode()

    def add_remote_agent(self, metadata: bytes) -> str:
        assert metadata.startswith(b"md:"), metadata  # a wrapper's trailer never reaches NIXL
        self.remotes.append(metadata)
        return metadata[3:].decode()

    def remove_remote_agent(self, agent: Any) -> None:
        self.calls.append(("remove", agent))

    def send_notif(self, agent: Any, notif_msg: bytes) -> None:
        self.calls.append(("notif", agent, notif_msg))

    # -- transfers --------------------------------------------------------------------------

    def get_xfer_descs(self, descs: Any, mem_type: str | None = None) -> Descs:
        return Descs(_rows(descs))

    def prep_xfer_dlist(self, agent: Any, descs: Any, *args: Any) -> Descs:
        return Descs(_rows(descs))

    def make_prepped_xfer(self, op: str, local: Any, li: Any, remote: Any, ri: Any,
                          notif_msg: bytes = b"") -> Any:
        self.calls.append(("make", op))
        if not self.moves_bytes:
            return NIXL_HANDLE
        return ("raw", [_rows(local)[i] for i in li], [_rows(remote)[i] for i in ri], notif_msg)

    def initialize_xfer(self, op: str, local: Any, remote: Any, agent: str,
                        notif_msg: bytes = b"") -> tuple[str, list[Any], list[Any], bytes]:
        assert op == "READ"
        return ("encoded", _rows(local), _rows(remote), notif_msg)

    def transfer(self, handle: Any, notif_msg: bytes = b"") -> str:
        self.calls.append(("transfer", handle if isinstance(handle, str) else handle[0]))
        if self.moves_bytes and not isinstance(handle, str):
            kind, local, remote, notif = handle
            for (dst, n, *_), (src, m, *_) in zip(local, remote, strict=True):
                assert n == m
                ctypes.memmove(int(dst), int(src), int(n))
            self.reads.append((kind, sum(int(r[1]) for r in local), notif))
        return "PROC"

    def check_xfer_state(self, handle: Any) -> str:
        self.checked.append(handle)
        if isinstance(handle, str | int) and handle in self.left:
            self.left[handle] -= 1
            return "PROC" if self.left[handle] > 0 else "DONE"
        return "PROC" if isinstance(handle, str) else "DONE"

    def get_xfer_telemetry(self, handle: Any) -> Telemetry:
        return Telemetry(startTime=1.0, postDuration=2.0, xferDuration=3.0,
                         totalBytes=sum(int(r[1]) for r in handle[1]), descCount=len(handle[1]))

    def release_xfer_handle(self, handle: Any) -> None:
        return None
