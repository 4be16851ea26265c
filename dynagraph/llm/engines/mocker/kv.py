"""A paged KV block pool with prefix caching, as vLLM v1 keeps it. Pure: no I/O, no clock.

Mirrors ``vllm/v1/core/block_pool.py`` and the full-attention manager:

- ``num_blocks`` blocks of ``block_size`` tokens; block 0 is vLLM's *null block* and
  is never handed out, so ``num_blocks - 1`` are usable.
- A request owns a list of blocks; a block shared by prefix hits has ``ref_cnt > 1``.
- Only *full* blocks are cached, keyed by their chained 64-bit hash
  (``BlockHasher.block_hashes``: the value vLLM publishes, so a Router's index works
  unchanged). One hash may map to several blocks (two requests that computed the same
  block at once): vLLM does not deduplicate, and neither does this.
- Free blocks wait in one queue, head evicted first. Freeing a request's blocks walks
  them tail first; a block with no hash goes to the *head* (reused first), a cached
  block to the *tail* (kept longest: LRU). Taking a free block that has a hash evicts
  it from the cache. A prefix hit on a free cached block takes it out of the queue.
  (Blocks never used yet are not objects: the queue is *freed-to-head* + the unused
  ids in order + *freed-to-tail*, so an engine costs memory for the blocks it used.)

Events (``dynagraph.llm.router.events``), buffered until :meth:`take_events`:

- ``BlocksStored`` when :meth:`cache_blocks` caches newly full blocks of a request:
  one event per call with the new hashes in chain order, ``parent_hash`` the hash of
  the block before them (``None`` from the first block) and ``block_size``;
- ``BlocksRemoved`` (one hash each) when a cached block is evicted for reuse;
- ``AllCleared`` when :meth:`reset_prefix_cache` succeeds.

The scheduler decides *when* (vLLM caches a request's blocks when it allocates slots for
the tokens that fill them, in the step that computes them).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from dynagraph.llm.router.events import AllCleared, BlocksRemoved, BlocksStored, KvEvent


class KvBlock:
    """One KV block. ``block_hash`` is set while the block is in the prefix cache."""

    __slots__ = ("block_hash", "block_id", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None

    def __repr__(self) -> str:
        return f"KvBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


NULL_BLOCK_ID = 0


class KvBlockManager:
    """Blocks, ref counts, the prefix cache and the free queue of one engine.

    Verbs come in pairs: :meth:`find_cached` / :meth:`can_allocate` ask, :meth:`allocate`
    / :meth:`cache_blocks` / :meth:`free` act. A request id identifies a block list.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        emit_events: bool = True,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (one is the null block), got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.emit_events = emit_events and enable_prefix_caching
        self._blocks: dict[int, KvBlock] = {}
        self._front: OrderedDict[int, KvBlock] = OrderedDict()
        self._fresh = NULL_BLOCK_ID + 1
        """The lowest block id never handed out; it and those above wait between
        ``_front`` and ``_back`` in the free queue."""
        self._back: OrderedDict[int, KvBlock] = OrderedDict()
        self._cached: dict[int, dict[int, KvBlock]] = {}
        self._req_blocks: dict[str, list[KvBlock]] = {}
        self._num_cached: dict[str, int] = {}
        self._events: list[KvEvent] = []

    # -- questions ------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out (cached ones with no owner included)."""
        return len(self._front) + self.num_blocks - self._fresh + len(self._back)

    @property
    def num_used_blocks(self) -> int:
        """Blocks owned by at least one request (the null block not counted)."""
        return self.num_blocks - 1 - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / (self.num_blocks - 1)

    @property
    def num_cached_hashes(self) -> int:
        return len(self._cached)

    def free_queue(self) -> list[int]:
        """Block ids in eviction order (head first). For tests and debugging."""
        return [*self._front, *range(self._fresh, self.num_blocks), *self._back]

    def block(self, block_id: int) -> KvBlock:
        """A block handed out at least once (KeyError for others). For tests."""
        return self._blocks[block_id]

    def ref_counts(self) -> dict[int, int]:
        """Block id -> ref count of every owned block. For tests."""
        return {i: b.ref_cnt for i, b in sorted(self._blocks.items()) if b.ref_cnt}

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(request_id, ())]

    def has_blocks(self, request_id: str) -> bool:
        return request_id in self._req_blocks

    def is_cached(self, block_hash: int) -> bool:
        return block_hash in self._cached

    def find_cached(self, block_hashes: Sequence[int], max_tokens: int) -> list[KvBlock]:
        """The longest run of cached blocks that starts the sequence, covering at most
        ``max_tokens`` tokens (vLLM passes ``num_tokens - 1``: the last token is always
        computed to get logits). No side effects."""
        if not self.enable_prefix_caching:
            return []
        hits: list[KvBlock] = []
        limit = min(len(block_hashes), max_tokens // self.block_size)
        cached = self._cached
        for i in range(limit):
            blocks = cached.get(block_hashes[i])
            if blocks is None:
                break
            hits.append(next(iter(blocks.values())))
        return hits

    def blocks_needed(
        self, request_id: str, num_tokens: int, hits: Sequence[KvBlock] = ()
    ) -> int:
        """Free blocks :meth:`allocate` would take to give the request ``num_tokens`` slots
        (a hit on a free cached block takes it out of the free queue, so it counts)."""
        required = -(-num_tokens // self.block_size)
        owned = len(self._req_blocks.get(request_id, ()))
        new = max(required - owned - len(hits), 0)
        return new + sum(1 for b in hits if b.ref_cnt == 0)

    def can_allocate(
        self, request_id: str, num_tokens: int, hits: Sequence[KvBlock] = (), reserve: int = 0
    ) -> bool:
        """Whether :meth:`allocate` would succeed while leaving ``reserve`` blocks free."""
        return self.blocks_needed(request_id, num_tokens, hits) + reserve <= self.num_free_blocks

    # -- actions --------------------------------------------------------------------------

    def allocate(
        self, request_id: str, num_tokens: int, hits: Sequence[KvBlock] = (), reserve: int = 0
    ) -> bool:
        """Give the request slots for ``num_tokens`` tokens in all: first the prefix ``hits``
        (from :meth:`find_cached`, only on its first allocation), then new blocks from
        the head of the free queue. Returns False, changing nothing, if they do not fit."""
        owned = self._req_blocks.get(request_id)
        if owned is not None and not hits:  # a running request: the common case
            missing = -(-num_tokens // self.block_size) - len(owned)
            if missing <= 0:
                return True
            if missing + reserve > self.num_free_blocks:
                return False
        else:
            if not self.can_allocate(request_id, num_tokens, hits, reserve):
                return False
            if owned is None:
                owned = self._req_blocks[request_id] = []
                self._num_cached[request_id] = len(hits)
            for block in hits:
                if block.ref_cnt == 0:
                    if self._back.pop(block.block_id, None) is None:
                        del self._front[block.block_id]
                block.ref_cnt += 1
                owned.append(block)
            missing = -(-num_tokens // self.block_size) - len(owned)
        for _ in range(missing):
            block = self._pop_free()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            owned.append(block)
        return True

    def _pop_free(self) -> KvBlock:
        if self._front:
            return self._front.popitem(last=False)[1]
        if self._fresh < self.num_blocks:
            block = self._blocks[self._fresh] = KvBlock(self._fresh)
            self._fresh += 1
            return block
        return self._back.popitem(last=False)[1]

    def cache_blocks(self, request_id: str, block_hashes: Sequence[int], num_tokens: int) -> None:
        """Put the request's blocks that are full within its first ``num_tokens`` tokens
        into the prefix cache (those not cached yet) and report them stored.
        ``block_hashes`` are the request's chained block hashes (at least that many)."""
        if not self.enable_prefix_caching:
            return
        owned = self._req_blocks.get(request_id)
        if owned is None:
            return
        start = self._num_cached.get(request_id, 0)
        end = min(num_tokens // self.block_size, len(owned), len(block_hashes))
        if end <= start:
            return
        cached = self._cached
        for i in range(start, end):
            block = owned[i]
            h = block_hashes[i]
            block.block_hash = h
            entry = cached.get(h)
            if entry is None:
                cached[h] = {block.block_id: block}
            else:
                entry[block.block_id] = block
        self._num_cached[request_id] = end
        if self.emit_events:
            self._events.append(BlocksStored(
                block_hashes=list(block_hashes[start:end]),
                parent_hash=block_hashes[start - 1] if start else None,
                block_size=self.block_size,
            ))

    def free(self, request_id: str) -> None:
        """Release every block of the request, tail first (see the module docstring)."""
        owned = self._req_blocks.pop(request_id, None)
        self._num_cached.pop(request_id, None)
        if not owned:
            return
        first: list[KvBlock] = []
        back = self._back
        for block in reversed(owned):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    first.append(block)
                else:
                    back[block.block_id] = block
        front = self._front
        for block in reversed(first):
            front[block.block_id] = block
            front.move_to_end(block.block_id, last=False)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only when no request owns a block (as vLLM)."""
        if self.num_used_blocks:
            return False
        self._cached.clear()
        for block in self._blocks.values():
            block.block_hash = None
        if self.emit_events:
            self._events.append(AllCleared())
        return True

    def take_events(self) -> list[KvEvent]:
        """The events since the last call, in order."""
        events, self._events = self._events, []
        return events

    def _evict(self, block: KvBlock) -> None:
        h = block.block_hash
        assert h is not None
        block.block_hash = None
        entry = self._cached.get(h)
        if entry is None or entry.pop(block.block_id, None) is None:
            return
        if not entry:
            del self._cached[h]
        if self.emit_events:
            self._events.append(BlocksRemoved(block_hashes=[h]))
