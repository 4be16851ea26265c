"""MemoryDiscovery specifics; the shared contract is tests/contract/test_discovery.py."""

from __future__ import annotations

from typing import Any

import pytest

from dynagraph.errors import DiscoveryError
from dynagraph.runtime.discovery import (
    InstanceInfo,
    MemoryDiscovery,
    MemoryStore,
    instance_key,
)


async def _procs(n: int) -> tuple[MemoryStore, list[MemoryDiscovery]]:
    store = MemoryStore()
    discs = [MemoryDiscovery(store) for _ in range(n)]
    for d in discs:
        await d.start()
    return store, discs


async def test_instance_id_before_start_raises() -> None:
    with pytest.raises(DiscoveryError, match="start"):
        _ = MemoryDiscovery().instance_id


async def test_failing_subscriber_does_not_break_the_watch(caplog: pytest.LogCaptureFixture) -> None:
    _, (a, client) = await _procs(2)
    watch = await client.watch_instances("ns", "W", "gen")

    def boom(_: list[InstanceInfo]) -> None:
        raise RuntimeError("subscriber bug")

    watch.subscribe(boom)
    await a.register("ns", "W", "gen", "127.0.0.1:1")
    assert len(watch.instances()) == 1
    assert "subscriber failed" in caplog.text


async def test_values_are_copied_through_json() -> None:
    _, (a,) = await _procs(1)
    value: dict[str, Any] = {"xs": [1, 2]}
    await a.put("/k", value)
    value["xs"].append(3)
    assert await a.get("/k") == {"xs": [1, 2]}
    with pytest.raises(TypeError):
        await a.put("/k", object())


async def test_async_context_manager_revokes_on_exit() -> None:
    store = MemoryStore()
    observer = MemoryDiscovery(store)
    await observer.start()
    async with MemoryDiscovery(store) as d:
        await d.register("ns", "W", "gen", "127.0.0.1:1")
        assert len(await observer.get_prefix("/ns/")) == 1
    assert await observer.get_prefix("/ns/") == {}


def test_bad_names_are_rejected() -> None:
    with pytest.raises(ValueError, match="component"):
        instance_key("ns", "a/b", "gen", 1)


async def test_an_expired_lease_removes_the_instance() -> None:
    _, (a, client) = await _procs(2)
    await a.register("ns", "W", "gen", "127.0.0.1:1")
    watch = await client.watch_instances("ns", "W", "gen")
    assert len(watch.instances()) == 1
    a.expire()  # a crash: the lease is gone, and its keys with it
    assert watch.instances() == []
