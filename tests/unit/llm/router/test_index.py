from __future__ import annotations

import random

import pytest

from dynagraph.llm.router.index import IndexStats, PrefixIndex

W1, W2, W3 = 0x7F3A_0000_0000_0001, 0x7F3A_0000_0000_0002, 0x7F3A_0000_0000_0003


def test_empty_index() -> None:
    idx = PrefixIndex()
    assert idx.find_matches([]) == {}
    assert idx.find_matches([1, 2, 3]) == {}
    assert idx.num_blocks(W1) == 0
    assert idx.stats() == IndexStats(0, 0, 0)


def test_overlap_counts_leading_consecutive_blocks() -> None:
    idx = PrefixIndex()
    idx.apply_stored(W1, None, [10, 11, 12, 13])
    idx.apply_stored(W2, None, [10, 11])
    idx.apply_stored(W3, None, [20])
    assert idx.find_matches([10, 11, 12, 13, 14]) == {W1: 4, W2: 2}
    assert idx.find_matches([10, 11, 99, 13]) == {W1: 2, W2: 2}
    assert idx.find_matches([20, 10]) == {W3: 1}
    assert idx.find_matches([11, 12]) == {W1: 2, W2: 1}
    assert idx.find_matches([99, 10]) == {}


def test_parent_chain_extension() -> None:
    idx = PrefixIndex()
    idx.apply_stored(W1, None, [1, 2])
    idx.apply_stored(W1, 2, [3, 4])
    assert idx.find_matches([1, 2, 3, 4]) == {W1: 4}
    assert idx.num_blocks(W1) == 4


def test_repeated_hash_within_one_call_counts_once() -> None:
    idx = PrefixIndex()
    idx.apply_stored(W1, None, [1, 2, 1])
    assert idx.num_blocks(W1) == 2
    assert sorted(idx._logs[idx._pos[W1]]) == [1, 2]
    assert idx.find_matches([1, 2]) == {W1: 2}


def test_a_hash_that_is_not_u64_is_rejected_without_damage() -> None:
    idx = PrefixIndex()
    idx.apply_stored(W1, None, [1])
    for bad in ([5, -1], [5, 1 << 64]):
        with pytest.raises(OverflowError):
            idx.apply_stored(W1, None, bad)
    assert idx.stats() == IndexStats(1, 1, 1)
    assert idx.worker_blocks(W1) == {1}


def test_stored_is_idempotent() -> None:
    idx = PrefixIndex()
    idx.apply_stored(W1, None, [1, 2, 3])
    idx.apply_stored(W1, None, [1, 2, 3])
    assert idx.num_blocks(W1) == 3
    assert idx.stats() == IndexStats(1, 3, 3)


def test_removing_a_middle_block_cuts_the_overlap() -> None:
    idx = PrefixIndex()
    idx.apply_stored(W1, None, [1, 2, 3, 4])
    idx.apply_stored(W2, None, [1, 2, 3, 4])
    idx.apply_removed(W1, [2])
    assert idx.find_matches([1, 2, 3, 4]) == {W1: 1, W2: 4}
    assert idx.num_blocks(W1) == 3
    assert idx.worker_blocks(W1) == {1, 3, 4}
    idx.apply_removed(W1, [2, 77])  # already gone / unknown: ignored
    idx.apply_removed(0xDEAD, [1])  # unknown worker: ignored
    assert idx.num_blocks(W1) == 3
    idx.apply_stored(W1, 1, [2])
    assert idx.find_matches([1, 2, 3, 4]) == {W1: 4, W2: 4}


def test_block_forgotten_when_last_holder_removes_it() -> None:
    idx = PrefixIndex()
    idx.apply_stored(W1, None, [1])
    idx.apply_stored(W2, None, [1])
    idx.apply_removed(W1, [1])
    assert idx.stats() == IndexStats(2, 1, 1)
    idx.apply_removed(W2, [1])
    assert idx.stats() == IndexStats(2, 0, 0)
    assert idx.find_matches([1]) == {}


def test_clear_worker_keeps_others() -> None:
    idx = PrefixIndex()
    idx.apply_stored(W1, None, [1, 2, 3])
    idx.apply_stored(W2, None, [1, 2])
    idx.clear_worker(W1)
    assert idx.find_matches([1, 2, 3]) == {W2: 2}
    assert idx.num_blocks(W1) == 0
    assert idx.worker_blocks(W1) == set()
    assert sorted(idx.workers()) == [W1, W2]
    assert idx.stats() == IndexStats(2, 2, 2)
    idx.apply_stored(W1, None, [1])
    assert idx.find_matches([1, 2]) == {W1: 1, W2: 2}


def test_remove_worker_reuses_its_bit_without_leaking_blocks() -> None:
    idx = PrefixIndex()
    idx.apply_stored(W1, None, [1, 2])
    idx.apply_stored(W2, None, [1])
    idx.remove_worker(W1)
    idx.remove_worker(W1)  # idempotent
    assert idx.workers() == [W2]
    idx.apply_stored(W3, None, [5])  # takes W1's old bit position
    assert idx.find_matches([1, 2]) == {W2: 1}
    assert idx.find_matches([5]) == {W3: 1}
    assert idx.stats() == IndexStats(2, 2, 2)


def test_remove_then_restore_cycles_compact_the_log() -> None:
    idx = PrefixIndex()
    hashes = list(range(1, 101))
    idx.apply_stored(W1, None, hashes)
    for _ in range(50):
        idx.apply_removed(W1, hashes[50:])
        idx.apply_stored(W1, hashes[49], hashes[50:])
    assert idx.num_blocks(W1) == 100
    assert idx.worker_blocks(W1) == set(hashes)
    assert len(idx._logs[idx._pos[W1]]) <= 2 * 100 + 1024
    idx.clear_worker(W1)
    assert idx.stats() == IndexStats(1, 0, 0)


def test_many_workers_against_a_reference_model() -> None:
    rng = random.Random(7)
    idx = PrefixIndex()
    held: dict[int, set[int]] = {}
    workers = [rng.getrandbits(63) for _ in range(100)]  # more than 64 bit positions
    chains = [[rng.getrandbits(64) for _ in range(12)] for _ in range(20)]
    for step in range(3000):
        w = rng.choice(workers)
        chain = rng.choice(chains)
        action = rng.random()
        if action < 0.6:
            n = rng.randint(1, len(chain))
            idx.apply_stored(w, None, chain[:n])
            held.setdefault(w, set()).update(chain[:n])
        elif action < 0.95:
            drop = rng.sample(chain, 2)
            idx.apply_removed(w, drop)
            held.get(w, set()).difference_update(drop)
        elif action < 0.98:
            idx.clear_worker(w)
            held[w] = set()
        else:
            idx.remove_worker(w)
            held.pop(w, None)
        if step % 50 == 0:
            for q in chains:
                expected = {}
                for wid, blocks in held.items():
                    k = 0
                    while k < len(q) and q[k] in blocks:
                        k += 1
                    if k:
                        expected[wid] = k
                assert idx.find_matches(q) == expected
    for w, blocks in held.items():
        assert idx.num_blocks(w) == len(blocks)
        assert idx.worker_blocks(w) == blocks
    assert idx.stats().entries == sum(len(b) for b in held.values())
