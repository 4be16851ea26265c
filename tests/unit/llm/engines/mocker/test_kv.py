"""KvBlockManager: exact block ids, ref counts, free-queue order and events."""

from __future__ import annotations

import pytest

from dynagraph.llm.engines.mocker.kv import KvBlockManager
from dynagraph.llm.router.events import AllCleared, BlocksRemoved, BlocksStored
from dynagraph.llm.router.hashing import BlockHasher

BS = 4
HASHER = BlockHasher(BS)


def refs(kv: KvBlockManager) -> dict[int, int]:
    return kv.ref_counts()


@pytest.fixture
def kv() -> KvBlockManager:
    return KvBlockManager(6, BS)  # block 0 is the null block: 1..5 usable


def test_fresh_pool(kv: KvBlockManager) -> None:
    assert kv.free_queue() == [1, 2, 3, 4, 5]
    assert (kv.num_free_blocks, kv.num_used_blocks, kv.usage) == (5, 0, 0.0)
    assert kv.take_events() == []


def test_allocate_takes_blocks_from_the_head(kv: KvBlockManager) -> None:
    assert kv.blocks_needed("a", 10) == 3
    assert kv.allocate("a", 10)
    assert kv.block_ids("a") == [1, 2, 3]
    assert kv.free_queue() == [4, 5]
    assert refs(kv) == {1: 1, 2: 1, 3: 1}
    assert kv.allocate("a", 12)  # 12 tokens still fit in 3 blocks
    assert kv.block_ids("a") == [1, 2, 3]
    assert kv.allocate("a", 13)
    assert kv.block_ids("a") == [1, 2, 3, 4]
    assert kv.usage == pytest.approx(4 / 5)


def test_allocate_that_does_not_fit_changes_nothing(kv: KvBlockManager) -> None:
    assert not kv.can_allocate("a", 21)
    assert not kv.allocate("a", 21)
    assert kv.free_queue() == [1, 2, 3, 4, 5]
    assert not kv.has_blocks("a")
    assert kv.allocate("a", 8)
    assert not kv.allocate("b", 16, reserve=1)  # 3 free; 4 wanted with 1 kept back
    assert kv.allocate("b", 8, reserve=1)


def test_cache_blocks_stores_only_full_blocks_with_chained_hashes(kv: KvBlockManager) -> None:
    tokens = list(range(100, 110))
    hashes = HASHER.block_hashes(tokens)  # 2 full blocks
    kv.allocate("a", 10)
    kv.cache_blocks("a", hashes, 6)  # one full block computed so far
    kv.cache_blocks("a", hashes, 7)  # nothing new
    kv.cache_blocks("a", hashes, 10)
    assert kv.take_events() == [
        BlocksStored(block_hashes=[hashes[0]], parent_hash=None, block_size=BS),
        BlocksStored(block_hashes=[hashes[1]], parent_hash=hashes[0], block_size=BS),
    ]
    assert [kv.block(i).block_hash for i in (1, 2, 3)] == [hashes[0], hashes[1], None]
    assert kv.take_events() == []


def test_prefix_hit_shares_blocks_and_free_order_is_vllms(kv: KvBlockManager) -> None:
    a = list(range(100, 110))
    ha = HASHER.block_hashes(a)
    kv.allocate("a", 10)
    kv.cache_blocks("a", ha, 10)
    b = a[:8] + [7, 7, 7]
    hb = HASHER.block_hashes(b)
    assert hb[:2] == ha[:2]
    hits = kv.find_cached(hb, len(b) - 1)
    assert [h.block_id for h in hits] == [1, 2]
    assert kv.blocks_needed("b", 11, hits) == 1
    assert kv.allocate("b", 11, hits)
    assert kv.block_ids("b") == [1, 2, 4]
    assert refs(kv) == {1: 2, 2: 2, 3: 1, 4: 1}

    kv.free("a")  # block 3 has no hash: to the head; 1 and 2 are still used by b
    assert refs(kv) == {1: 1, 2: 1, 4: 1}
    assert kv.free_queue() == [3, 5]
    kv.free("b")  # tail first: 4 (no hash) to the head, then 2 and 1 (cached) to the tail
    assert kv.free_queue() == [4, 3, 5, 2, 1]
    assert kv.num_used_blocks == 0
    kv.take_events()

    # reusing the pool evicts the cached blocks in LRU order: the prefix's tail first
    assert kv.allocate("c", 16)
    assert kv.block_ids("c") == [4, 3, 5, 2]
    assert kv.take_events() == [BlocksRemoved(block_hashes=[ha[1]])]
    assert kv.is_cached(ha[0]) and not kv.is_cached(ha[1])
    assert [h.block_id for h in kv.find_cached(ha, 10)] == [1]


