"""Same-host KV reads straight from the other engine's memory (``kv-transport: shm``).

vLLM's NixlConnector moves a remote prefill's KV with a NIXL READ of the prefill
engine's cache blocks into the decode engine's. On one host the decode engine can do
that READ itself, as a ``memcpy`` from the prefill engine's cache, if the cache lives
in memory both processes can map. So:

1. **Where the cache lives.** Each engine allocates its whole KV cache as one buffer
   (vLLM's ``allocate_kv_cache``) and views it per layer. :func:`rehome` moves the views
   to a ``memfd`` of the same size before anything else views them (the connector
   wraps ``allocate_kv_cache``), and the engine keeps the fd open.
2. **How a peer finds it.** :func:`publish` writes a small manifest,
   ``/dev/shm/dynagraph-kvmem-<NIXL agent name>.json``: the engine's pid, host boot id
   and, per region, its address in that process, size, fd number and inode. A decode
   engine that adds a remote NIXL agent looks for that agent's manifest
   (:func:`PeerMemory.open`): same boot id, ``/proc/<pid>/fd/<fd>`` opens to the same
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

Pure apart from the memory calls; no vLLM import (``nixl_connector`` does the wiring).
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import mmap
import os
import time
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np

from dynagraph.runtime.addresses import host_id

log = logging.getLogger(__name__)

ENV = "DYNAGRAPH_KV_SHM"
"""``1`` in an engine's environment: its KV cache goes to shared memory, published, and
its READs from mapped peers are copies (set by the workers for ``kv-transport`` shm/auto)."""

MANIFEST_DIR = Path("/dev/shm")
MANIFEST_PREFIX = "dynagraph-kvmem-"

LOCAL_AGENT = "NIXL_INIT_AGENT"


def enabled(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(ENV, "") == "1"


@dataclass(frozen=True)
class Region:
    """One shared KV buffer of an engine: where it is mapped in that process and the fd
    (kept open there) that a peer opens through ``/proc/<pid>/fd``."""

    addr: int
    nbytes: int
    fd: int
    ino: int


# ---- the owner's side -----------------------------------------------------------------

_regions: list[Region] = []
"""This process's live shared KV buffers (a region leaves when its tensors are freed)."""


def rehome(kv_caches: Mapping[str, Any]) -> Region | None:
    """Move the tensors of ``kv_caches`` (views of one or more buffers) to ``memfd``s.

    Each distinct buffer becomes a memfd of its size, mapped shared; every view is
    pointed at it with the same offset, shape and strides (``Tensor.set_``). Call it
    before anything else holds a view of the buffers: the old buffer is released before
    the memfd is made, so memory peaks at one cache, not two. Returns the region of the
    largest buffer (vLLM allocates one; None if no memfd could be made: the cache is
    then private memory, as before); its fd closes when the views are gone.
    """
    import torch

    by_storage: dict[int, list[Any]] = {}
    seen: set[int] = set()
    for tensor in kv_caches.values():
        if id(tensor) in seen or tensor.device.type != "cpu":
            continue
        seen.add(id(tensor))
        by_storage.setdefault(tensor.untyped_storage().data_ptr(), []).append(tensor)
    largest: Region | None = None
    for tensors in by_storage.values():
        nbytes = tensors[0].untyped_storage().nbytes()
        layout = [(t, t.storage_offset(), t.size(), t.stride()) for t in tensors]
        for tensor in tensors:  # the old buffer goes first: memory peaks at one cache
            tensor.set_()
        fd: int | None = None
        try:
            fd = os.memfd_create("dynagraph-kv", os.MFD_CLOEXEC)
            os.ftruncate(fd, nbytes)
            storage = cast(torch.UntypedStorage, torch.UntypedStorage.from_file(
                f"/proc/self/fd/{fd}", shared=True, nbytes=nbytes))
        except Exception:
            log.exception("KV cache not in shared memory: its peers read it over NIXL")
            if fd is not None:
                os.close(fd)
            fd = None
            storage = torch.empty(nbytes, dtype=torch.int8).untyped_storage()
        # as vLLM's torch.zeros: every page allocated and mapped now, not on a copy's
        # first touch (a fault per 4 KiB page ran copies at 0.7 GiB/s)
        torch.empty(0, dtype=torch.int8).set_(storage).zero_()
        for tensor, offset, size, stride in layout:
            tensor.set_(storage, offset, size, stride)
        if fd is None:
            continue
        region = Region(addr=storage.data_ptr(), nbytes=nbytes, fd=fd, ino=os.fstat(fd).st_ino)
        _regions.append(region)
        weakref.finalize(tensors[0], _forget, region)
        if largest is None or region.nbytes > largest.nbytes:
            largest = region
    return largest


