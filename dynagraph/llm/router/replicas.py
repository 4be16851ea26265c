"""Router replicas share what they have in flight. Pure, no I/O.

Each Router counts the requests it routed as in flight on their worker, from its decision
until the caller closes the route stream (``RouterState.begin``/``end``): their blocks
are a *predicted* prefix and their uncached prompt tokens a forecast prefill queue, well
ahead of the worker's own KV events and load reports (tens of milliseconds behind, while
requests arrive every few). Replicas that kept this to themselves would each see half
the load and half the predicted prefixes: a prefix one of them just sent to worker A,
not yet cached there, would be sent to B by the other (a second prefill of the same
prefix), and both would pile on whichever worker looks idle to each.

So the replicas tell each other, over a replica-to-replica stream (each Router's
``inflight`` endpoint, followed by every other Router). Not through the workers' load
reports: those already reach every Router, but lag by a sampling interval plus an engine
step, say nothing of a request's blocks (no predicted prefix), and a count of requests
cannot be told apart from the replica's own; a Router knows exactly what it routed the
moment it routes it, so that is where the news starts.

- ``InflightFeed`` (the publishing side, one per Router): this Router's tracked requests
  (``Tracked``: its key, worker, block hashes, uncached tokens). Each subscriber gets a
  snapshot, then every begin and end since its last read, coalesced into one
  ``InflightUpdate`` per read: no timer, so a begin goes out on the next turn of the
  event loop (the bounded delay is one request-plane hop), and a burst costs one message
  per reader turn, not one per request; a request that began and ended between two reads
  is never sent. A subscriber whose backlog passes ``max_pending`` entries is resynced in
  place: its backlog is replaced by a fresh snapshot (bounded by what is in flight), so a
  slow peer costs bounded memory and misses nothing.
- ``PeerInflight`` (the following side): applies each peer's updates to this Router's
  ``RouterState`` (and ``PressureView``) under keys of its own (negative: never one of the
  Router's own, which count up from 0), so a peer's request is forecast, predicts its
  prefix and counts as load exactly as one routed here. A snapshot replaces what was
  known of that peer. When a peer leaves (its instance is gone or its stream broke) its
  entries are dropped: what it had in flight is known again only from the workers' own
  reports, until a fresh subscription brings its snapshot.

Times (``now``) are passed in; a remote request's time on its worker is measured from the
arrival of its begin to the arrival of its end (both one hop late), so it teaches the
worker's ``request_s`` as a local one does. Entries dropped unseen (a snapshot that no
longer lists them, a peer that left) teach nothing.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import msgspec

from dynagraph.llm.router.pressure import PressureView
from dynagraph.llm.router.state import RouterState

DEFAULT_MAX_PENDING = 4096
"""Begins and ends a subscriber may have waiting before it is resynced by a snapshot."""


class Tracked(msgspec.Struct, frozen=True):
    """One request a Router routed and counts as in flight."""

    key: int
    """The routing Router's own key for it (unique within that Router)."""
    worker: int
    hashes: list[int]
    """Its prompt's block hashes (the predicted prefix on ``worker``)."""
    uncached_tokens: int
    """Prompt tokens ``worker`` must compute for it (its forecast prefill)."""


class InflightUpdate(msgspec.Struct, omit_defaults=True):
    """Router -> Router (``inflight``): what changed since the last update.

    ``snapshot``: ``begun`` is everything the sender has in flight now, replacing what the
    receiver knew of it (the first update of a stream, and after a resync).
    """

    snapshot: bool = False
    begun: list[Tracked] = []
    ended: list[int] = []
    """Keys of requests that ended (each sent earlier in ``begun``)."""


