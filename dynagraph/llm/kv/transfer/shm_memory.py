"""A KV cache in shared memory (``kv-transport: shm``): the owner's side puts it there
and publishes where it is; the reader's side maps a same-host peer's.

The owner (an engine with ``shm_direct.ENV`` set): :func:`rehome` moves the views of its
KV buffers to ``memfd``s before anything else views them, and keeps the fds open while
the views live (:func:`regions_of` lists them); :func:`publish` writes the manifest
``/dev/shm/dynagraph-kvmem-<NIXL agent name>.json`` (the pid, host boot id and, per
region, its address, size, fd number and inode), atomically, and sweeps manifests of dead
processes; :func:`withdraw` removes it.

The reader: :meth:`PeerMemory.open` maps a peer's published buffers read-only, only when
the manifest is of this host and ``/proc/<pid>/fd/<fd>`` opens to the published inode
(else None: the peer's READs go over NIXL); :meth:`PeerMemory.translate` turns the peer's
addresses into this process's. No vLLM or NIXL import (``shm_direct`` uses it).
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import mmap
import os
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np

from dynagraph.runtime.addresses import host_id

log = logging.getLogger(__name__)

MANIFEST_DIR = Path("/dev/shm")
MANIFEST_PREFIX = "dynagraph-kvmem-"


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
