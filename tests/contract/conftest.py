"""Backends under contract: every test here runs against the in-memory twin and the real
service (etcd, NATS), so the fakes the unit tests use cannot drift from production."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from dynagraph.errors import DynagraphError
from dynagraph.runtime.discovery import EtcdDiscovery, MemoryDiscovery, MemoryStore
from dynagraph.runtime.discovery._base import DiscoveryBase
from dynagraph.runtime.queue import MemoryPrefillQueue, NatsPrefillQueue, PrefillQueue

REAL = pytest.mark.integration

DiscoveryFactory = Callable[[], Awaitable[DiscoveryBase]]


@pytest.fixture
def ns() -> str:
    """A namespace of this test alone (the real services are shared by the session)."""
    return f"c{uuid.uuid4().hex[:10]}"


@pytest.fixture(params=["memory", pytest.param("etcd", marks=REAL)])
async def discoveries(request: pytest.FixtureRequest) -> AsyncIterator[DiscoveryFactory]:
    """Makes started discovery clients ("processes") of one backend; closes them after."""
    made: list[DiscoveryBase] = []
    if request.param == "memory":
        store = MemoryStore()

        def new() -> DiscoveryBase:
            return MemoryDiscovery(store)
    else:
        url = request.getfixturevalue("etcd_url")

        def new() -> DiscoveryBase:
            return EtcdDiscovery(url)

    async def make() -> DiscoveryBase:
        d = new()
        await d.start()
        made.append(d)
        return d

    yield make
    for d in made:
        with contextlib.suppress(DynagraphError):
            await d.close()


QueueFactory = Callable[..., Awaitable[PrefillQueue]]


@pytest.fixture(params=["memory", pytest.param("nats", marks=REAL)])
async def queues(request: pytest.FixtureRequest, ns: str) -> AsyncIterator[QueueFactory]:
    """``await queues(**settings)``: a connected client of one prefill queue (per test).

    Memory: every call returns the one shared queue (there is no server); NATS: a new
    connection per call ("another process"), all on the test's own namespace.
    """
    made: list[PrefillQueue] = []
    shared: list[MemoryPrefillQueue] = []
    url = request.getfixturevalue("nats_url") if request.param == "nats" else ""

    async def make(**settings: Any) -> PrefillQueue:
        if request.param == "memory":
            if not shared:
                shared.append(MemoryPrefillQueue(**settings))
                await shared[0].connect()
            return shared[0]
        q = NatsPrefillQueue(url, ns, **settings)
        await q.connect()
        made.append(q)
        return q

    yield make
    if made:
        await made[0].destroy()  # type: ignore[attr-defined]
    for q in [*made, *shared]:
        await q.close()
