from __future__ import annotations

import gc
import random

import pytest

from dynagraph.llm.router.index import IndexStats, PrefixIndex

W1, W2, W3 = 0x7F3A_0000_0000_0001, 0x7F3A_0000_0000_0002, 0x7F3A_0000_0000_0003


def reference_matches(held: dict[int, set[int]], q: list[int]) -> dict[int, int]:
    """The reference model's answer: each worker's count of leading query blocks held."""
    expected = {}
    for wid, blocks in held.items():
        k = 0
        while k < len(q) and q[k] in blocks:
            k += 1
        if k:
            expected[wid] = k
    return expected


def lose(idx: PrefixIndex, held: dict[int, set[int]], w: int, drop: list[int] | None,
         forget: bool = False) -> None:
    """Worker ``w`` evicts ``drop``, or (None) clears its cache, or is removed (``forget``),
    in the index and in the reference model alike."""
    if drop is not None:
        idx.apply_removed(w, drop)
        held.get(w, set()).difference_update(drop)
    elif forget:
        idx.remove_worker(w)
        held.pop(w, None)
    else:
        idx.clear_worker(w)
        held[w] = set()


def assert_holdings(idx: PrefixIndex, held: dict[int, set[int]]) -> None:
    for w, blocks in held.items():
        assert idx.num_blocks(w) == len(blocks)
        assert idx.worker_blocks(w) == blocks


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
            lose(idx, held, w, rng.sample(chain, 2))
        else:
            lose(idx, held, w, None, forget=action >= 0.98)
        if step % 50 == 0:
            for q in chains:
                assert idx.find_matches(q) == reference_matches(held, q)
    assert_holdings(idx, held)
    assert idx.stats().entries == sum(len(b) for b in held.values())


def test_a_query_hash_that_is_not_u64_ends_the_match() -> None:
    idx = PrefixIndex()
    idx.apply_stored(W1, None, [1, 2, 3])
    assert idx.find_matches([1, 2, -5, 3]) == {W1: 2}
    assert idx.find_matches([1, 1 << 64]) == {W1: 1}
    assert idx.find_matches((1, 2, 3)) == {W1: 3}
    assert idx.find_matches([-1, 1]) == {}


def test_blocks_stored_without_a_parent_are_stored_alone_unless_a_long_run() -> None:
    idx = PrefixIndex()
    idx.apply_stored(W1, None, [1, 2, 3])  # e.g. decode blocks of several requests
    assert all(isinstance(idx._where[h], int) for h in (1, 2, 3))
    run = list(range(100, 108))  # a prefill
    idx.apply_stored(W1, None, run)
    assert len({id(idx._where[h]) for h in run}) == 1
    idx.apply_stored(W2, 3, [4])  # a parent named: 3 becomes a segment that 4 extends
    assert idx._where[3] is idx._where[4]
    assert idx.find_matches([1, 2, 3, 4]) == {W1: 3}
    assert idx.find_matches([3, 4, 100]) == {W1: 1}  # W2 lacks block 3
    idx.apply_stored(W2, None, [3])
    assert idx.find_matches([3, 4, 100]) == {W1: 1, W2: 2}


def test_a_chain_stored_in_steps_shares_one_segment_until_it_branches() -> None:
    idx = PrefixIndex()
    chain = [0x1000 + i for i in range(40)]
    idx.apply_stored(W1, None, chain[:16])
    idx.apply_stored(W1, chain[15], chain[16:24])
    idx.apply_stored(W1, chain[23], chain[24:25])  # a decode block
    assert len({id(idx._where[h]) for h in chain[:25]}) == 1
    other = [0x2000 + i for i in range(8)]
    idx.apply_stored(W2, chain[15], other)  # a second child of block 15: split there
    assert idx._where[chain[0]] is idx._where[chain[15]]
    assert idx._where[chain[16]] is idx._where[chain[24]] is not idx._where[chain[0]]
    assert idx._where[other[0]] is not idx._where[chain[16]]
    idx.apply_stored(W2, chain[15], [0x3000])  # a branch point is not extended
    assert idx._where[0x3000] is not idx._where[chain[15]]
    idx.apply_stored(W2, None, chain[:16])
    assert idx.find_matches(chain[:16] + other + [7]) == {W1: 16, W2: 24}
    assert idx.find_matches(chain[:30]) == {W1: 25, W2: 16}
    assert idx.find_matches(chain[:16] + [0x3000]) == {W1: 16, W2: 17}


def test_a_removed_block_stored_again_elsewhere_is_found() -> None:
    idx = PrefixIndex()
    idx.apply_stored(W1, 0xFEED, [1, 2, 3, 4])  # a parent named: one segment
    assert idx._where[1] is idx._where[4]
    idx.apply_removed(W1, [3])  # a dead copy stays inside the segment
    assert idx.find_matches([1, 2, 3, 4]) == {W1: 2}
    idx.apply_stored(W2, 2, [3])  # 3 lives again, in a segment of its own
    assert idx.find_matches([1, 2, 3, 4]) == {W1: 2}
    idx.apply_stored(W1, 2, [3])
    assert idx.find_matches([1, 2, 3, 4]) == {W1: 4}
    idx.apply_removed(W1, [4])
    idx.apply_removed(W2, [3])
    assert idx.find_matches([1, 2, 3, 4]) == {W1: 3}
    assert idx.stats() == IndexStats(2, 3, 3)


