"""KvEventRelay: vLLM batches -> net block-set deltas -> subscribers (snapshot first)."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from dynagraph.llm.kv.events.relay import BlockSet, KvEventFeed, KvEventRelay
from dynagraph.llm.router.events import AllCleared, BlocksRemoved, BlocksStored, RelayBatch
from dynagraph.llm.router.hashing import BlockHasher
from dynagraph.llm.router.index import PrefixIndex

W = 0xABC


def st(*hashes: int, medium: str | None = "GPU", group: int | None = 0) -> BlocksStored:
    return BlocksStored(list(hashes), None, 32, medium, group)


def rm(*hashes: int) -> BlocksRemoved:
    return BlocksRemoved(list(hashes), "GPU", 0)


def frames(seq: int, events: list[dict[str, Any]], topic: str = "kv") -> list[bytes]:
    payload = msgspec.msgpack.encode([1.0, events, 0])
    return [topic.encode(), seq.to_bytes(8, "big", signed=True), payload]


def ev_stored(hashes: list[int], tokens: list[int] | None = None,
              parent: int | None = None) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens or [], "block_size": 32, "lora_id": None, "medium": "GPU",
            "lora_name": None}


def ev_removed(hashes: list[int]) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}


# --- BlockSet -----------------------------------------------------------------------


def test_blockset_reports_net_changes_in_order() -> None:
    bs = BlockSet()
    d = bs.apply([st(1, 2, 3)])
    assert (d.cleared, d.stored, d.removed) == (False, [1, 2, 3], [])
    d = bs.apply([rm(2), st(4), rm(4), rm(99)])
    assert (d.stored, d.removed) == ([], [2])
    assert bs.hashes() == [1, 3]
    assert not bs.apply([st(5), rm(5)])  # stored and evicted within one batch: no news


def test_blockset_counts_copies() -> None:
    bs = BlockSet()
    bs.apply([st(7)])
    assert not bs.apply([st(7)])  # a second physical copy of the same hash
    assert not bs.apply([rm(7)])  # the first copy goes: still held
    assert 7 in bs
    assert bs.apply([rm(7)]).removed == [7]
    assert len(bs) == 0


def test_blockset_clear_then_store() -> None:
    bs = BlockSet()
    bs.apply([st(1, 2)])
    d = bs.apply([rm(1), AllCleared(), st(2, 3), rm(3)])
    assert (d.cleared, d.stored, d.removed) == (True, [2], [])
    assert bs.hashes() == [2]


def test_blockset_ignores_other_media_and_groups() -> None:
    bs = BlockSet()
    assert not bs.apply([st(1, medium="CPU"), st(2, group=1)])
    assert bs.apply([st(3, medium=None)]).stored == [3]


def test_relay_batch_apply_and_wire_round_trip() -> None:
    index = PrefixIndex()
    RelayBatch(seq=3, snapshot=True, stored=[1, 2, 3]).apply_to(index, W)
    b = RelayBatch(seq=4, stored=[4], removed=[3])
    assert RelayBatch.from_wire(msgspec.msgpack.decode(msgspec.msgpack.encode(b.to_wire()))) == b
    b.apply_to(index, W)
    assert index.worker_blocks(W) == {1, 2, 4}
    RelayBatch(seq=5, cleared=True, stored=[9]).apply_to(index, W)
    assert index.worker_blocks(W) == {9}
    RelayBatch(seq=5, snapshot=True).apply_to(index, W)
    assert index.worker_blocks(W) == set() and W in index.workers()


# --- KvEventRelay -------------------------------------------------------------------


async def _next(it: Any) -> RelayBatch:
    return await asyncio.wait_for(it.__anext__(), 2)


async def test_late_subscriber_gets_snapshot_then_deltas() -> None:
    relay = KvEventRelay()
    relay.handle_frames(frames(0, [ev_stored([1, 2])]))
    sub = relay.subscribe()
    it = aiter(sub)
    assert await _next(it) == RelayBatch(seq=1, snapshot=True, stored=[1, 2])
    relay.handle_frames(frames(1, [ev_removed([1]), ev_stored([5])]))
    assert await _next(it) == RelayBatch(seq=2, stored=[5], removed=[1])
    sub.close()
    assert relay.num_subscribers() == 0
    await relay.close()


async def test_slow_subscriber_is_resynced_with_a_snapshot() -> None:
    relay = KvEventRelay(queue_size=2)
    sub = relay.subscribe()  # holds the empty snapshot
    for i in range(5):
        relay.handle_frames(frames(i, [ev_stored([100 + i])]))
    assert relay.stats.resyncs >= 1
    got = [await _next(aiter(sub))]
    index = PrefixIndex()
    while not sub._queue.empty():
        got.append(await _next(aiter(sub)))
    for b in got:
        b.apply_to(index, W)
    assert index.worker_blocks(W) == {100, 101, 102, 103, 104}
    assert got[-1].seq == relay.seq
    await relay.close()


async def test_gaps_and_garbage_are_counted() -> None:
    relay = KvEventRelay()
    relay.handle_frames(frames(0, [ev_stored([1])]))
    relay.handle_frames(frames(5, [ev_stored([2])]))
    assert relay.handle_frames([b"kv", b"x"]) is None
    assert (relay.stats.batches, relay.stats.gaps, relay.stats.decode_errors) == (2, 1, 1)
    await relay.close()


async def test_verifies_hashes_against_the_first_root_event() -> None:
    hasher = BlockHasher(32)
    tokens = list(range(64))
    good = hasher.block_hashes(tokens)
    relay = KvEventRelay(hasher=hasher)
    relay.handle_frames(frames(0, [ev_stored(good[1:], tokens[32:], parent=good[0])]))
    assert relay.stats.hashes_verified is None  # a chained event cannot be checked
    relay.handle_frames(frames(1, [ev_stored(good, tokens)]))
    assert relay.stats.hashes_verified is True
    bad = KvEventRelay(hasher=BlockHasher(32, seed="other"))
    bad.handle_frames(frames(0, [ev_stored(good, tokens)]))
    assert bad.stats.hashes_verified is False


async def test_receives_from_a_connecting_zmq_publisher_and_closes_streams() -> None:
    relay = KvEventRelay()
    endpoint = relay.bind()
    assert endpoint.startswith("tcp://127.0.0.1:")
    await relay.start()
    sub = relay.subscribe()
    it = aiter(sub)
    assert (await _next(it)).snapshot
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.connect(endpoint)  # like vLLM given a concrete host
    try:
        seq = 0
        async with asyncio.timeout(5):
            while relay.stats.batches == 0:  # PUB/SUB connect asynchronously
                await pub.send_multipart(frames(seq, [ev_stored([seq + 1])]))
                seq += 1
                await asyncio.sleep(0.01)
        got = await _next(it)
        assert got.stored and not got.snapshot
    finally:
        pub.close(linger=0)
        ctx.term()
    await relay.close()
    with pytest.raises(StopAsyncIteration):
        while True:
            await _next(it)


def test_refuses_other_hosts() -> None:
    with pytest.raises(ValueError, match="127.0.0.1"):
        KvEventRelay(host="0.0.0.0")


async def test_load_snapshots_tick_at_the_interval() -> None:
    from dynagraph.llm.engines.base import EngineLoad
    from dynagraph.llm.kv.events.relay import load_snapshots

    calls = [0]

    def load() -> EngineLoad:
        calls[0] += 1
        return EngineLoad(running=calls[0])

    gen = load_snapshots(load, 0.01)
    loop = asyncio.get_running_loop()
    began = loop.time()
    got = [(await gen.__anext__()).running for _ in range(6)]
    await gen.aclose()
    assert got == [1, 2, 3, 4, 5, 6]
    assert loop.time() - began >= 0.045
    with pytest.raises(ValueError):
        await load_snapshots(load, 0).__anext__()


async def test_load_snapshots_changes_only_skip_equal_samples() -> None:
    from dynagraph.llm.engines.base import EngineLoad
    from dynagraph.llm.kv.events.relay import load_snapshots

    values = iter([1, 1, 1, 2, 2, 3] + [3] * 1000)
    calls = [0]

    def load() -> EngineLoad:
        calls[0] += 1
        return EngineLoad(running=next(values))

    gen = load_snapshots(load, 0.001, changes_only=True)
    got = [(await gen.__anext__()).running for _ in range(3)]
    assert got == [1, 2, 3] and calls[0] == 6
    await gen.aclose()


async def test_a_feed_is_fed_events_directly() -> None:
    feed = KvEventFeed()
    assert feed.publish([st(1, 2)]) == RelayBatch(seq=1, stored=[1, 2])
    assert feed.publish([st(2), rm(2)]) is None  # a second copy came and went: no net change
    sub = feed.subscribe()
    it = aiter(sub)
    assert await _next(it) == RelayBatch(seq=1, snapshot=True, stored=[1, 2])
    feed.publish([rm(1), AllCleared(), st(7)])
    assert await _next(it) == RelayBatch(seq=2, cleared=True, stored=[7])
    feed.end()
    with pytest.raises(StopAsyncIteration):
        await _next(it)


def test_pooled_blocks_are_their_own_tier() -> None:
    feed = KvEventFeed()
    sent = feed.publish([st(1, 2), st(1, 2, medium="CPU"), st(3, medium="CPU")])
    assert sent is not None
    assert (sent.stored, sent.pooled_stored) == ([1, 2], [1, 2, 3])
    sent = feed.publish([rm(1), BlocksRemoved(block_hashes=[3], medium="CPU")])
    assert sent is not None and (sent.removed, sent.pooled_removed) == ([1], [3])
    assert feed.publish([st(2, medium="CPU")]) is None  # a second pooled copy: no news
    snap = feed._snapshot()
    assert (snap.stored, snap.pooled_stored) == ([2], [1, 2])

    index, pooled = PrefixIndex(), PrefixIndex()
    snap.apply_to(index, W, pooled)
    assert (index.worker_blocks(W), pooled.worker_blocks(W)) == ({2}, {1, 2})
    RelayBatch(seq=9, pooled_removed=[1]).apply_to(index, W, pooled)
    assert (index.worker_blocks(W), pooled.worker_blocks(W)) == ({2}, {2})
    RelayBatch(seq=10, cleared=True).apply_to(index, W, pooled)
    assert index.worker_blocks(W) == pooled.worker_blocks(W) == set()


def test_blocks_written_to_the_shared_tier_are_a_third_tier() -> None:
    feed = KvEventFeed()
    sent = feed.publish([st(1, 2, medium="CPU"), st(1, 2, medium="STORAGE")])
    assert sent is not None
    assert (sent.stored, sent.pooled_stored, sent.tiered_stored) == ([], [1, 2], [1, 2])
    assert feed.publish([st(1, medium="STORAGE")]) is None
    snap = feed._snapshot()
    assert snap.tiered_stored == [1, 2]
    index, pooled, tiered = PrefixIndex(), PrefixIndex(), PrefixIndex()
    snap.apply_to(index, W, pooled, tiered)
    assert tiered.worker_blocks(W) == {1, 2} and index.worker_blocks(W) == set()
    RelayBatch(seq=9, tiered_removed=[1]).apply_to(index, W, pooled, tiered)
    assert tiered.worker_blocks(W) == {2}
    RelayBatch(seq=10, cleared=True).apply_to(index, W, pooled, tiered)
    assert tiered.worker_blocks(W) == set()


def test_blocks_trimmed_from_the_tier_are_sent_as_removed_and_stored_again_later() -> None:
    feed = KvEventFeed()
    feed.publish([st(1, 2, medium="STORAGE")])
    sub = feed.subscribe()
    # 3: written by another worker of the tier; the Router drops it for the whole tier
    sent = feed.forget_tiered([1, 3])
    assert sent is not None and sent.tiered_removed == [1, 3] and sent.seq == feed.seq
    assert sub._queue.qsize() == 2  # the snapshot, then the removal
    assert feed.tiered.hashes() == [2]
    assert feed.forget_tiered([]) is None
    # vLLM writes block 1 again (recomputed, stored through): the Router learns it anew
    again = feed.publish([st(1, medium="STORAGE")])
    assert again is not None and again.tiered_stored == [1]
