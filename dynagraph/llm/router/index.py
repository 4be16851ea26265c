"""The router's prefix index: which worker holds which KV blocks.

Data layout. vLLM's block hashes are chained (each one fingerprints the whole
prefix up to its block, see :mod:`.hashing`), so a prefix tree needs no explicit
edges: the hash *is* the path. The index is one flat ``dict`` from a block's 64-bit
hash to an ``int`` bitmask of the workers holding it. Worker ids (64-bit etcd lease
ids) map to small bit positions, reused after :meth:`PrefixIndex.remove_worker`.

``find_matches`` walks the query's hashes ANDing masks and stops as soon as no
worker is left, so its cost is one dict lookup per matched block plus one dict
write per matched worker -- independent of how many workers share a prefix.

Per worker the index keeps an append-only ``array('Q')`` log of the hashes it
stored (8 bytes an entry, compacted when removals leave it more than half stale)
so ``clear_worker`` touches only that worker's blocks. A worker's overlap is the
number of *leading* query blocks it holds consecutively, which is also what the
engine can reuse: a prefix-cache hit stops at the first missing block.

Known approximation: vLLM may hold two physical copies of one hash and emit
``BlockRemoved`` when the first copy goes; the index then forgets the block early
(it under-, never over-reports). Pure logic, no I/O, not thread-safe.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

_MIN_COMPACT = 1024


@dataclass(frozen=True)
class IndexStats:
    workers: int
    unique_blocks: int
    entries: int  # (worker, block) pairs


class PrefixIndex:
    """Maps chained block hashes to the set of workers holding them.

    Called by the Router component only: ``apply_*`` from its KV-event consumer,
    ``find_matches`` per routing decision. All methods are synchronous and fast.
    """

    __slots__ = ("_masks", "_pos", "_ids", "_bits", "_free", "_counts", "_logs")

    def __init__(self) -> None:
        self._masks: dict[int, int] = {}
        self._pos: dict[int, int] = {}
        self._ids: list[int] = []  # bit position -> worker id (-1 when free)
        self._bits: list[int] = []  # bit position -> 1 << position (shared objects)
        self._free: list[int] = []  # heap of free bit positions
        self._counts: list[int] = []  # bit position -> blocks held
        self._logs: list[array[int]] = []  # bit position -> hashes stored (may be stale)

    # --- workers ------------------------------------------------------------------

    def _position(self, worker_id: int) -> int:
        pos = self._pos.get(worker_id)
        if pos is not None:
            return pos
        if self._free:
            pos = heapq.heappop(self._free)
            self._ids[pos] = worker_id
        else:
            pos = len(self._ids)
            self._ids.append(worker_id)
            self._bits.append(1 << pos)
            self._counts.append(0)
            self._logs.append(array("Q"))
        self._pos[worker_id] = pos
        return pos

    def add_worker(self, worker_id: int) -> None:
        """Make ``worker_id`` known with no blocks (idempotent)."""
        self._position(worker_id)

    def workers(self) -> list[int]:
        return list(self._pos)

    def num_blocks(self, worker_id: int) -> int:
        pos = self._pos.get(worker_id)
        return 0 if pos is None else self._counts[pos]

    def worker_blocks(self, worker_id: int) -> set[int]:
        """The hashes ``worker_id`` holds (O(its log); for tests and debugging)."""
        pos = self._pos.get(worker_id)
        if pos is None:
            return set()
        bit, get = self._bits[pos], self._masks.get
        return {h for h in self._logs[pos] if get(h, 0) & bit}

    def stats(self) -> IndexStats:
        return IndexStats(len(self._pos), len(self._masks), sum(self._counts))

    # --- updates ------------------------------------------------------------------

    def apply_stored(
        self, worker_id: int, parent_hash: int | None, block_hashes: Sequence[int]
    ) -> None:
        """Record that ``worker_id`` now holds ``block_hashes`` (idempotent per block).

        ``parent_hash`` is accepted for the event's shape but not needed: each chained
        hash already identifies its whole prefix. Hashes must be 64-bit unsigned ints.
        """
        pos = self._position(worker_id)
        bit = self._bits[pos]
        masks = self._masks
        log = self._logs[pos]
        if masks.keys().isdisjoint(block_hashes):  # the common case: all new, done in C
            mark = len(log)
            log.extend(block_hashes)  # first: it rejects a hash that is not a u64
            before = len(masks)
            masks.update(dict.fromkeys(block_hashes, bit))
            added = len(masks) - before
            if added == len(block_hashes):
                self._counts[pos] += added
                return
            # a hash repeated within the call: undo, the loop below handles it
            del log[mark:]
            for h in block_hashes:
                masks.pop(h, None)
        get = masks.get
        append = log.append
        added = 0
        for h in block_hashes:
            m = get(h)
            if m is None:
                masks[h] = bit
            elif m & bit:
                continue
            else:
                masks[h] = m | bit
            append(h)
            added += 1
        self._counts[pos] += added

    def apply_removed(self, worker_id: int, block_hashes: Sequence[int]) -> None:
        """Record that ``worker_id`` evicted ``block_hashes``; unknown ones are ignored."""
        pos = self._pos.get(worker_id)
        if pos is None:
            return
        bit = self._bits[pos]
        masks = self._masks
        removed = 0
        for h in block_hashes:
            m = masks.get(h, 0)
            if m & bit:
                m ^= bit
                if m:
                    masks[h] = m
                else:
                    del masks[h]
                removed += 1
        count = self._counts[pos] - removed
        self._counts[pos] = count
        log = self._logs[pos]
        if len(log) > 2 * count + _MIN_COMPACT:
            get = masks.get
            self._logs[pos] = array("Q", [h for h in dict.fromkeys(log) if get(h, 0) & bit])

    def clear_worker(self, worker_id: int) -> None:
        """Forget every block of ``worker_id`` but keep it known (AllBlocksCleared)."""
        pos = self._pos.get(worker_id)
        if pos is None:
            return
        bit = self._bits[pos]
        masks = self._masks
        get = masks.get
        for h in self._logs[pos]:
            m = get(h, 0)
            if m & bit:
                m ^= bit
                if m:
                    masks[h] = m
                else:
                    del masks[h]
        self._logs[pos] = array("Q")
        self._counts[pos] = 0

    def remove_worker(self, worker_id: int) -> None:
        """Forget ``worker_id`` entirely (its lease expired); its bit position is reused."""
        pos = self._pos.get(worker_id)
        if pos is None:
            return
        self.clear_worker(worker_id)
        del self._pos[worker_id]
        self._ids[pos] = -1
        heapq.heappush(self._free, pos)

    # --- queries ------------------------------------------------------------------

    def find_matches(self, block_hashes: Sequence[int]) -> dict[int, int]:
        """Each worker's overlap: how many leading ``block_hashes`` it holds consecutively.

        Workers with no overlap are absent from the result.
        """
        out: dict[int, int] = {}
        if not block_hashes:
            return out
        get = self._masks.get
        cur = get(block_hashes[0], 0)
        if not cur:
            return out
        ids = self._ids
        depth = 1
        for h in block_hashes[1:]:
            m = get(h, 0) & cur
            if m != cur:
                gone = cur ^ m
                while gone:
                    low = gone & -gone
                    out[ids[low.bit_length() - 1]] = depth
                    gone ^= low
                cur = m
                if not cur:
                    return out
            depth += 1
        while cur:
            low = cur & -cur
            out[ids[low.bit_length() - 1]] = depth
            cur ^= low
        return out