def _forget(region: Region) -> None:
    if region in _regions:
        _regions.remove(region)
    try:
        os.close(region.fd)
    except OSError:
        pass


def regions_of(addrs: Iterable[int]) -> list[Region]:
    """The live regions holding any of ``addrs`` (e.g. the registered caches' pointers)."""
    wanted = list(addrs)
    return [r for r in _regions if any(r.addr <= a < r.addr + r.nbytes for a in wanted)]


def manifest_path(agent: str, base: Path = MANIFEST_DIR) -> Path:
    if not agent or "/" in agent or agent.startswith("."):
        raise ValueError(f"not a NIXL agent name for a file: {agent!r}")
    return base / f"{MANIFEST_PREFIX}{agent}.json"


def publish(agent: str, regions: list[Region], base: Path = MANIFEST_DIR) -> Path:
    """Write the manifest peers look for (atomically); drop stale ones of dead processes."""
    sweep(base)
    path = manifest_path(agent, base)
    body = {"pid": os.getpid(), "host": host_id(), "regions": [asdict(r) for r in regions]}
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(body))
    os.replace(tmp, path)
    return path


def withdraw(agent: str, base: Path = MANIFEST_DIR) -> None:
    try:
        manifest_path(agent, base).unlink()
    except (OSError, ValueError):
        pass


