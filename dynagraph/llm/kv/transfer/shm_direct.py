"""Same-host KV reads straight from the other engine's memory (``kv-transport: shm``).

vLLM's NixlConnector moves a remote prefill's KV with a NIXL READ of the prefill
engine's cache blocks into the decode engine's. On one host the decode engine can do
that READ itself, as a ``memcpy`` from the prefill engine's cache, if the cache lives
in memory both processes can map. So:

1. **Where the cache lives.** Each engine allocates its whole KV cache as one buffer
   (vLLM's ``allocate_kv_cache``) and views it per layer. :func:`shm_memory.rehome` moves the views
   to a ``memfd`` of the same size before anything else views them (the connector
   wraps ``allocate_kv_cache``), and the engine keeps the fd open.
2. **How a peer finds it.** :func:`shm_memory.publish` writes a small manifest,
   ``/dev/shm/dynagraph-kvmem-<NIXL agent name>.json``: the engine's pid, host boot id
   and, per region, its address in that process, size, fd number and inode. A decode
   engine that adds a remote NIXL agent looks for that agent's manifest
   (:meth:`shm_memory.PeerMemory.open`): same boot id, ``/proc/<pid>/fd/<fd>`` opens to the same
   inode, so it is the same memory; it maps it read-only. No manifest (another host, a
   peer with ``kv-transport: nixl``, an older build), and NIXL is used as before.
3. **The READ.** :class:`ShmNixl` stands in front of vLLM's NIXL agent. It notes the
   descriptor arrays vLLM prepares (``get_xfer_descs`` / ``prep_xfer_dlist``: rows of
   address, length, device), translating a mapped peer's addresses into this process.
   A READ whose remote side is a mapped peer becomes :class:`ShmRead`: on ``transfer``
   the descriptor pairs are merged into runs contiguous on both sides and each run is
   one ``memmove``; then the READ's notification goes to the peer over NIXL, as NIXL
   would have sent it, so vLLM's protocol (block leases, frees, failures, the
   ``recompute`` policy) is untouched. Every other call goes to NIXL.

The copy runs on the engine's step thread, synchronously: it is done when the step's
``get_finished`` asks, one step earlier than a NIXL READ's completion is noticed.
Telemetry (``get_xfer_telemetry``) reports the copy's own time, so the worker's
``dynamo_worker_kv_transfer_*`` metrics measure it.

The feature is in three modules, by role:

    shm_memory    where the cache lives and how a peer finds it (1 and 2): the owner's
                  ``rehome`` / ``publish`` / ``withdraw`` / ``sweep``, the reader's
                  ``PeerMemory`` and ``populate``
    nixl_descs    what the stand-ins in front of vLLM's NIXL agent share (this one and
                  ``wire_codec.CodecNixl``): descriptor rows, agent names, range merging,
                  ``Telemetry``
    shm_direct    the switch (``ENV``, ``enabled``) and the READ (3): ``ShmNixl``,
                  ``ShmRead``, ``copy``

Pure apart from the memory calls; no vLLM import (``nixl_connector`` does the wiring).
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dynagraph.llm.kv.transfer.nixl_descs import (
    LOCAL_AGENT,
    Telemetry,
    agent_text,
    descriptor_rows,
    merge_runs,
)
from dynagraph.llm.kv.transfer.shm_memory import MANIFEST_DIR, PeerMemory, _alive
from dynagraph.llm.kv.transfer.switches import KV_SHM

log = logging.getLogger(__name__)

ENV = KV_SHM


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(ENV, "") == "1"


def copy(dst: np.ndarray, src: np.ndarray, lens: np.ndarray) -> int:
    """``memmove`` each run; returns the bytes copied."""
    d, s, n = merge_runs(dst, src, lens)
    for a, b, size in zip(d.tolist(), s.tolist(), n.tolist(), strict=True):
        ctypes.memmove(a, b, size)
    return int(n.sum())


# ---- the NIXL agent's stand-in --------------------------------------------------------


@dataclass
class _DescList:
    addrs: np.ndarray  # in this process
    lens: np.ndarray
    agent: Any  # LOCAL_AGENT or the remote agent's name as NIXL gave it (str or bytes)
    peer: PeerMemory | None = None  # a remote list's mapping (kept alive by its reads)


class ShmRead:
    """A READ from a mapped peer: done by :meth:`ShmNixl.transfer`."""

    __slots__ = ("dst", "src", "lens", "agent", "peer", "notif", "state", "telemetry")

    def __init__(self, dst: np.ndarray, src: np.ndarray, lens: np.ndarray, agent: Any,
                 peer: PeerMemory | None, notif: bytes) -> None:
        self.dst, self.src, self.lens = dst, src, lens
        self.agent = agent
        self.peer = peer  # its mapping stays while the read exists
        self.notif = notif
        self.state = "PROC"
        self.telemetry: Telemetry | None = None

    def release(self) -> None:
        """As a NIXL handle's (nothing to free)."""

    def __repr__(self) -> str:
        return f"ShmRead({self.agent}, {len(self.lens)} descs, {self.state})"


