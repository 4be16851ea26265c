from __future__ import annotations

import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest

from dynagraph.errors import InstanceUnavailable, InvalidResponse, NoInstancesError
from dynagraph.sdk import ComponentClient, EndpointClient, at_random, direct, instance_ids
from dynagraph.sdk._context import reset_request_id, set_request_id
from tests.support.poll import collect


@dataclass
class Inst:
    instance_id: int
    address: str


class Source:
    def __init__(self, *ids: int) -> None:
        self.live = [Inst(i, f"addr{i}") for i in ids]

    def instances(self) -> list[Inst]:
        return self.live


class FakeCaller:
    """Answers with [address, payload]; addresses in ``dead`` refuse before sending."""

    def __init__(self, dead: set[str] | None = None) -> None:
        self.dead = dead or set()
        self.calls: list[tuple[str, str, Any, dict[str, str] | None]] = []
        self.closed = 0

    async def call(self, address: str, endpoint: str, payload: Any, *,
                   headers: dict[str, str] | None = None) -> AsyncIterator[Any]:
        self.calls.append((address, endpoint, payload, headers))
        try:
            if address in self.dead:
                raise InstanceUnavailable(f"{address} refused")
            yield address
            yield payload
        finally:
            self.closed += 1


async def test_round_robin_alternates_over_live_instances() -> None:
    c = EndpointClient(FakeCaller(), Source(1, 2, 3), "W", "generate")
    seen = [(await collect(c.round_robin("x")))[0] for _ in range(6)]
    assert seen == ["addr1", "addr2", "addr3", "addr1", "addr2", "addr3"]


async def test_retry_on_unreachable_instance_then_no_instances() -> None:
    caller = FakeCaller(dead={"addr1"})
    c = EndpointClient(caller, Source(1, 2), "W", "generate", rng=random.Random(0),
                       wait_timeout=0.1)
    for _ in range(5):
        assert await collect(c.random("p")) == ["addr2", "p"]
    caller.dead.add("addr2")
    with pytest.raises(NoInstancesError, match="no reachable instance of W/generate"):
        await collect(c.round_robin("p"))
    with pytest.raises(NoInstancesError, match="no instance of W/generate"):
        await collect(EndpointClient(caller, Source(), "W", "generate").round_robin("p"))


async def test_direct_does_not_retry_and_names_the_instance() -> None:
    caller = FakeCaller(dead={"addr1"})
    c = EndpointClient(caller, Source(1, 2), "W", "generate")
    assert await collect(c.direct("p", 2)) == ["addr2", "p"]
    with pytest.raises(InstanceUnavailable):
        await collect(c.direct("p", 1))
    with pytest.raises(NoInstancesError, match="no live instance 9"):
        await collect(c.direct("p", 9))


async def test_early_close_closes_the_remote_stream() -> None:
    caller = FakeCaller()
    c = EndpointClient(caller, Source(1), "W", "generate")
    it = c.round_robin("p")
    assert await it.__anext__() == "addr1"
    await it.aclose()  # type: ignore[attr-defined]
    assert caller.closed == 1


async def test_request_id_is_forwarded_in_headers() -> None:
    caller = FakeCaller()
    c = EndpointClient(caller, Source(1), "W", "generate")
    token = set_request_id("req-42")
    try:
        await collect(c.round_robin("p"))
    finally:
        reset_request_id(token)
    await collect(c.round_robin("p"))
    assert [call[3] for call in caller.calls] == [{"x-request-id": "req-42"}, None]


async def test_component_client_named_endpoints() -> None:
    caller = FakeCaller()
    eps = {n: EndpointClient(caller, Source(7), "W", n) for n in ("generate", "stats")}
    cc = ComponentClient("W", eps)
    assert await collect(cc.generate(1)) == ["addr7", 1]
    assert await collect(cc.stats(2)) == ["addr7", 2]
    assert await collect(direct(cc.stats, 3, 7)) == ["addr7", 3]
    assert await collect(at_random(cc.stats, 4)) == ["addr7", 4]
    assert instance_ids(cc.generate) == [7]
    assert [c[1] for c in caller.calls] == ["generate", "stats", "stats", "stats"]
    with pytest.raises(AttributeError, match="no endpoint 'nope'"):
        cc.nope(1)
    with pytest.raises(TypeError, match="not an endpoint of a depends"):
        instance_ids(lambda r: r)


class Item(msgspec.Struct):
    n: int


class ItemCaller:
    """Answers each call with the payload's ``items``, as they would come off the wire."""

    async def call(self, address: str, endpoint: str, payload: Any, *,
                   headers: dict[str, str] | None = None) -> AsyncIterator[Any]:
        for item in payload["items"]:
            yield item


async def test_items_are_decoded_into_the_declared_type_once() -> None:
    c = EndpointClient(ItemCaller(), Source(1), "W", "generate", response_type=Item)
    kept = Item(3)
    got = await collect(c.round_robin({"items": [{"n": 1}, {"n": 2}, kept]}))
    assert got[:2] == [Item(1), Item(2)]
    assert got[2] is kept  # already typed (a local callee's item): passed through
    assert await collect(c.direct({"items": [{"n": 5}]}, 1)) == [Item(5)]
    with pytest.raises(InvalidResponse, match="W.generate answered"):
        await collect(c.round_robin({"items": [{"n": "five"}]}))


class LateSource(Source):
    """No instances until ``wait_for`` has been awaited once (a watch catching up)."""

    def __init__(self) -> None:
        super().__init__()
        self.waited = 0

    async def wait_for(self, count: int = 1, timeout: float = 10.0) -> list[Inst]:  # noqa: ASYNC109
        self.waited += 1
        self.live = [Inst(5, "addr5")]
        return self.live


async def test_waits_briefly_for_a_first_instance() -> None:
    src = LateSource()
    c = EndpointClient(FakeCaller(), src, "W", "generate")
    assert await collect(c.round_robin("p")) == ["addr5", "p"]
    assert src.waited == 1


async def test_a_replacement_registering_while_all_refuse_is_used() -> None:
    import asyncio

    src = Source(1)
    caller = FakeCaller(dead={"addr1"})
    c = EndpointClient(caller, src, "W", "generate", wait_timeout=2.0)

    async def replace() -> None:
        await asyncio.sleep(0.1)
        src.live = [Inst(1, "addr1"), Inst(2, "addr2")]

    task = asyncio.create_task(replace())
    assert await collect(c.round_robin("p")) == ["addr2", "p"]
    await task


async def test_an_instance_in_this_process_is_preferred() -> None:
    from dynagraph.runtime.rpc import RpcServer

    srv = RpcServer(local_calls=True)
    await srv.start()
    try:
        source = Source(1, 2)
        source.live.append(Inst(3, srv.address))  # an embedded component of this process
        c = EndpointClient(FakeCaller(), source, "W", "generate")
        seen = {(await collect(c.round_robin("x")))[0] for _ in range(4)}
        assert seen == {srv.address}
        source.live.pop()  # gone: the others again
        assert {(await collect(c.round_robin("x")))[0] for _ in range(4)} == {"addr1", "addr2"}
    finally:
        await srv.stop()