def test_more_than_64_workers_widen_the_bit_arrays_in_place() -> None:
    idx = PrefixIndex()
    shared = [11, 12, 13]
    workers = [0x7000 + w for w in range(200)]
    for k, w in enumerate(workers):
        idx.apply_stored(w, 10, shared[: 1 + k % 3])  # after block 10: one segment
    expected = {w: 1 + k % 3 for k, w in enumerate(workers)}
    assert idx.find_matches(shared + [14]) == expected
    idx.remove_worker(workers[70])
    del expected[workers[70]]
    assert idx.find_matches(shared) == expected
    assert idx.stats() == IndexStats(199, 3, sum(expected.values()))
    assert isinstance(idx._where[11], bytearray)


def test_index_holds_nothing_the_cyclic_gc_tracks() -> None:
    idx = PrefixIndex()
    rng = random.Random(3)
    chains = [[rng.getrandbits(64) for _ in range(30)] for _ in range(10)]
    for w in range(80):
        for c in rng.sample(chains, 3):
            idx.apply_stored(w, None, c[:10])
            idx.apply_stored(w, c[9], c[10:])
        idx.apply_removed(w, chains[0][25:])
    results = [idx.find_matches(c) for c in chains]
    gc.collect()
    for held in (idx._where, idx._branches, *idx._where.values(), *results):
        assert not gc.is_tracked(held)
    assert not any(gc.is_tracked(t) for t in idx._templates.values())  # a bounded memo


@pytest.mark.parametrize("seed", range(6))
def test_chains_branches_and_evictions_against_a_reference_model(seed: int) -> None:
    """Real chains (parents given, branching, longer than a segment), holes, blocks
    stored again after dying, clears and departures, the fleet growing past 64."""
    rng = random.Random(seed)
    small = seed % 2 == 0  # small hashes: byte matches across two hashes in a segment
    count = iter(range(1, 1 << 30))

    def new_hash() -> int:
        return next(count) * 257 if small else rng.getrandbits(64)

    chains: list[list[int]] = []
    for _ in range(24):
        base = rng.choice(chains) if chains and rng.random() < 0.7 else []
        cut = rng.randint(1, len(base)) if base else 0
        chains.append(base[:cut] + [new_hash() for _ in range(rng.randint(1, 300))])
    workers = [rng.getrandbits(63) for _ in range(90)]
    live = workers[:20]
    idx = PrefixIndex()
    held: dict[int, set[int]] = {}
    for step in range(1500):
        if rng.random() < 0.03 and len(live) < len(workers):
            live.append(workers[len(live)])
        w = rng.choice(live)
        chain = rng.choice(chains)
        action = rng.random()
        if action < 0.4:
            s = rng.randrange(len(chain))
            blocks = chain[s : s + rng.choice([1, 2, 8, 40, 200])]
            idx.apply_stored(w, chain[s - 1] if s else None, blocks)
            held.setdefault(w, set()).update(blocks)
        elif action < 0.55:  # like the Router's relay: several chains' blocks, no parent
            blocks = []
            for c in rng.sample(chains, 3):
                s = rng.randrange(len(c))
                blocks += c[s : s + rng.choice([1, 1, 3, 12])]
            idx.apply_stored(w, None, blocks)
            held.setdefault(w, set()).update(blocks)
        elif action < 0.92:
            if rng.random() < 0.5:
                s = rng.randrange(len(chain))
                drop = chain[s : s + rng.randint(1, 30)]
            else:
                drop = rng.sample(chain, min(len(chain), 4))
            lose(idx, held, w, drop)
        else:
            lose(idx, held, w, None, forget=action >= 0.98)
        if step % 30 == 0:
            for q in rng.sample(chains, 4):
                q = q[: rng.randint(1, len(q))] + [new_hash()]
                assert idx.find_matches(q) == reference_matches(held, q)
    assert_holdings(idx, held)
    assert idx.stats().unique_blocks == len(set().union(*held.values()))


def test_a_walk_through_a_dead_copy_looks_the_block_up_again() -> None:
    idx = PrefixIndex()
    idx.apply_stored(W1, 0xFEED, [1, 2, 3, 4])
    idx.apply_removed(W1, [3])
    idx.apply_stored(W1, None, [3])  # no parent given: the dead copy stays in place
    assert idx._where[3] == 1 << idx._pos[W1]  # 3 is stored on its own
    assert idx.find_matches([1, 2, 3, 4]) == {W1: 4}
    idx.apply_stored(W2, None, [1, 2, 3])
    assert idx.find_matches([1, 2, 3, 4, 5]) == {W1: 4, W2: 3}


def test_hash_bytes_straddling_two_hashes_are_not_taken_for_a_block() -> None:
    idx = PrefixIndex()
    straddle = 7 << 32  # little-endian: the upper half of 5 and the lower half of 7
    idx.apply_stored(W1, 0xFEED, [5, 7, straddle, 9])
    idx.apply_stored(W2, 7, [straddle])
    assert idx.find_matches([straddle, 9]) == {W1: 2, W2: 1}
    idx.apply_removed(W1, [straddle])
    assert idx.find_matches([5, 7, straddle]) == {W1: 2}
    assert idx.worker_blocks(W1) == {5, 7, 9}
