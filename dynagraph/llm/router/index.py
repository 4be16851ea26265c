"""The router's prefix index: which worker holds which KV blocks.

Data layout. vLLM's block hashes are chained (each one fingerprints the whole
prefix up to its block, see :mod:`.hashing`), so the hash *is* the path and a query is
one walk down a chain. A ``dict`` maps each block's 64-bit hash to the workers holding
it, in one of two forms:

* an ``int`` bit mask (bit ``p`` set when the worker at position ``p`` holds the
  block; worker ids, 64-bit etcd lease ids, map to small positions, reused after
  :meth:`PrefixIndex.remove_worker`), for a block stored without its neighbours;
* a *segment*, shared by a run of blocks stored together in chain order: one
  ``bytearray`` holding their hashes (u64 little-endian) followed by one bit array per
  block (the same bits, ``_width`` bytes each).

A store that names its parent (``apply_stored``'s ``parent_hash``: vLLM's own events)
is one chain: it extends the parent's segment when the parent ends one (up to
``_SEGMENT_BLOCKS``), so a conversation, decode blocks included, lies in one segment. A
store without a parent is taken for a chain only when it is a run of at least
``_MIN_RUN`` blocks (a prefill); shorter ones (the Router's relay sends each engine
step's new blocks, several requests' decode blocks together, without parents) are
stored block by block, which is what every block cost before segments existed.

Why segments: on a large index every dict lookup is a cache and TLB miss (about half
a microsecond on a busy 2-core VM), and a walk that looked up every query block paid
one per block: most of a query's time, and of its tail. ``find_matches`` looks up only
the first block of each segment the query enters (and the first block past the match),
then compares the query's next hashes with the segment's in one ``memcmp`` and each run
of blocks with the same holders with one more.

Apart from one array per worker and a bounded memo of results, the index holds only
ints, bytes and bytearrays in dicts of them: nothing the cyclic GC tracks, so however
large it grows it adds nothing to the collector's pauses.

Per worker the index keeps an append-only ``array('Q')`` log of the hashes it stored (8
bytes an entry, compacted when removals leave it more than half stale) so
``clear_worker`` touches only that worker's blocks. A worker's overlap is the number of
*leading* query blocks it holds consecutively, which is also what the engine can reuse:
a prefix-cache hit stops at the first missing block.

Invariants: a hash has at most one live copy (a non-zero mask), the one its dict entry
names; a block that no worker holds any more is dropped from the dict (zeroed in place
inside a segment; a later store puts it elsewhere); a segment's last block is live (dead
blocks at the end are cut off, and a segment with none left is dropped). When a block
inside a segment gets a second child the segment is split after it and the block
marked a branch point, never extended again, so that a walk down any of its children
leaves the segment at its end.

Known approximation: vLLM may hold two physical copies of one hash and emit
``BlockRemoved`` when the first copy goes; the index then forgets the block early
(it under-, never over-reports). Pure logic, no I/O, not thread-safe.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import takewhile

_MIN_COMPACT = 1024
_SEGMENT_BLOCKS = 128
"""Longest segment: bounds the search for a block's offset within its segment."""
_MIN_RUN = 8
"""Shortest store without a parent that is kept as a segment (see the module docstring)."""
_MEMO_MAX = 4096
_U64 = 1 << 64
_from_bytes = int.from_bytes  # bound once: looking it up on int costs more than the call


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

    __slots__ = (
        "_where",
        "_branches",
        "_width",
        "_pos",
        "_ids",
        "_free",
        "_counts",
        "_logs",
        "_masks",
        "_bits",
        "_templates",
    )

    def __init__(self) -> None:
        self._where: dict[int, int | bytearray] = {}  # live block hash -> mask or segment
        self._branches: dict[int, None] = {}  # live blocks with children in two segments
        self._width = 8  # bytes of worker bits per block in a segment
        self._pos: dict[int, int] = {}
        self._ids: list[int] = []  # bit position -> worker id (-1 when free)
        self._free: list[int] = []  # heap of free bit positions
        self._counts: list[int] = []  # bit position -> blocks held
        self._logs: list[array[int]] = []  # bit position -> hashes stored (may be stale)
        self._masks: list[int] = []  # bit position -> 1 << position (shared objects)
        self._bits: list[bytes] = []  # bit position -> the same as a segment's bytes
        self._templates: dict[int, dict[int, int]] = {}  # mask << 32 | depth -> result

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
            self._counts.append(0)
            self._logs.append(array("Q"))
            self._masks.append(1 << pos)
            if pos >= 8 * self._width:
                self._widen(2 * self._width)
            self._bits.append((1 << pos).to_bytes(self._width, "little"))
        self._pos[worker_id] = pos
        self._templates.clear()
        return pos

    def _widen(self, width: int) -> None:
        """Give every segment block ``width`` bytes of worker bits (once per doubling
        of the fleet)."""
        old = self._width
        segments = {id(s): s for s in self._where.values() if isinstance(s, bytearray)}
        for seg in segments.values():
            blocks = len(seg) // (8 + old)
            bits = bytearray(blocks * width)
            for b in range(old):
                bits[b::width] = seg[8 * blocks + b :: old]
            seg[8 * blocks :] = bits
        self._width = width
        self._bits = [(1 << p).to_bytes(width, "little") for p in range(len(self._bits))]

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
        return {h for h in self._logs[pos] if self._holds(pos, h)}

    def stats(self) -> IndexStats:
        return IndexStats(len(self._pos), len(self._where), sum(self._counts))

    def _holds(self, pos: int, h: int) -> bool:
        v = self._where.get(h)
        if v is None:
            return False
        if isinstance(v, int):
            return bool(v >> pos & 1)
        width = self._width
        blocks = len(v) // (8 + width)
        at = 8 * blocks + _offset(v, h.to_bytes(8, "little"), blocks) * width + (pos >> 3)
        return bool(v[at] >> (pos & 7) & 1)

    # --- updates ------------------------------------------------------------------

    def apply_stored(
        self, worker_id: int, parent_hash: int | None, block_hashes: Sequence[int]
    ) -> None:
        """Record that ``worker_id`` now holds ``block_hashes`` (idempotent per block).

        With ``parent_hash`` (the block before the first), ``block_hashes`` is taken
        for one chain; without, for blocks in no known order. It only decides how new
        blocks are laid out, never the answers. Hashes must be 64-bit unsigned ints.
        """
        pos = self._pos.get(worker_id)
        if pos is None:
            pos = self._position(worker_id)
        log = self._logs[pos]
        mark = len(log)
        log.extend(block_hashes)  # first: it rejects a hash that is not a u64
        n = len(log) - mark
        if not n:
            return
        where = self._where
        if n <= _SEGMENT_BLOCKS and where.keys().isdisjoint(block_hashes):
            # the common case, all new: a few C calls
            if parent_hash is None and n < _MIN_RUN:
                fresh: dict[int, int | bytearray] = dict.fromkeys(block_hashes, self._masks[pos])
                if len(fresh) == n:  # (else a hash repeats: the loop below)
                    where.update(fresh)
                    self._counts[pos] += n
                    return
            else:
                bits = self._bits[pos]
                seg = None if parent_hash is None else self._extendable(parent_hash, n)
                if seg is None:
                    seg = bytearray()
                end = len(seg) // (8 + len(bits)) * 8
                fresh = dict.fromkeys(block_hashes, seg)
                if len(fresh) == n:
                    seg[end:end] = log[mark:]
                    seg += bits * n
                    where.update(fresh)
                    self._counts[pos] += n
                    return
        del log[mark:]
        width = self._width
        bit = self._masks[pos]
        byte, bit8 = pos >> 3, 1 << (pos & 7)
        added: list[int] = []
        new: list[int] = []  # consecutive new blocks, stored as one run
        new_parent = prev = parent_hash
        for h in dict.fromkeys(block_hashes):
            v = where.get(h)
            if v is None:
                if not new:
                    new_parent = prev
                new.append(h)
            else:
                if new:  # first: appending may move h to a new segment
                    self._append(pos, new_parent, new)
                    added += new
                    new = []
                    v = where[h]
                if isinstance(v, int):
                    if not v & bit:
                        where[h] = v | bit
                        added.append(h)
                else:
                    blocks = len(v) // (8 + width)
                    at = 8 * blocks + _offset(v, h.to_bytes(8, "little"), blocks) * width + byte
                    if not v[at] & bit8:
                        v[at] |= bit8
                        added.append(h)
            if parent_hash is not None:
                prev = h
        if new:
            self._append(pos, new_parent, new)
            added += new
        log.extend(added)
        self._counts[pos] += len(added)

    def _append(self, pos: int, parent: int | None, hashes: list[int]) -> None:
        """Store new blocks (absent from the index, no repeats) after ``parent`` (None:
        no known order): at the end of its segment when that ends there and has room,
        else in new segments; a short run without a parent block by block."""
        where = self._where
        if parent is None and len(hashes) < _MIN_RUN:
            where.update(dict.fromkeys(hashes, self._masks[pos]))
            return
        raw = array("Q", hashes).tobytes()
        bits = self._bits[pos]
        width = len(bits)
        n = len(hashes)
        i = 0
        while i < n:
            take = min(_SEGMENT_BLOCKS, n - i)
            seg = self._extendable(parent, take) if parent is not None else None
            if seg is None:
                seg = bytearray()
            blocks = len(seg) // (8 + width)
            seg[8 * blocks : 8 * blocks] = raw[8 * i : 8 * (i + take)]
            seg += bits * take
            chunk = hashes[i : i + take]
            where.update(dict.fromkeys(chunk, seg))
            parent = chunk[-1]
            i += take

    def _extendable(self, parent: int, n: int) -> bytearray | None:
        """The segment that live block ``parent`` ends if ``n`` more blocks fit there;
        None when a new segment must start (splitting at ``parent`` if it is inside).
        A parent stored on its own becomes a one-block segment first."""
        v = self._where.get(parent)
        if v is None or parent in self._branches:
            return None
        width = self._width
        if isinstance(v, int):
            seg = bytearray(parent.to_bytes(8, "little") + v.to_bytes(width, "little"))
            self._where[parent] = seg
            return seg if 1 + n <= _SEGMENT_BLOCKS else None
        blocks = len(v) // (8 + width)
        if v[8 * blocks - 8 : 8 * blocks] != parent.to_bytes(8, "little"):
            self._split(v, parent, blocks)
            return None
        return v if blocks + n <= _SEGMENT_BLOCKS else None

    def _split(self, seg: bytearray, parent: int, blocks: int) -> None:
        """``parent``, inside ``seg``, gets a second child: move the blocks after it
        into a segment of their own and mark it a branch point."""
        width = self._width
        at = _offset(seg, parent.to_bytes(8, "little"), blocks) + 1
        tail = seg[8 * at : 8 * blocks] + seg[8 * blocks + at * width :]
        del seg[8 * blocks + at * width :]
        del seg[8 * at : 8 * blocks]
        where = self._where
        for h in array("Q", tail[: 8 * (blocks - at)]):
            if where.get(h) is seg:
                where[h] = tail
        self._branches[parent] = None

    def apply_removed(self, worker_id: int, block_hashes: Sequence[int]) -> None:
        """Record that ``worker_id`` evicted ``block_hashes``; unknown ones are ignored."""
        pos = self._pos.get(worker_id)
        if pos is None:
            return
        count = self._counts[pos] - self._drop(pos, block_hashes)
        self._counts[pos] = count
        log = self._logs[pos]
        if len(log) > 2 * count + _MIN_COMPACT:
            self._logs[pos] = array("Q", [h for h in dict.fromkeys(log) if self._holds(pos, h)])

    def _drop(self, pos: int, block_hashes: Sequence[int]) -> int:
        """Clear ``pos``'s bit on ``block_hashes``; returns how many it had."""
        where = self._where
        width = self._width
        zero = bytes(width)
        bit = self._masks[pos]
        byte, bit8 = pos >> 3, 1 << (pos & 7)
        dropped = 0
        for h in block_hashes:
            v = where.get(h)
            if v is None:
                continue
            if isinstance(v, int):
                if not v & bit:
                    continue
                dropped += 1
                if v != bit:
                    where[h] = v ^ bit
                    continue
            else:
                blocks = len(v) // (8 + width)
                o = _offset(v, h.to_bytes(8, "little"), blocks)
                start = 8 * blocks + o * width
                if not v[start + byte] & bit8:
                    continue
                v[start + byte] ^= bit8
                dropped += 1
                if v[start : start + width] != zero:
                    continue
                if o == blocks - 1:  # cut it and the dead blocks before it off the end
                    while blocks and v[len(v) - width :] == zero:
                        del v[len(v) - width :]
                        blocks -= 1
                        del v[8 * blocks : 8 * blocks + 8]
            del where[h]  # no holder left
            self._branches.pop(h, None)
        return dropped

    def clear_worker(self, worker_id: int) -> None:
        """Forget every block of ``worker_id`` but keep it known (AllBlocksCleared)."""
        pos = self._pos.get(worker_id)
        if pos is None:
            return
        self._drop(pos, self._logs[pos])
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
        self._templates.clear()

    # --- queries ------------------------------------------------------------------

    def find_matches(self, block_hashes: Sequence[int]) -> dict[int, int]:
        """Each worker's overlap: how many leading ``block_hashes`` it holds consecutively.

        Workers with no overlap are absent from the result.
        """
        out: dict[int, int] = {}
        if not block_hashes:
            return out
        get = self._where.get
        v = get(block_hashes[0])
        if v is None:
            return out
        n = len(block_hashes)
        q = b""  # the query's hashes as bytes, made when it first enters a segment
        width = self._width
        cur = -1  # the workers holding every block so far (-1: before the first)
        i = 0  # blocks matched so far
        while True:
            if type(v) is int:  # blocks stored on their own: one lookup each
                for i, h in enumerate(block_hashes[i:], i):  # noqa: B020
                    v = get(h)
                    if v.__class__ is not int:  # (cheaper than type(v) on this path)
                        break
                    held = cur & v
                    if held != cur:
                        if cur != -1:
                            out = self._emit(out, cur ^ held, i)
                        if not held:
                            return out
                        cur = held
                else:
                    i += 1
                    break
                if v is None:
                    break
            if type(v) is bytearray:
                if not q:
                    try:
                        q = array("Q", block_hashes).tobytes()
                    except (OverflowError, TypeError):  # not a u64: ends the match
                        q = array("Q", takewhile(_is_u64, block_hashes)).tobytes()
                seg = v
                blocks = len(seg) // (8 + width)
                key = q[8 * i : 8 * i + 8]
                o = seg.find(key, 0, 8 * blocks)
                o = _offset(seg, key, blocks) if o & 7 else o >> 3
                k = blocks - o if blocks - o < (len(q) >> 3) - i else (len(q) >> 3) - i
                if seg[8 * o : 8 * (o + k)] != q[8 * i : 8 * (i + k)]:  # the query leaves
                    if seg[8 * o + 8 : 8 * o + 16] != q[8 * i + 8 : 8 * i + 16]:
                        k = 1
                    else:
                        k = _common_prefix(seg, 8 * o, q, 8 * i, k)
                masks = 8 * blocks + o * width  # block o's worker bits
                at = masks
                end = at + k * width
                while at < end:  # one pass per run of blocks with the same holders
                    first = seg[at : at + width]
                    run = (end - at) // width
                    if run > 1 and seg[at:end] != first * run:
                        run = _same_run(seg, at, first, run)
                    m = _from_bytes(first, "little")
                    if not m:  # a dead copy: the block may live on elsewhere
                        break
                    held = cur & m
                    if held != cur:
                        if cur != -1:
                            out = self._emit(out, cur ^ held, i + (at - masks) // width)
                        if not held:
                            return out
                        cur = held
                    at += run * width
                i += (at - masks) // width
                if i >= n:
                    break
                v = get(block_hashes[i])
                if v is None:
                    break
        return self._emit(out, cur, i)

    def _emit(self, out: dict[int, int], mask: int, depth: int) -> dict[int, int]:
        """``out`` plus ``{worker id: depth}`` for the workers in ``mask``."""
        t = self._templates.get(mask << 32 | depth)  # depth < 2**32
        if t is None:
            t = self._template(mask, depth)
        if out:
            out.update(t)
            return out
        return t.copy()

    def _template(self, mask: int, depth: int) -> dict[int, int]:
        """Memoised: the same sets of workers recur at the same depths, and copying a
        dict beats building one."""
        templates = self._templates
        if len(templates) >= _MEMO_MAX:
            templates.clear()
        ids = self._ids
        found = []
        m = mask
        while m:
            low = m & -m
            found.append(ids[low.bit_length() - 1])
            m ^= low
        t = templates[mask << 32 | depth] = dict.fromkeys(found, depth)
        return t


def _is_u64(h: object) -> bool:
    return isinstance(h, int) and 0 <= h < _U64


def _offset(seg: bytearray, key: bytes, blocks: int) -> int:
    """Where the live block whose hash bytes are ``key`` sits in ``seg`` (which holds it)."""
    at = seg.find(key, 0, 8 * blocks)
    while at & 7 and at > 0:  # a match across two hashes: look further
        at = seg.find(key, at + 1, 8 * blocks)
    assert at >= 0, "index invariant: a block's segment holds it"
    return at >> 3


def _common_prefix(a: bytearray, ao: int, b: bytes, bo: int, hi: int) -> int:
    """How many leading 8-byte hashes ``a[ao:]`` and ``b[bo:]`` share, knowing that
    the first two match and the first ``hi`` do not all."""
    lo = 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[ao + 8 * lo : ao + 8 * mid] == b[bo + 8 * lo : bo + 8 * mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _same_run(seg: bytearray, at: int, first: bytearray, hi: int) -> int:
    """How many bit arrays from ``seg[at:]`` equal ``first``, knowing that fewer than
    ``hi`` do."""
    width = len(first)
    lo = 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if seg[at + lo * width : at + mid * width] == first * (mid - lo):
            lo = mid
        else:
            hi = mid
    return lo
