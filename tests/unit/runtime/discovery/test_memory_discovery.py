"""MemoryDiscovery: the contract every backend keeps, checked without any service."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from dynagraph.errors import DiscoveryError, NoInstancesError
from dynagraph.runtime.discovery import (
    Discovery,
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


async def test_is_a_discovery_and_ids_are_unique_and_stable() -> None:
    _, (a, b) = await _procs(2)
    assert isinstance(a, Discovery)
    assert a.instance_id != b.instance_id
    first = a.instance_id
    await a.start()  # idempotent
    assert a.instance_id == first


async def test_instance_id_before_start_raises() -> None:
    with pytest.raises(DiscoveryError, match="start"):
        _ = MemoryDiscovery().instance_id


async def test_register_writes_the_documented_key_and_value() -> None:
    store, (a,) = await _procs(1)
    info = await a.register("ns", "Worker", "generate", "127.0.0.1:5000", {"pid": 7})
    assert info == InstanceInfo("ns", "Worker", "generate", a.instance_id, "127.0.0.1:5000", {"pid": 7})
    key = f"/ns/components/Worker/generate/{a.instance_id:x}"
    assert key == instance_key("ns", "Worker", "generate", a.instance_id)
    assert await a.get(key) == {"address": "127.0.0.1:5000", "instance_id": a.instance_id,
                                "metadata": {"pid": 7}}


async def test_watch_sees_register_and_close_of_other_processes() -> None:
    _, (a, b, client) = await _procs(3)
    await a.register("ns", "W", "gen", "127.0.0.1:1")
    watch = await client.watch_instances("ns", "W", "gen")
    assert [i.address for i in watch.instances()] == ["127.0.0.1:1"]  # filled before return
    await b.register("ns", "W", "gen", "127.0.0.1:2")
    assert [i.instance_id for i in watch.instances()] == sorted([a.instance_id, b.instance_id])
    await a.close()
    assert [i.address for i in watch.instances()] == ["127.0.0.1:2"]
    b.expire()  # a crash: lease gone
    assert watch.instances() == []
    await watch.close()


async def test_watch_ignores_other_endpoints_and_malformed_records() -> None:
    _, (a, client) = await _procs(2)
    watch = await client.watch_instances("ns", "W", "gen")
    await a.register("ns", "W", "other", "127.0.0.1:1")
    await a.register("ns2", "W", "gen", "127.0.0.1:1")
    await a.put("/ns/components/W/gen/bad", {"no": "address"})
    assert watch.instances() == []


async def test_wait_for_returns_when_enough_instances_arrive() -> None:
    _, (a, b, client) = await _procs(3)
    watch = await client.watch_instances("ns", "W", "gen")
    waiter = asyncio.create_task(watch.wait_for(2, timeout=5))
    await a.register("ns", "W", "gen", "127.0.0.1:1")
    await asyncio.sleep(0)
    assert not waiter.done()
    await b.register("ns", "W", "gen", "127.0.0.1:2")
    got = await asyncio.wait_for(waiter, 1)
    assert len(got) == 2


async def test_wait_for_names_what_is_missing() -> None:
    _, (a, client) = await _procs(2)
    watch = await client.watch_instances("ns", "W", "gen")
    with pytest.raises(NoInstancesError, match="ns/W/gen"):
        await watch.wait_for(1, timeout=0.01)
    await a.register("ns", "W", "gen", "127.0.0.1:1")
    with pytest.raises(TimeoutError, match="only 1 of 2 instances of ns/W/gen"):
        await watch.wait_for(2, timeout=0.01)


async def test_subscribe_called_on_every_change_only() -> None:
    _, (a, b, client) = await _procs(3)
    watch = await client.watch_instances("ns", "W", "gen")
    seen: list[list[str]] = []
    watch.subscribe(lambda insts: seen.append([i.address for i in insts]))
    await a.register("ns", "W", "gen", "127.0.0.1:1")
    await a.register("ns", "W", "gen", "127.0.0.1:1")  # same record: no change
    await b.register("ns", "W", "gen", "127.0.0.1:2")
    await a.close()
    assert seen == [["127.0.0.1:1"], sorted(["127.0.0.1:1", "127.0.0.1:2"]), ["127.0.0.1:2"]]


async def test_failing_subscriber_does_not_break_the_watch(caplog: pytest.LogCaptureFixture) -> None:
    _, (a, client) = await _procs(2)
    watch = await client.watch_instances("ns", "W", "gen")

    def boom(_: list[InstanceInfo]) -> None:
        raise RuntimeError("subscriber bug")

    watch.subscribe(boom)
    await a.register("ns", "W", "gen", "127.0.0.1:1")
    assert len(watch.instances()) == 1
    assert "subscriber failed" in caplog.text


async def test_closed_watch_stops_following() -> None:
    _, (a, client) = await _procs(2)
    watch = await client.watch_instances("ns", "W", "gen")
    await watch.close()
    await watch.close()
    await a.register("ns", "W", "gen", "127.0.0.1:1")
    assert watch.instances() == []
    with pytest.raises(NoInstancesError, match="watch closed"):
        await watch.wait_for(1, timeout=1)


async def test_put_get_prefix_delete() -> None:
    _, (a, b) = await _procs(2)
    await a.put("/ns/settings/router", {"mode": "kv"})
    await a.put("/ns/settings/disagg", {"max_local_prefill_length": 512})
    await a.put("/other/x", 1)
    assert await b.get("/ns/settings/router") == {"mode": "kv"}
    assert await b.get("/missing") is None
    assert await b.get_prefix("/ns/settings/") == {
        "/ns/settings/disagg": {"max_local_prefill_length": 512},
        "/ns/settings/router": {"mode": "kv"},
    }
    await b.delete("/ns/settings/router")
    await b.delete("/ns/settings/router")  # absent: no error
    assert await a.get("/ns/settings/router") is None


async def test_lease_bound_put_vanishes_on_close_plain_put_stays() -> None:
    _, (a, b) = await _procs(2)
    await a.put("/k/leased", "x", lease=True)
    await a.put("/k/plain", "y")
    await a.close()
    assert await b.get_prefix("/k/") == {"/k/plain": "y"}


async def test_values_are_copied_through_json() -> None:
    _, (a,) = await _procs(1)
    value: dict[str, Any] = {"xs": [1, 2]}
    await a.put("/k", value)
    value["xs"].append(3)
    assert await a.get("/k") == {"xs": [1, 2]}
    with pytest.raises(TypeError):
        await a.put("/k", object())


async def test_watch_prefix_yields_current_then_changes() -> None:
    _, (a, b) = await _procs(2)
    await a.put("/s/router", "kv")
    it = b.watch_prefix("/s/")
    async with contextlib.aclosing(it):
        assert await anext(it) == ("/s/router", "kv")
        await a.put("/s/router", "round-robin")
        await a.put("/s/other", 3)
        await a.delete("/s/router")
        await a.put("/elsewhere", 1)
        got = [await asyncio.wait_for(anext(it), 1) for _ in range(3)]
    assert got == [("/s/router", "round-robin"), ("/s/other", 3), ("/s/router", None)]


async def test_watch_prefix_ends_when_discovery_closes() -> None:
    _, (a,) = await _procs(1)
    it = a.watch_prefix("/s/")
    task = asyncio.create_task(anext(it, "end"))
    await asyncio.sleep(0)
    await a.close()
    assert await asyncio.wait_for(task, 1) == "end"


async def test_calls_after_close_raise() -> None:
    _, (a,) = await _procs(1)
    await a.close()
    with pytest.raises(DiscoveryError, match="not started"):
        await a.put("/k", 1)


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