def sweep(base: Path = MANIFEST_DIR) -> int:
    """Remove manifests whose process is gone (a killed engine leaves its own behind)."""
    removed = 0
    for path in base.glob(f"{MANIFEST_PREFIX}*.json"):
        try:
            pid = int(json.loads(path.read_text())["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if not _alive(pid):
            try:
                path.unlink()
                removed += 1
            except OSError:
                pass
    return removed


def _alive(pid: int) -> bool:
    """A signal-0 probe: cheap enough for every READ (``runtime.procfs.pid_alive`` reads
    each thread's stat); a zombie counts as alive until it is reaped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---- the reader's side ----------------------------------------------------------------


@dataclass
class PeerMemory:
    """A peer engine's shared KV buffers, mapped read-only into this process."""

    agent: str
    pid: int
    bases: np.ndarray  # the peer's region addresses
    ends: np.ndarray
    local: np.ndarray  # where each region is mapped here
    _keep: list[Any] = field(default_factory=list, repr=False)

    @classmethod
    def open(cls, agent: str, base: Path = MANIFEST_DIR) -> PeerMemory | None:
        """Map ``agent``'s published buffers, or None when it has none this process can
        map (no manifest, another host, the process or its fd gone)."""
        try:
            body = json.loads(manifest_path(agent, base).read_text())
        except (OSError, ValueError):
            return None
        if body.get("host") != host_id() or not body.get("regions"):
            return None
        keep: list[Any] = []
        bases, ends, local = [], [], []
        try:
            for r in sorted(body["regions"], key=lambda r: r["addr"]):  # for translate
                region = Region(**r)
                fd = os.open(f"/proc/{int(body['pid'])}/fd/{region.fd}", os.O_RDONLY)
                try:
                    st = os.fstat(fd)
                    if st.st_ino != region.ino or st.st_size < region.nbytes:
                        raise OSError(f"/proc/{body['pid']}/fd/{region.fd} is not the "
                                      f"published buffer")
                    mapped = mmap.mmap(fd, region.nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
                finally:
                    os.close(fd)
                view = np.frombuffer(mapped, dtype=np.uint8)
                populate(view.ctypes.data, region.nbytes)
                keep += [mapped, view]
                bases.append(region.addr)
                ends.append(region.addr + region.nbytes)
                local.append(view.ctypes.data)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            log.warning("KV of NIXL agent %s not mapped (%s): its READs go over NIXL", agent, exc)
            return None
        return cls(agent, int(body["pid"]), np.array(bases, np.uint64), np.array(ends, np.uint64),
                   np.array(local, np.uint64), keep)

    def translate(self, addrs: np.ndarray, lens: np.ndarray) -> np.ndarray | None:
        """The peer's ``addrs`` as addresses in this process (None if any range of
        ``lens`` bytes is outside every mapped region)."""
        addrs = np.asarray(addrs, dtype=np.uint64)
        idx = np.searchsorted(self.bases, addrs, side="right").astype(np.int64) - 1
        if len(addrs) and (idx.min() < 0 or np.any(addrs + np.asarray(lens, np.uint64)
                                                   > self.ends[np.maximum(idx, 0)])):
            return None
        out: np.ndarray = self.local[idx] + (addrs - self.bases[idx])
        return out


MADV_POPULATE_READ = 22  # Linux 5.14+


@functools.cache
def _madvise() -> Any:
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return madvise


def populate(addr: int, nbytes: int) -> bool:
    """Map every page of a fresh mapping now, so that copies from it do not fault a page
    at a time. Through ctypes, which lets other threads run: ``mmap``'s own
    ``MAP_POPULATE`` holds the GIL, during which the engine's loop stands still.
    False where the kernel cannot (older than 5.14): the first copies fault instead."""
    if _madvise()(addr, nbytes, MADV_POPULATE_READ) == 0:
        return True
    log.debug("madvise(MADV_POPULATE_READ) failed: errno %d", ctypes.get_errno())
    return False


def merge_runs(dst: np.ndarray, src: np.ndarray,
               lens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Descriptor pairs (copy ``lens[i]`` bytes from ``src[i]`` to ``dst[i]``) merged
    into runs that are contiguous on both sides, in order."""
    d, s, n = merge_ranges(dst, src, lens=lens)
    return d, s, n


def merge_ranges(first: np.ndarray, *others: np.ndarray, lens: np.ndarray,
                 other_lens: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """Ranges ``(first[i], lens[i])`` and ``(others[k][i], other_lens[i])`` (``lens`` when
    None: the same sizes) merged where each follows the one before on every side; returns
    the sides' run starts, then the runs' ``lens`` (and ``other_lens``) sums."""
    lens = np.asarray(lens, np.uint64)
    sizes = lens if other_lens is None else np.asarray(other_lens, np.uint64)
    cols = [np.asarray(first, np.uint64), *(np.asarray(o, np.uint64) for o in others)]
    sums = [lens] if other_lens is None else [lens, sizes]
    if len(lens) == 0:
        return (*cols, *sums)
    follows = cols[0][1:] == cols[0][:-1] + lens[:-1]
    for col in cols[1:]:
        follows &= col[1:] == col[:-1] + sizes[:-1]
    starts = np.concatenate(([0], np.flatnonzero(~follows) + 1))
    return (*(c[starts] for c in cols), *(np.add.reduceat(x, starts) for x in sums))


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


@dataclass
class Telemetry:
    """What ``nixlXferTelemetry`` carries (microseconds)."""

    startTime: float  # noqa: N815  (NIXL's names)
    postDuration: float  # noqa: N815
    xferDuration: float  # noqa: N815
    totalBytes: int  # noqa: N815
    descCount: int  # noqa: N815


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


def agent_text(name: str | bytes) -> str:
    return name.decode() if isinstance(name, bytes) else name


def descriptor_rows(descs: Any) -> np.ndarray | None:
    """An ``N x 3`` (address, length, device) descriptor array as uint64, else None."""
    if isinstance(descs, np.ndarray) and descs.ndim == 2 and descs.shape[1] == 3:
        return np.asarray(descs, dtype=np.uint64).copy()
    return None
