"""Fixtures for the prefill-queue integration tests."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Iterator

import pytest

from dynagraph.runtime.infra import LocalService, start_nats
from dynagraph.runtime.queue import NatsPrefillQueue


@pytest.fixture
def own_nats() -> Iterator[LocalService]:
    """A private nats-server this test may restart (the session one is shared)."""
    svc = start_nats()
    try:
        yield svc
    finally:
        svc.stop()


QueueFactory = Callable[..., NatsPrefillQueue]


@pytest.fixture
async def make_queue(nats_url: str) -> AsyncIterator[QueueFactory]:
    """Build connected-later queues on a fresh namespace; delete the stream and close all after."""
    namespace = f"t{uuid.uuid4().hex[:10]}"
    made: list[NatsPrefillQueue] = []

    def make(url: str | None = None, **kw: object) -> NatsPrefillQueue:
        q = NatsPrefillQueue(url or nats_url, namespace, **kw)  # type: ignore[arg-type]
        made.append(q)
        return q

    yield make
    admin = NatsPrefillQueue(made[0].url if made else nats_url, namespace, connect_timeout=2)
    try:
        await admin.connect()
        await admin.destroy()
    finally:
        await admin.close()
        for q in made:
            await q.close()
