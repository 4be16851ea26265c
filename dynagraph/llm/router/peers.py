"""A Router replica's link to the others, and its wait for a full index at start.

:class:`ReplicaLink` is the I/O around :mod:`dynagraph.llm.router.replicas`: it serves
this replica's tracked requests (``InflightFeed``) to the others through the Router's
``inflight`` endpoint, and follows every other replica's stream (found in discovery, this
one left out), applying their requests to this replica's state (``PeerInflight``); a peer
that leaves, or whose stream breaks, stops counting until its next snapshot.

:class:`StartupSync` says when a starting Router may take requests: once every live
worker's KV snapshot and every peer's first in-flight update have been applied (a worker
or peer that cannot be reached is not waited for).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from typing import Any

from dynagraph.errors import DynagraphError
from dynagraph.llm.protocol import Subscribe
from dynagraph.llm.router.pressure import PressureView
from dynagraph.llm.router.replicas import InflightFeed, InflightUpdate, PeerInflight, Tracked
from dynagraph.llm.router.state import RouterState
from dynagraph.sdk import RuntimeContext

log = logging.getLogger(__name__)


class StartupSync:
    """Which snapshots a starting Router still waits for; ``wait`` returns when none."""

    def __init__(self) -> None:
        self.workers: set[int] = set()
        self.peers: set[int] = set()
        self.workers_done: set[int] = set()
        self.peers_done: set[int] = set()
        self._event = asyncio.Event()
        self._armed = False  # set once start() has seen every worker and peer

    def expect_worker(self, w: int) -> None:
        self.workers.add(w)

    def forget_worker(self, w: int) -> None:
        self.workers.discard(w)
        self.workers_done.discard(w)
        self._check()

    def worker_done(self, w: int) -> None:
        if w not in self.workers_done:
            self.workers_done.add(w)
            self._check()

    def expect_peer(self, p: int) -> None:
        self.peers.add(p)

    def forget_peer(self, p: int) -> None:
        self.peers.discard(p)
        self.peers_done.discard(p)
        self._check()

    def peer_done(self, p: int) -> None:
        if p not in self.peers_done:
            self.peers_done.add(p)
            self._check()

    async def wait(self, within: float) -> float | None:
        """Seconds until every expected snapshot was applied (None: not ``within`` s)."""
        t0 = time.monotonic()
        self._armed = True
        self._check()
        try:
            async with asyncio.timeout(within):
                await self._event.wait()
        except TimeoutError:
            return None
        return time.monotonic() - t0

    def _check(self) -> None:
        if (self._armed and not self._event.is_set() and self.workers <= self.workers_done
                and self.peers <= self.peers_done):
            self._event.set()


class ReplicaLink:
    """Shares this Router's tracked requests with the other replicas, and counts theirs."""

    def __init__(self, state: RouterState, pressure: PressureView, sync: StartupSync, *,
                 reconnect_delay: float) -> None:
        self.feed = InflightFeed()
        self.peers = PeerInflight(state, pressure)
        self.sync = sync
        self.reconnect_delay = reconnect_delay
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._watch: Any = None
        self._client: Any = None
        self._me = 0

    def begin(self, request: Tracked) -> None:
        self.feed.begin(request)

    def end(self, key: int) -> None:
        self.feed.end(key)

    async def serve(self) -> AsyncGenerator[InflightUpdate, None]:
        """This replica's in flight: a snapshot, then begins and ends as they happen
        (coalesced per read), until closed (the ``inflight`` endpoint's stream)."""
        ready = asyncio.Event()
        sub = self.feed.subscribe(ready.set)
        try:
            while True:
                update = sub.take()
                if update is None:
                    ready.clear()
                    await ready.wait()
                    continue
                yield update
        finally:
            self.feed.unsubscribe(sub)

    async def start(self, runtime: RuntimeContext) -> None:
        """Follow the other replicas of ``runtime``'s component, found in discovery."""
        self._me = runtime.instance_id
        self._client = await runtime.client(runtime.component, "inflight",
                                            response_type=InflightUpdate)
        self._watch = await runtime.discovery.watch_instances(
            runtime.namespace, runtime.component, "inflight")
        self._watch.subscribe(self._on_instances)
        self._on_instances(self._watch.instances())

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._watch is not None:
            await self._watch.close()

    def _on_instances(self, instances: list[Any]) -> None:
        live = {i.instance_id for i in instances} - {self._me}
        for p in list(self._tasks):
            if p not in live:
                self._tasks.pop(p).cancel()
                dropped = self.peers.drop(p)
                self.sync.forget_peer(p)
                log.info("Router replica %x gone: %d of its requests no longer counted",
                         p, dropped)
        for p in live - self._tasks.keys():
            self.sync.expect_peer(p)
            self._tasks[p] = asyncio.create_task(self._follow(p), name=f"peer-{p:x}")
            log.info("following Router replica %x", p)

    async def _follow(self, p: int) -> None:
        """Keep replica ``p``'s ``inflight`` stream open until ``p`` leaves (this task is
        cancelled); a broken stream drops what ``p`` had in flight until its next
        snapshot."""
        while True:
            try:
                stream = self._client.direct(Subscribe(), p)
                async with contextlib.aclosing(stream):
                    async for update in stream:
                        self.peers.apply(p, update, time.monotonic())
                        self.sync.peer_done(p)
            except (DynagraphError, ValueError) as exc:
                log.debug("Router replica %x inflight stream: %s", p, exc)
            self.peers.drop(p)
            self.sync.peer_done(p)  # unreachable (a replica that just died): no wait
            await asyncio.sleep(self.reconnect_delay)