def test_a_hit_on_a_free_cached_block_takes_it_out_of_the_queue(kv: KvBlockManager) -> None:
    a = list(range(8))
    ha = HASHER.block_hashes(a)
    kv.allocate("a", 8)
    kv.cache_blocks("a", ha, 8)
    kv.free("a")
    assert kv.free_queue() == [3, 4, 5, 2, 1]
    hits = kv.find_cached(ha, 7)  # the last token is always recomputed: one block
    assert [h.block_id for h in hits] == [1]
    assert kv.blocks_needed("a2", 8, hits) == 2  # one new block + the free hit
    assert kv.allocate("a2", 8, hits)
    assert kv.block_ids("a2") == [1, 3]
    assert kv.free_queue() == [4, 5, 2]
    assert kv.take_events() == [BlocksStored(block_hashes=ha, parent_hash=None, block_size=BS)]


def test_the_same_block_computed_twice_is_cached_twice(kv: KvBlockManager) -> None:
    tokens = list(range(4))
    (h,) = HASHER.block_hashes(tokens)
    for rid in ("a", "b"):  # neither hit: both were scheduled before either was cached
        kv.allocate(rid, 4)
    kv.cache_blocks("a", [h], 4)
    kv.cache_blocks("b", [h], 4)
    stored = BlocksStored(block_hashes=[h], parent_hash=None, block_size=BS)
    assert kv.take_events() == [stored, stored]
    kv.free("a")
    kv.free("b")
    assert kv.free_queue() == [3, 4, 5, 1, 2]
    kv.allocate("c", 16)  # evicts 1 (one copy of h gone), 2 stays cached
    assert kv.block_ids("c") == [3, 4, 5, 1]
    assert kv.take_events() == [BlocksRemoved(block_hashes=[h])]
    assert [b.block_id for b in kv.find_cached([h], 8)] == [2]


def test_reset_prefix_cache_only_when_nothing_is_used(kv: KvBlockManager) -> None:
    hashes = HASHER.block_hashes(list(range(8)))
    kv.allocate("a", 8)
    kv.cache_blocks("a", hashes, 8)
    kv.take_events()
    assert not kv.reset_prefix_cache()
    kv.free("a")
    assert kv.reset_prefix_cache()
    assert kv.take_events() == [AllCleared()]
    assert kv.find_cached(hashes, 100) == []
    assert kv.num_cached_hashes == 0


def test_prefix_caching_off_caches_and_reports_nothing() -> None:
    kv = KvBlockManager(6, BS, enable_prefix_caching=False)
    hashes = HASHER.block_hashes(list(range(8)))
    kv.allocate("a", 8)
    kv.cache_blocks("a", hashes, 8)
    kv.free("a")
    assert kv.find_cached(hashes, 100) == []
    assert kv.free_queue() == [2, 1, 3, 4, 5]  # every block is uncached: LIFO reuse
    assert kv.take_events() == []


def test_events_can_be_turned_off_without_turning_caching_off() -> None:
    kv = KvBlockManager(6, BS, emit_events=False)
    hashes = HASHER.block_hashes(list(range(8)))
    kv.allocate("a", 8)
    kv.cache_blocks("a", hashes, 8)
    assert kv.take_events() == []
    assert len(kv.find_cached(hashes, 8)) == 2


def test_freeing_an_unknown_request_is_a_no_op(kv: KvBlockManager) -> None:
    kv.free("nobody")
    assert kv.free_queue() == [1, 2, 3, 4, 5]


def test_pool_needs_a_null_block_and_one_more() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        KvBlockManager(1, BS)
    with pytest.raises(ValueError, match="block_size"):
        KvBlockManager(4, 0)
