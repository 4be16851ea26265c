"""Router replicas sharing in-flight requests: the feed and the peer bookkeeping."""

from __future__ import annotations

import msgspec

from dynagraph.llm.router import BlockHasher, RouterMode
from dynagraph.llm.router.pressure import PressureView
from dynagraph.llm.router.replicas import InflightFeed, InflightUpdate, PeerInflight, Tracked
from tests.support.router import state_with

A, B = 0xA1, 0xB2
P, Q = 0x51, 0x52  # peer Routers
hasher = BlockHasher(4)


def t(key: int, worker: int = A, hashes: list[int] | None = None, tokens: int = 100) -> Tracked:
    return Tracked(key, worker, hashes if hashes is not None else [key * 10, key * 10 + 1], tokens)


class Reader:
    def __init__(self, feed: InflightFeed) -> None:
        self.woken = 0
        self.sub = feed.subscribe(self.wake)

    def wake(self) -> None:
        self.woken += 1


# --- InflightFeed ---------------------------------------------------------------------


def test_a_subscriber_gets_a_snapshot_then_coalesced_begins_and_ends() -> None:
    feed = InflightFeed()
    feed.begin(t(0))
    feed.begin(t(1))
    r = Reader(feed)
    assert r.sub.take() == InflightUpdate(snapshot=True, begun=[t(0), t(1)])
    assert r.sub.take() is None
    feed.begin(t(2))
    feed.end(0)
    feed.begin(t(3))
    feed.end(3)  # began and ended between two reads: never sent
    assert r.woken == 4
    assert r.sub.take() == InflightUpdate(begun=[t(2)], ended=[0])
    feed.end(99)  # not tracked (ended twice, or never counted): nothing to say
    feed.end(1)
    assert r.sub.take() == InflightUpdate(ended=[1])
    assert feed.tracked == {2: t(2)}


def test_an_empty_feed_still_sends_its_snapshot_and_readers_are_independent() -> None:
    feed = InflightFeed()
    r1 = Reader(feed)
    assert r1.sub.take() == InflightUpdate(snapshot=True)
    feed.begin(t(0))
    r2 = Reader(feed)
    assert r1.sub.take() == InflightUpdate(begun=[t(0)])
    assert r2.sub.take() == InflightUpdate(snapshot=True, begun=[t(0)])
    feed.unsubscribe(r1.sub)
    feed.end(0)
    assert r1.sub.take() is None and r1.woken == 1
    assert r2.sub.take() == InflightUpdate(ended=[0])
    assert feed.subscribers == 1


def test_a_reader_that_falls_behind_is_resynced_with_a_snapshot() -> None:
    feed = InflightFeed(max_pending=4)
    r = Reader(feed)
    r.sub.take()
    for k in range(3):
        feed.begin(t(k))
    assert r.sub.take() == InflightUpdate(begun=[t(0), t(1), t(2)])
    for k in range(3, 8):  # 5 pending > 4: the backlog becomes a snapshot of what runs
        feed.begin(t(k))
    feed.end(0)
    feed.end(4)
    got = r.sub.take()
    assert got is not None and got.snapshot and got.ended == []
    assert [x.key for x in got.begun] == [1, 2, 3, 5, 6, 7]
    feed.end(1)
    assert r.sub.take() == InflightUpdate(ended=[1])


def test_updates_survive_the_wire() -> None:
    u = InflightUpdate(begun=[t(1, hashes=[2**64 - 1])], ended=[3])
    wire = msgspec.msgpack.encode(u)
    assert msgspec.msgpack.decode(wire, type=InflightUpdate) == u
    assert msgspec.to_builtins(InflightUpdate()) == {}


# --- PeerInflight ---------------------------------------------------------------------


def test_a_peers_requests_count_here_under_keys_of_their_own() -> None:
    s, view = state_with(A, B), PressureView()
    peers = PeerInflight(s, view)
    s.begin(A, [1, 2], key=0, uncached_tokens=50, now=1.0)  # this Router's own key 0
    peers.apply(P, InflightUpdate(snapshot=True, begun=[t(0, A, [1, 2, 3], 200)]), now=1.0)
    peers.apply(Q, InflightUpdate(snapshot=True, begun=[t(0, B, [7], 30)]), now=1.0)
    assert s.inflight[A] == {1: 2, 2: 2, 3: 1} and s.inflight[B] == {7: 1}
    assert s.queues[A].size == 2 and s.queues[A].queued_tokens == 250
    assert view.inflight == {A: 1, B: 1}
    assert (peers.count(P), peers.count(Q), peers.count()) == (1, 1, 2)
    peers.apply(P, InflightUpdate(ended=[0]), now=3.0)
    assert s.inflight[A] == {1: 1, 2: 1} and s.queues[A].size == 1  # own request stays
    assert view.inflight == {B: 1}
    peers.apply(P, InflightUpdate(ended=[0]), now=3.0)  # a repeat changes nothing
    assert s.inflight[A] == {1: 1, 2: 1}


def test_a_snapshot_replaces_what_was_known_and_a_departed_peer_is_forgotten() -> None:
    s = state_with(A, B)
    peers = PeerInflight(s, PressureView())
    peers.apply(P, InflightUpdate(snapshot=True, begun=[t(0), t(1), t(2, B)]), now=1.0)
    peers.apply(P, InflightUpdate(snapshot=True, begun=[t(1), t(3, B)]), now=2.0)  # resync
    assert peers.count(P) == 2
    assert s.inflight[A] == {10: 1, 11: 1} and s.inflight[B] == {30: 1, 31: 1}
    assert s.queues[A].size == 1 and s.queues[B].size == 1
    learned = s.rates(A).request_s
    assert peers.drop(P) == 2 and peers.drop(P) == 0
    assert s.inflight == {A: {}, B: {}} and s.queues[A].idle and s.queues[B].idle
    assert s.rates(A).request_s == learned  # dropped unseen: teaches nothing
    assert peers.peers() == set()


def test_a_peers_request_predicts_its_prefix_so_repeats_follow_it() -> None:
    """What one replica routed steers the other at once, before any KV event: the
    second Router sends the same prefix to the same worker, and unrelated work away
    from the busy one."""
    shared = [7000 + i for i in range(256)]
    r1, r2 = state_with(A, B), state_with(A, B)
    feed = InflightFeed()
    peers = PeerInflight(r2)
    sub = feed.subscribe(lambda: None)
    h1 = hasher.block_hashes(shared + [1])
    d1 = r1.decide(RouterMode.KV, h1, prompt_tokens=257, block_size=4, now=1.0)
    r1.begin(d1.worker_id, h1, key=0, uncached_tokens=257, now=1.0)
    feed.begin(Tracked(0, d1.worker_id, h1, 257))
    update = sub.take()
    assert update is not None
    peers.apply(P, update, now=1.0)
    # most of its prefill done (prior speed 1e-4 s a token): waiting for the rest and
    # computing one token beats computing 257 elsewhere
    h2 = hasher.block_hashes(shared + [2])
    d2 = r2.decide(RouterMode.KV, h2, prompt_tokens=257, block_size=4, now=1.02)
    assert (d2.worker_id, d2.overlap_blocks) == (d1.worker_id, 64)
    other = r2.decide(RouterMode.KV, hasher.block_hashes([5] * 256), prompt_tokens=256,
                      block_size=4, now=1.02)
    assert other.worker_id != d1.worker_id
    # without the peer's news the second Router would not know of the prefix at all
    alone = state_with(A, B).decide(RouterMode.KV, h2, prompt_tokens=257, block_size=4,
                                    now=1.02)
    assert alone.overlap_blocks == 0