class ShmNixl:
    """vLLM's NIXL agent with READs from same-host peers done as copies (module doc)."""

    def __init__(self, agent: Any, manifest_dir: Path = MANIFEST_DIR) -> None:
        self._agent = agent
        self._dir = manifest_dir
        self._arrays: dict[int, tuple[Any, np.ndarray]] = {}
        self._lists: dict[int, tuple[Any, _DescList]] = {}
        self._peers: dict[str, PeerMemory | None] = {}
        self.copies = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)

    # descriptor lists
    def get_xfer_descs(self, descs: Any, *args: Any, **kwargs: Any) -> Any:
        out = self._agent.get_xfer_descs(descs, *args, **kwargs)
        rows = descriptor_rows(descs)
        if rows is not None:
            self._arrays[id(out)] = (out, rows)
            while len(self._arrays) > 16:  # lists never prepared (none in vLLM today)
                del self._arrays[next(iter(self._arrays))]
        return out

    def prep_xfer_dlist(self, agent_name: str | bytes, xfer_list: Any, *args: Any,
                        **kwargs: Any) -> Any:
        handle = self._agent.prep_xfer_dlist(agent_name, xfer_list, *args, **kwargs)
        held = self._arrays.pop(id(xfer_list), None)
        rows = (held[1] if held is not None and held[0] is xfer_list
                else descriptor_rows(xfer_list))
        if rows is None:
            return handle
        addrs: np.ndarray | None = rows[:, 0]
        lens = rows[:, 1]
        local = agent_name in (LOCAL_AGENT, "")
        peer = None
        if not local:
            try:
                peer = self.peer(agent_name)
                addrs = peer.translate(rows[:, 0], lens) if peer is not None else None
            except Exception:  # never worse than NIXL alone
                log.exception("KV of NIXL agent %r not mapped: its READs go over NIXL",
                              agent_name)
                addrs = None
        if addrs is None:
            return handle
        self._lists[id(handle)] = (handle, _DescList(addrs, lens, LOCAL_AGENT if local
                                                     else agent_name, peer))
        return handle

    def release_dlist_handle(self, handle: Any) -> Any:
        self._lists.pop(id(handle), None)
        return self._agent.release_dlist_handle(handle)

    def peer(self, agent_name: str | bytes) -> PeerMemory | None:
        name = agent_text(agent_name)
        if name not in self._peers:
            self._peers[name] = PeerMemory.open(name, self._dir)
            if self._peers[name] is not None:
                log.info("KV of NIXL agent %s is on this host: READs from it are copies", name)
        return self._peers[name]

    def forget(self, agent: str | bytes) -> None:
        """Unmap ``agent``'s memory (once its reads are gone): its READs go to NIXL."""
        self._peers.pop(agent_text(agent), None)
        for key, (_, dl) in list(self._lists.items()):  # a snapshot: handshakes add lists
            # from their own thread
            if dl.agent != LOCAL_AGENT and agent_text(dl.agent) == agent_text(agent):
                self._lists.pop(key, None)

    def remove_remote_agent(self, agent: str | bytes) -> Any:
        self.forget(agent)
        return self._agent.remove_remote_agent(agent)

    def _forget_the_dead(self) -> None:
        """A peer whose process is gone is unmapped (vLLM may keep a dead engine's agent
        until a TTL, and the mapping would keep its whole cache in memory)."""
        for name, peer in list(self._peers.items()):
            if peer is not None and not _alive(peer.pid):
                log.info("NIXL agent %s's process %d is gone: its KV is unmapped", name,
                         peer.pid)
                self.forget(name)

    # transfers
    def make_prepped_xfer(self, operation: str, local_xfer_side: Any, local_indices: Any,
                          remote_xfer_side: Any, remote_indices: Any, notif_msg: bytes = b"",
                          *args: Any, **kwargs: Any) -> Any:
        self._forget_the_dead()
        local = self._lists.get(id(local_xfer_side))
        remote = self._lists.get(id(remote_xfer_side))
        if (operation == "READ" and local is not None and remote is not None
                and local[0] is local_xfer_side and remote[0] is remote_xfer_side
                and remote[1].agent != LOCAL_AGENT):
            li = np.asarray(local_indices, dtype=np.int64)
            ri = np.asarray(remote_indices, dtype=np.int64)
            lens = local[1].lens[li]
            if len(li) == len(ri) and np.array_equal(lens, remote[1].lens[ri]):
                return ShmRead(local[1].addrs[li], remote[1].addrs[ri], lens,
                               remote[1].agent, remote[1].peer, notif_msg)
        return self._agent.make_prepped_xfer(operation, local_xfer_side, local_indices,
                                             remote_xfer_side, remote_indices, notif_msg,
                                             *args, **kwargs)

    def transfer(self, handle: Any, notif_msg: bytes = b"") -> str:
        if not isinstance(handle, ShmRead):
            return str(self._agent.transfer(handle, notif_msg))
        start = time.perf_counter()
        try:
            nbytes = copy(handle.dst, handle.src, handle.lens)
        except Exception:
            log.exception("KV copy from NIXL agent %s failed", handle.agent)
            handle.state = "ERR"
            return "ERR"
        took_us = (time.perf_counter() - start) * 1e6
        handle.telemetry = Telemetry(startTime=start * 1e6, postDuration=took_us,
                                     xferDuration=took_us, totalBytes=nbytes,
                                     descCount=len(handle.lens))
        notif = notif_msg or handle.notif
        if notif:
            try:
                self._agent.send_notif(handle.agent, notif_msg=notif)
            except Exception as exc:  # the KV is here; the peer frees it at its lease's end
                log.warning("KV copied from NIXL agent %s, its notification failed: %s",
                            agent_text(handle.agent), exc)
        handle.state = "DONE"
        self.copies += 1
        return "DONE"

    def check_xfer_state(self, handle: Any) -> str:
        if isinstance(handle, ShmRead):
            return handle.state
        return str(self._agent.check_xfer_state(handle))

    def get_xfer_telemetry(self, handle: Any) -> Any:
        if isinstance(handle, ShmRead):
            return handle.telemetry
        return self._agent.get_xfer_telemetry(handle)

    def release_xfer_handle(self, handle: Any) -> Any:
        if isinstance(handle, ShmRead):
            return None
        return self._agent.release_xfer_handle(handle)
