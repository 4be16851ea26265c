"""A size limit for the tier under the host KV pool (``kv-offload-dir-gib``).

vLLM's file-system tier writes one file per block and never deletes one, so a tier on a
tmpfs grows until the host's memory is gone, and one on a disk until the disk is full.
A worker that names a limit runs :meth:`TierTrimmer.trim` every few seconds: when the
block files under the directory add up to more than the limit, it deletes the oldest
written until they fit in ``low_water`` of it. Oldest written, not least recently read:
vLLM writes a block's file once and never rewrites it, and a read does not update the
file's times on a ``relatime`` mount; a block still in use is back in the engine's cache
or its host pool, which the tier only backs.

Deleting under a running engine is safe because the engine computes what it cannot
load: a lookup checks that the file exists, and when the file goes (or is cut short)
before vLLM's tier promotes the block into the pool, the promotion fails and the
lookup becomes a miss (``tests/vllm/test_host_pool.py``).

Workers sharing one directory take turns through an exclusive, non-blocking ``flock``
on a lock file in it: one trims, the others skip that round. vLLM names each file after
its block's hash (``<hash hex>.bin``), so the trimmer reports the deleted blocks as the
64-bit hashes the Router indexes (:func:`~dynagraph.llm.router.hashing.external_hash`),
and the Router drops them for every worker of the tier. Pure file-system work, no
vLLM: :class:`TierJanitor` runs it on a thread beside the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import CollectorRegistry

from dynagraph.llm.kv.events.relay import KvEventFeed
from dynagraph.llm.router.hashing import external_hash
from dynagraph.observability.metrics import counter, gauge

log = logging.getLogger(__name__)

LOCK_NAME = ".dynagraph-trim.lock"
BLOCK_SUFFIX = ".bin"


@dataclass
class TrimResult:
    """One :meth:`TierTrimmer.trim`: bytes of block files before and after, the hashes
    of the blocks deleted; ``skipped`` when another process was trimming."""

    bytes_before: int = 0
    bytes_after: int = 0
    removed: list[int] = field(default_factory=list)
    skipped: bool = False


def block_hash_of(name: str) -> int | None:
    """The Router's hash of the block a tier file holds (None: not a block file)."""
    if not name.endswith(BLOCK_SUFFIX):
        return None
    try:
        return external_hash(bytes.fromhex(name[: -len(BLOCK_SUFFIX)]))
    except ValueError:
        return None


class TierTrimmer:
    """Keeps the block files under ``root`` within ``limit_bytes``."""

    def __init__(self, root: str | os.PathLike[str], limit_bytes: int, *,
                 low_water: float = 0.9) -> None:
        if limit_bytes <= 0:
            raise ValueError(f"a tier limit must be positive, not {limit_bytes}")
        if not 0.0 < low_water <= 1.0:
            raise ValueError(f"low_water must be in (0, 1], not {low_water}")
        self.root = Path(root)
        self.limit_bytes = limit_bytes
        self.low_water = low_water

    def _blocks(self) -> list[tuple[int, int, str, int]]:
        """(mtime ns, size, path, hash) of every block file under ``root``."""
        out: list[tuple[int, int, str, int]] = []
        stack = [str(self.root)]
        while stack:
            with contextlib.suppress(FileNotFoundError, NotADirectoryError), \
                    os.scandir(stack.pop()) as entries:
                for entry in entries:
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
                        continue
                    h = block_hash_of(entry.name)
                    if h is None:
                        continue  # vLLM's config.json, a write's temporary file, our lock
                    with contextlib.suppress(FileNotFoundError):
                        st = entry.stat(follow_symlinks=False)
                        out.append((st.st_mtime_ns, st.st_size, entry.path, h))
        return out

    def trim(self) -> TrimResult:
        """Delete the oldest block files while they exceed the limit (one pass)."""
        try:
            fd = os.open(self.root / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # the tier has not been made yet
            return TrimResult()
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return TrimResult(skipped=True)
            return self._trim_locked()
        finally:
            os.close(fd)  # closing releases the lock

    def _trim_locked(self) -> TrimResult:
        blocks = self._blocks()
        total = sum(b[1] for b in blocks)
        result = TrimResult(bytes_before=total, bytes_after=total)
        if total <= self.limit_bytes:
            return result
        target = int(self.limit_bytes * self.low_water)
        blocks.sort()
        for _, size, path, h in blocks:
            if total <= target:
                break
            try:
                os.unlink(path)
            except FileNotFoundError:  # cleared by hand meanwhile: gone all the same
                pass
            total -= size
            result.removed.append(h)
        result.bytes_after = total
        return result


TRIM_INTERVAL_S = 5.0


class TierJanitor:
    """Runs a :class:`TierTrimmer` every ``interval`` seconds on a thread and hands each
    pass that was not skipped to ``on_result`` (on the event loop)."""

    def __init__(self, trimmer: TierTrimmer, on_result: Callable[[TrimResult], None], *,
                 interval: float = TRIM_INTERVAL_S) -> None:
        self.trimmer = trimmer
        self._on_result = on_result
        self._interval = interval
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="kv-tier-trim")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            try:
                result = await asyncio.to_thread(self.trimmer.trim)
            except OSError:  # e.g. the directory's file system went read-only: say so, go on
                log.exception("trimming the KV tier %s", self.trimmer.root)
            else:
                if not result.skipped:
                    self._on_result(result)
                    if result.removed:
                        log.info("KV tier %s: deleted %d oldest blocks (%.1f -> %.1f MiB, "
                                 "limit %.1f MiB)", self.trimmer.root, len(result.removed),
                                 result.bytes_before / 2**20, result.bytes_after / 2**20,
                                 self.trimmer.limit_bytes / 2**20)
            await asyncio.sleep(self._interval)


def tier_janitor(kv_offload_dir: str | None, limit_gib: float, *, worker: str,
                 registry: CollectorRegistry, feed: KvEventFeed | None = None
                 ) -> TierJanitor | None:
    """The janitor a worker runs for its ``kv-offload-dir`` with ``kv-offload-dir-gib``
    (None: no limit): it exports the tier's bytes and the blocks it deleted, and tells
    the worker's KV event ``feed`` (the Router) which blocks are gone."""
    if not kv_offload_dir or limit_gib <= 0:
        return None
    size = gauge("dynamo_worker_kv_tier_bytes", registry).labels(worker=worker)
    trimmed = counter("dynamo_worker_kv_tier_trimmed_blocks_total", registry).labels(
        worker=worker)

    def report(result: TrimResult) -> None:
        size.set(result.bytes_after)
        if result.removed:
            trimmed.inc(len(result.removed))
            if feed is not None:
                feed.forget_tiered(result.removed)

    return TierJanitor(TierTrimmer(kv_offload_dir, int(limit_gib * 2**30)), report)