class FeedSubscription:
    """One reader of an ``InflightFeed``: ``take()`` what piled up since the last take.

    ``on_ready`` is called (synchronously) whenever something is added; the reader then
    calls ``take()``, which may return None (what was added cancelled out)."""

    __slots__ = ("_begun", "_ended", "_feed", "_snapshot", "on_ready")

    def __init__(self, feed: InflightFeed, on_ready: Callable[[], None]) -> None:
        self._feed = feed
        self.on_ready = on_ready
        self._snapshot = True
        self._begun: dict[int, Tracked] = dict(feed.tracked)
        self._ended: list[int] = []

    @property
    def pending(self) -> int:
        return len(self._begun) + len(self._ended)

    def take(self) -> InflightUpdate | None:
        if not self._snapshot and not self._begun and not self._ended:
            return None
        update = InflightUpdate(snapshot=self._snapshot, begun=list(self._begun.values()),
                                ended=self._ended)
        self._snapshot, self._begun, self._ended = False, {}, []
        return update

    def _begin(self, t: Tracked) -> None:
        self._begun[t.key] = t
        self._check()
        self.on_ready()

    def _end(self, key: int) -> None:
        if self._begun.pop(key, None) is None and not self._snapshot:
            self._ended.append(key)  # sent already: the reader must hear of its end
            self._check()
        self.on_ready()

    def _check(self) -> None:
        if not self._snapshot and self.pending > self._feed.max_pending:
            self._snapshot, self._begun, self._ended = True, dict(self._feed.tracked), []


class InflightFeed:
    """This Router's tracked requests, streamed to its peers (see the module doc).

    The component calls ``begin`` when it counts a request and ``end`` when it stops
    (exactly once each, keys unique); each ``inflight`` stream holds one subscription.
    """

    def __init__(self, max_pending: int = DEFAULT_MAX_PENDING) -> None:
        self.max_pending = max_pending
        self.tracked: dict[int, Tracked] = {}
        self._subs: list[FeedSubscription] = []

    def begin(self, t: Tracked) -> None:
        self.tracked[t.key] = t
        for sub in self._subs:
            sub._begin(t)

    def end(self, key: int) -> None:
        if self.tracked.pop(key, None) is None:
            return
        for sub in self._subs:
            sub._end(key)

    def subscribe(self, on_ready: Callable[[], None]) -> FeedSubscription:
        """A new reader; its first ``take()`` is a snapshot (possibly empty)."""
        sub = FeedSubscription(self, on_ready)
        self._subs.append(sub)
        return sub

    def unsubscribe(self, sub: FeedSubscription) -> None:
        if sub in self._subs:
            self._subs.remove(sub)

    @property
    def subscribers(self) -> int:
        return len(self._subs)


class PeerInflight:
    """Other Routers' in-flight requests, applied to this Router's state."""

    def __init__(self, state: RouterState, pressure: PressureView | None = None) -> None:
        self.state = state
        self.pressure = pressure
        self._peers: dict[int, dict[int, tuple[int, Tracked]]] = {}
        """peer -> its key -> (the key here, the request)."""
        self._keys = itertools.count(-1, -1)

    def peers(self) -> set[int]:
        """Peers whose state is known (a snapshot applied, not dropped since)."""
        return set(self._peers)

    def count(self, peer: int | None = None) -> int:
        """Requests known in flight from ``peer`` (None: from every peer)."""
        if peer is not None:
            return len(self._peers.get(peer, ()))
        return sum(len(v) for v in self._peers.values())

    def apply(self, peer: int, update: InflightUpdate, now: float) -> None:
        """An update from ``peer``'s stream, received at ``now``."""
        known = self._peers.setdefault(peer, {})
        if update.snapshot:
            listed = {t.key for t in update.begun}
            for key in [k for k in known if k not in listed]:
                self._end(known.pop(key), None)
        for t in update.begun:
            if t.key not in known:
                local = next(self._keys)
                known[t.key] = (local, t)
                self.state.begin(t.worker, t.hashes, key=local,
                                 uncached_tokens=t.uncached_tokens, now=now)
                if self.pressure is not None:
                    self.pressure.begin(t.worker)
        for key in update.ended:
            entry = known.pop(key, None)
            if entry is not None:
                self._end(entry, now)

    def drop(self, peer: int) -> int:
        """``peer`` left or its stream broke: forget its requests. Returns how many."""
        known = self._peers.pop(peer, {})
        for entry in known.values():
            self._end(entry, None)
        return len(known)

    def _end(self, entry: tuple[int, Tracked], now: float | None) -> None:
        local, t = entry
        self.state.end(t.worker, t.hashes, local, now=now)
        if self.pressure is not None:
            self.pressure.end(t.worker)
