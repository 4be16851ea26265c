"""Router logic with fakes: RouterState decisions and the component's worker bookkeeping."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from components.kv_router import Router, RouterConfig
from dynagraph.errors import NoInstancesError, StreamBroken
from dynagraph.llm.engines.base import EngineLoad
from dynagraph.llm.router import BlockHasher, RouteRequest, RouterMode, RouterState
from dynagraph.llm.router.events import RelayBatch
from dynagraph.runtime.discovery import MemoryDiscovery, MemoryStore
from dynagraph.sdk import RuntimeContext

A, B = 0xA1, 0xB2
BS = 4
hasher = BlockHasher(BS)


def prompt(tag: int, blocks: int, extra: int = 0) -> list[int]:
    return [tag * 1000 + i for i in range(blocks * BS + extra)]


def state_with(*workers: int) -> RouterState:
    s = RouterState(random.Random(0))
    for w in workers:
        s.add_worker(w)
        s.set_load(w, EngineLoad(kv_blocks_total=1000))
    return s


# --- RouterState --------------------------------------------------------------------


def test_kv_mode_prefers_the_worker_holding_the_prefix() -> None:
    s = state_with(A, B)
    shared = hasher.block_hashes(prompt(1, 8))
    s.apply(B, RelayBatch(seq=1, snapshot=True, stored=shared))
    req = hasher.block_hashes(prompt(1, 8) + prompt(2, 2))
    d = s.decide(RouterMode.KV, req)
    assert (d.worker_id, d.overlap_blocks) == (B, 8)
    assert s.decide(RouterMode.KV_LOAD, req).overlap_blocks in (0, 8)


def test_inflight_requests_predict_the_prefix_and_count_as_load_once() -> None:
    s = state_with(A, B)
    group = [hasher.block_hashes(prompt(7, 8) + prompt(100 + i, 1)) for i in range(6)]
    first = s.decide(RouterMode.KV, group[0]).worker_id
    s.begin(first, group[0])
    for req in group[1:]:  # nothing indexed yet: the in-flight prefix keeps them together
        d = s.decide(RouterMode.KV, req)
        assert (d.worker_id, d.overlap_blocks) == (first, 8)
        s.begin(d.worker_id, req)
    other = s.decide(RouterMode.KV, hasher.block_hashes(prompt(8, 9)))
    assert other.worker_id != first  # a new prefix goes to the idle worker
    for req in group:
        s.end(first, req)
    assert s.inflight[first] == {}


def test_reported_load_steers_kv_load_mode() -> None:
    s = state_with(A, B)
    s.set_load(A, EngineLoad(kv_blocks_used=50, kv_blocks_total=1000))
    assert all(s.decide(RouterMode.KV_LOAD, [1, 2]).worker_id == B for _ in range(5))


def test_unhealthy_workers_are_avoided_and_removed_ones_forgotten() -> None:
    s = state_with(A, B)
    hashes = hasher.block_hashes(prompt(3, 4))
    s.apply(A, RelayBatch(seq=1, snapshot=True, stored=hashes))
    s.set_load(A, None)  # its load stream broke
    assert s.decide(RouterMode.KV, hashes).worker_id == B
    s.set_load(B, None)  # nobody healthy: every live worker is a candidate again
    assert s.decide(RouterMode.KV, hashes).worker_id == A
    s.remove_worker(A)
    assert s.index.find_matches(hashes) == {}
    assert s.decide(RouterMode.KV, hashes).worker_id == B
    s.apply(A, RelayBatch(seq=2, stored=[1]))  # a late batch of a dropped worker
    assert A not in s.index.workers()
    s.remove_worker(B)
    with pytest.raises(NoInstancesError):
        s.decide(RouterMode.KV, hashes)


def test_round_robin_and_random_modes() -> None:
    s = state_with(A, B)
    assert [s.decide(RouterMode.ROUND_ROBIN, []).worker_id for _ in range(4)] == [A, B, A, B]
    assert {s.decide(RouterMode.RANDOM, []).worker_id for _ in range(30)} == {A, B}


# --- the component, with in-memory discovery and a fake worker client ----------------


class FakeWorkers:
    """Stands in for ``self.worker``: one queue per (worker, endpoint) stream."""

    def __init__(self) -> None:
        self.queues: dict[tuple[int, str], asyncio.Queue[Any]] = {}
        self.opened: list[tuple[int, str]] = []

    def q(self, w: int, ep: str) -> asyncio.Queue[Any]:
        return self.queues.setdefault((w, ep), asyncio.Queue())

    async def direct(self, request: Any, instance_id: int, *,
                     endpoint: str = "generate") -> AsyncIterator[Any]:
        self.opened.append((instance_id, endpoint))
        q = self.q(instance_id, endpoint)
        while True:
            item = await q.get()
            if isinstance(item, Exception):
                raise item
            yield item


async def until(pred: Callable[[], bool], within: float = 2.0) -> None:
    async with asyncio.timeout(within):
        while not pred():  # noqa: ASYNC110 - polls plain state owned by the code under test
            await asyncio.sleep(0.005)


async def _router(store: MemoryStore, fake: FakeWorkers, **cfg: Any) -> Router:
    disc = MemoryDiscovery(store)
    await disc.start()
    runtime = RuntimeContext(namespace="dynamo", component="Router", worker_index=0,
                             instance_id=disc.instance_id, discovery=disc)
    router = Router(RouterConfig(seed=0, reconnect_delay=0.01, **cfg), runtime=runtime,
                    worker=fake)
    await router.start()
    return router


async def _worker(store: MemoryStore) -> MemoryDiscovery:
    disc = MemoryDiscovery(store)
    await disc.start()
    meta = {"block_size": BS, "kv_hash_algo": "sha256", "kv_hash_seed": "vllm-none-hash"}
    for ep in ("generate", "kv_events", "load_metrics"):
        await disc.register("dynamo", "VllmWorker", ep, "127.0.0.1:1", meta)
    return disc


async def _route(router: Router, tokens: list[int]) -> dict[str, Any]:
    gen = router.generate(RouteRequest(token_ids=tokens))
    try:
        return await anext(gen)
    finally:
        await gen.aclose()  # type: ignore[attr-defined]


async def test_router_follows_workers_events_loads_settings_and_lease_expiry() -> None:
    store, fake = MemoryStore(), FakeWorkers()
    wa, wb = await _worker(store), await _worker(store)
    a, b = wa.instance_id, wb.instance_id
    router = await _router(store, fake)
    try:
        assert router.hasher == BlockHasher(BS)
        await until(lambda: len(fake.opened) == 4)
        shared = prompt(5, 6)
        fake.q(b, "kv_events").put_nowait(
            RelayBatch(seq=0, snapshot=True, stored=hasher.block_hashes(shared)).to_wire())
        for w in (a, b):
            fake.q(w, "load_metrics").put_nowait(EngineLoad(kv_blocks_total=100).model_dump())
        await until(lambda: router.state.healthy == {a, b} and router.state.index.num_blocks(b) > 0)
        got = await _route(router, shared + prompt(6, 1))
        assert got == {"worker_id": b, "overlap_blocks": 6, "request_blocks": 7, "mode": "kv"}

        gen = router.generate(RouteRequest(token_ids=shared, mode=RouterMode.KV_LOAD))
        assert (await anext(gen))["mode"] == "kv-load"
        await gen.aclose()  # type: ignore[attr-defined]
        await wa.put("/dynamo/settings/Router/mode", "round-robin")
        await until(lambda: router.mode_for(None) is RouterMode.ROUND_ROBIN)
        assert {(await _route(router, shared))["worker_id"] for _ in range(2)} == {a, b}
        gen = router.generate(RouteRequest(token_ids=shared, mode=RouterMode.KV_LOAD))
        assert (await anext(gen))["mode"] == "round-robin"  # etcd wins over the request
        await gen.aclose()  # type: ignore[attr-defined]
        await wa.put("/dynamo/settings/Router/mode", "nonsense")
        await wa.delete("/dynamo/settings/Router/mode")
        await until(lambda: router.mode_for(None) is RouterMode.KV)

        fake.q(b, "load_metrics").put_nowait(StreamBroken("b died"))
        await until(lambda: b not in router.state.healthy)
        assert (await _route(router, shared))["worker_id"] == a
        wb.expire()  # lease gone: dropped from the index and the load table
        await until(lambda: b not in router.state.live)
        assert b not in router.state.index.workers() and b not in router.state.reported
        assert (await _route(router, shared))["worker_id"] == a
    finally:
        await router.stop()


async def test_tracked_request_counts_until_the_caller_closes() -> None:
    store, fake = MemoryStore(), FakeWorkers()
    w = (await _worker(store)).instance_id
    router = await _router(store, fake)
    try:
        tokens = prompt(9, 3)
        gen = router.generate(RouteRequest(token_ids=tokens, track=True))
        first = await anext(gen)
        assert first["worker_id"] == w
        assert len(router.state.inflight[w]) == 3
        waiter = asyncio.ensure_future(anext(gen))
        await asyncio.sleep(0.01)
        assert not waiter.done()  # the stream stays open while the request runs
        waiter.cancel()  # what the request plane does when the caller closes the stream
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert router.state.inflight[w] == {}
    finally:
        await router.stop()
