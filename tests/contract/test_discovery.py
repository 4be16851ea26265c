"""The discovery contract (``dynagraph.runtime.discovery``), on MemoryDiscovery and etcd.

A watch may lag the store (etcd delivers changes asynchronously), so every check of a
watch polls; nothing else is assumed about timing.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from dynagraph.errors import DiscoveryError, NoInstancesError
from dynagraph.runtime.discovery import Discovery, InstanceInfo, instance_key
from tests.support.poll import until

from .conftest import DiscoveryFactory


async def test_ids_are_unique_and_start_is_idempotent(discoveries: DiscoveryFactory) -> None:
    a, b = await discoveries(), await discoveries()
    assert isinstance(a, Discovery) and a.instance_id != b.instance_id
    first = a.instance_id
    await a.start()
    assert a.instance_id == first


async def test_register_writes_the_documented_key_and_value(discoveries: DiscoveryFactory,
                                                            ns: str) -> None:
    a = await discoveries()
    info = await a.register(ns, "Worker", "generate", "127.0.0.1:5000", {"pid": 7})
    assert info == InstanceInfo(ns, "Worker", "generate", a.instance_id, "127.0.0.1:5000",
                                {"pid": 7})
    key = f"/{ns}/components/Worker/generate/{a.instance_id:x}"
    assert key == instance_key(ns, "Worker", "generate", a.instance_id)
    assert await a.get(key) == {"address": "127.0.0.1:5000", "instance_id": a.instance_id,
                                "metadata": {"pid": 7}}


async def test_watch_sees_register_and_close_of_others(discoveries: DiscoveryFactory,
                                                       ns: str) -> None:
    a, b, client = await discoveries(), await discoveries(), await discoveries()
    await a.register(ns, "W", "gen", "127.0.0.1:1")
    watch = await client.watch_instances(ns, "W", "gen")
    assert [i.address for i in watch.instances()] == ["127.0.0.1:1"]  # filled before return
    await b.register(ns, "W", "gen", "127.0.0.1:2")
    both = sorted([a.instance_id, b.instance_id])
    await until(lambda: [i.instance_id for i in watch.instances()] == both, 5, "b to appear")
    await a.close()
    await until(lambda: [i.address for i in watch.instances()] == ["127.0.0.1:2"], 5,
                "a to vanish on close")
    await watch.close()


async def test_watch_ignores_other_endpoints_and_malformed_records(
        discoveries: DiscoveryFactory, ns: str) -> None:
    a, client = await discoveries(), await discoveries()
    watch = await client.watch_instances(ns, "W", "gen")
    seen: list[int] = []
    watch.subscribe(lambda insts: seen.append(len(insts)))
    await a.register(ns, "W", "other", "127.0.0.1:1")
    await a.register(f"{ns}x", "W", "gen", "127.0.0.1:1")
    await a.put(f"/{ns}/components/W/gen/bad", {"no": "address"})
    await a.register(ns, "W", "gen", "127.0.0.1:9")  # a marker: changes before it arrived
    await until(lambda: len(watch.instances()) == 1, 5, "the marker")
    assert [i.address for i in watch.instances()] == ["127.0.0.1:9"] and seen == [1]


async def test_wait_for_and_what_it_names(discoveries: DiscoveryFactory, ns: str) -> None:
    a, b, client = await discoveries(), await discoveries(), await discoveries()
    watch = await client.watch_instances(ns, "W", "gen")
    with pytest.raises(NoInstancesError, match=f"{ns}/W/gen"):
        await watch.wait_for(1, timeout=0.05)
    waiter = asyncio.create_task(watch.wait_for(2, timeout=5))
    await a.register(ns, "W", "gen", "127.0.0.1:1")
    with pytest.raises(TimeoutError, match=f"only 1 of 3 instances of {ns}/W/gen"):
        await until(lambda: len(watch.instances()) == 1, 5)
        await watch.wait_for(3, timeout=0.05)
    assert not waiter.done()
    await b.register(ns, "W", "gen", "127.0.0.1:2")
    assert len(await asyncio.wait_for(waiter, 5)) == 2


async def test_subscribers_see_every_change_once(discoveries: DiscoveryFactory, ns: str) -> None:
    a, b, client = await discoveries(), await discoveries(), await discoveries()
    watch = await client.watch_instances(ns, "W", "gen")
    seen: list[list[str]] = []
    watch.subscribe(lambda insts: seen.append(sorted(i.address for i in insts)))
    await a.register(ns, "W", "gen", "127.0.0.1:1")
    await until(lambda: len(seen) == 1, 5)
    await a.register(ns, "W", "gen", "127.0.0.1:1")  # same record: no change
    await b.register(ns, "W", "gen", "127.0.0.1:2")
    await until(lambda: len(seen) == 2, 5)
    await a.close()
    await until(lambda: len(seen) == 3, 5)
    assert seen == [["127.0.0.1:1"], ["127.0.0.1:1", "127.0.0.1:2"], ["127.0.0.1:2"]]


async def test_closed_watch_stops_following(discoveries: DiscoveryFactory, ns: str) -> None:
    a, client = await discoveries(), await discoveries()
    watch = await client.watch_instances(ns, "W", "gen")
    await watch.close()
    await watch.close()
    await a.register(ns, "W", "gen", "127.0.0.1:1")
    assert watch.instances() == []
    with pytest.raises(NoInstancesError, match="watch closed"):
        await watch.wait_for(1, timeout=1)


async def test_put_get_prefix_delete(discoveries: DiscoveryFactory, ns: str) -> None:
    a, b = await discoveries(), await discoveries()
    await a.put(f"/{ns}/settings/router", {"mode": "kv"})
    await a.put(f"/{ns}/settings/disagg", {"max_local_prefill_length": 512})
    await a.put(f"/{ns}x/elsewhere", 1)
    assert await b.get(f"/{ns}/settings/router") == {"mode": "kv"}
    assert await b.get(f"/{ns}/missing") is None
    assert await b.get_prefix(f"/{ns}/settings/") == {
        f"/{ns}/settings/disagg": {"max_local_prefill_length": 512},
        f"/{ns}/settings/router": {"mode": "kv"},
    }
    await b.delete(f"/{ns}/settings/router")
    await b.delete(f"/{ns}/settings/router")  # absent: no error
    assert await a.get(f"/{ns}/settings/router") is None
    await a.delete(f"/{ns}x/elsewhere")
    await a.delete(f"/{ns}/settings/disagg")


async def test_put_if_absent_keeps_the_first_value(discoveries: DiscoveryFactory,
                                                    ns: str) -> None:
    a, b = await discoveries(), await discoveries()
    key = f"/{ns}/graph-secret"
    got = await asyncio.gather(a.put_if_absent(key, "from-a"), b.put_if_absent(key, "from-b"))
    assert got[0] == got[1] and got[0] in ("from-a", "from-b")
    assert await a.put_if_absent(key, "later") == got[0]
    assert await b.get(key) == got[0]
    await a.delete(key)


async def test_lease_bound_put_vanishes_on_close_plain_put_stays(
        discoveries: DiscoveryFactory, ns: str) -> None:
    a, b = await discoveries(), await discoveries()
    await a.put(f"/{ns}/leased", "x", lease=True)
    await a.put(f"/{ns}/plain", "y")
    await a.close()
    assert await b.get_prefix(f"/{ns}/") == {f"/{ns}/plain": "y"}
    await b.delete(f"/{ns}/plain")


async def test_watch_prefix_yields_current_then_changes(discoveries: DiscoveryFactory,
                                                        ns: str) -> None:
    a, b = await discoveries(), await discoveries()
    await a.put(f"/{ns}/s/router", "kv")
    it = b.watch_prefix(f"/{ns}/s/")
    async with contextlib.aclosing(it):
        assert await asyncio.wait_for(anext(it), 5) == (f"/{ns}/s/router", "kv")
        await a.put(f"/{ns}/s/router", "round-robin")
        await a.put(f"/{ns}/s/other", 3)
        await a.delete(f"/{ns}/s/router")
        await a.put(f"/{ns}/elsewhere", 1)
        got = [await asyncio.wait_for(anext(it), 5) for _ in range(3)]
    assert got == [(f"/{ns}/s/router", "round-robin"), (f"/{ns}/s/other", 3),
                   (f"/{ns}/s/router", None)]
    for key in (f"/{ns}/s/other", f"/{ns}/elsewhere"):
        await a.delete(key)


async def test_watch_prefix_ends_when_discovery_closes(discoveries: DiscoveryFactory,
                                                       ns: str) -> None:
    a = await discoveries()
    it = a.watch_prefix(f"/{ns}/s/")
    task = asyncio.create_task(anext(it, "end"))
    await asyncio.sleep(0.05)
    await a.close()
    assert await asyncio.wait_for(task, 5) == "end"


async def test_calls_after_close_raise(discoveries: DiscoveryFactory, ns: str) -> None:
    a = await discoveries()
    await a.close()
    with pytest.raises(DiscoveryError):
        await a.put(f"/{ns}/k", 1)
