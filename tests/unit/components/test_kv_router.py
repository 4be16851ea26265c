"""Router logic with fakes: RouterState decisions and the component's worker bookkeeping."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from components.kv_router import Router, RouterConfig
from components.worker import VllmWorker
from dynagraph.errors import NoInstancesError, StreamBroken
from dynagraph.llm.engines.base import EngineLoad
from dynagraph.llm.router import BlockHasher, CostModel, RouteRequest, RouterMode, RouterState
from dynagraph.llm.router.events import RelayBatch
from dynagraph.runtime.discovery import MemoryDiscovery, MemoryStore
from dynagraph.sdk import RuntimeContext
from dynagraph.sdk.testing import in_memory_client
from tests.support.poll import until
from tests.support.router import state_with

A, B = 0xA1, 0xB2
C, D = 0xC, 0xD
BS = 4
hasher = BlockHasher(BS)


def prompt(tag: int, blocks: int, extra: int = 0) -> list[int]:
    return [tag * 1000 + i for i in range(blocks * BS + extra)]


# --- RouterState --------------------------------------------------------------------


def test_kv_mode_prefers_the_worker_holding_the_prefix() -> None:
    s = state_with(A, B)
    shared = hasher.block_hashes(prompt(1, 8))
    s.apply(B, RelayBatch(seq=1, snapshot=True, stored=shared))
    req = hasher.block_hashes(prompt(1, 8) + prompt(2, 2))
    d = s.decide(RouterMode.KV, req)
    assert (d.worker_id, d.overlap_blocks) == (B, 8)
    assert s.decide(RouterMode.KV_LOAD, req).overlap_blocks in (0, 8)


def test_pooled_blocks_are_priced_between_on_engine_and_uncached() -> None:
    s = state_with(A, B, C)
    blocks = hasher.block_hashes(prompt(1, 8))
    s.apply(A, RelayBatch(seq=1, snapshot=True, stored=blocks[:2]))  # 2 on the engine
    s.apply(B, RelayBatch(seq=1, snapshot=True, pooled_stored=blocks))  # 8 in its pool
    s.apply(C, RelayBatch(seq=1, snapshot=True, stored=blocks[:4], pooled_stored=blocks[:6]))
    assert s.pooled_beyond(blocks, {A: 2, C: 4}) == {B: 8, C: 2}
    d = s.decide(RouterMode.KV, blocks, pool_block_seconds=1e-6)
    assert d.worker_id == B  # 8 cheap loads beat 4 on-engine blocks + 2 loads + 2 computed
    assert d.costs[B] < d.costs[C] < d.costs[A]
    # not priced: the longest on-engine prefix wins again
    assert s.decide(RouterMode.KV, blocks, pool_block_seconds=None).worker_id == C
    # a pool slower than computing: the engines with a pool will load anyway, so the
    # one without wins
    assert s.decide(RouterMode.KV, blocks, pool_block_seconds=1.0).worker_id == A
    s.remove_worker(B)
    assert s.pooled_beyond(blocks, {}) == {C: 6}


def tier_fleet() -> tuple[RouterState, list[int]]:
    """A, B and C share one host's tier; D names the same directory on another host."""
    s = state_with(A, B, C, D)
    for w in (A, B, C):
        s.set_tier(w, "host-1:/dev/shm/kv/none")
    s.set_tier(D, "host-2:/dev/shm/kv/none")
    return s, hasher.block_hashes(prompt(1, 8))


def test_a_shared_tier_prices_what_any_worker_of_that_tier_wrote() -> None:
    s, blocks = tier_fleet()
    s.apply(A, RelayBatch(seq=1, snapshot=True, stored=blocks[:2], pooled_stored=blocks[:4],
                          tiered_stored=blocks[:4]))
    s.apply(B, RelayBatch(seq=1, snapshot=True, tiered_stored=blocks))  # B wrote all 8
    s.apply(C, RelayBatch(seq=1, snapshot=True, stored=blocks[:3]))
    # past each one's engine prefix and pool: A 2 on the engine + 2 pooled + 4 from the
    # tier, B 8 from it, C 3 on the engine + 5 from it; D shares no tier with them
    assert s.offloaded(blocks, {A: 2, C: 3}) == {
        A: {"pool": 2, "shared": 4}, B: {"shared": 8}, C: {"shared": 5}}
    d = s.decide(RouterMode.KV, blocks, pool_block_seconds=1e-6, tier_block_seconds=2e-6)
    assert d.worker_id in (A, B, C) and d.costs[D] > max(d.costs[w] for w in (A, B, C))
    assert d.costs[C] < d.costs[B]  # on-engine blocks beat tier loads
    # the tier not priced: C's longer on-engine prefix wins
    assert s.decide(RouterMode.KV, blocks, pool_block_seconds=None,
                    tier_block_seconds=None).worker_id == C
    s.remove_worker(B)  # what B wrote is no longer known; A's four still are
    assert s.offloaded(blocks, {A: 2, C: 3}) == {A: {"pool": 2}, C: {"shared": 1}}


def test_blocks_trimmed_from_a_shared_tier_are_gone_for_every_worker_of_it() -> None:
    s, blocks = tier_fleet()
    s.apply(A, RelayBatch(seq=1, snapshot=True, tiered_stored=blocks[:4]))
    s.apply(B, RelayBatch(seq=1, snapshot=True, tiered_stored=blocks))
    s.apply(D, RelayBatch(seq=1, snapshot=True, tiered_stored=blocks))
    # C's trimmer deleted the files of blocks 2.. (C wrote none of them)
    s.apply(C, RelayBatch(seq=2, tiered_removed=blocks[2:]))
    assert s.tiered.worker_blocks(A) == set(blocks[:2])
    assert s.tiered.worker_blocks(B) == set(blocks[:2])
    assert s.tiered.worker_blocks(D) == set(blocks)  # another host's tier
    assert s.offloaded(blocks, {}) == {A: {"shared": 2}, B: {"shared": 2},
                                       C: {"shared": 2}, D: {"shared": 8}}


def test_the_choice_is_limited_to_the_workers_of_the_model() -> None:
    s = state_with(A, B)
    shared = hasher.block_hashes(prompt(1, 8))
    s.apply(B, RelayBatch(seq=1, snapshot=True, stored=shared))
    for mode in RouterMode:
        d = s.decide(mode, shared, allowed=[A])
        assert (d.worker_id, d.overlap_blocks) == (A, 0), mode


def test_inflight_requests_predict_the_prefix_and_count_as_load_once() -> None:
    s = state_with(A, B)
    group = [hasher.block_hashes(prompt(7, 8) + prompt(100 + i, 1)) for i in range(6)]
    first = s.decide(RouterMode.KV, group[0], cost_model=CostModel.BLOCKS).worker_id
    s.begin(first, group[0])
    for req in group[1:]:  # nothing indexed yet: the in-flight prefix keeps them together
        d = s.decide(RouterMode.KV, req, cost_model=CostModel.BLOCKS)
        assert (d.worker_id, d.overlap_blocks) == (first, 8)
        s.begin(d.worker_id, req)
    other = s.decide(RouterMode.KV, hasher.block_hashes(prompt(8, 9)), cost_model=CostModel.BLOCKS)
    assert other.worker_id != first  # a new prefix goes to the idle worker
    for req in group:
        s.end(first, req)
    assert s.inflight[first] == {}


def test_reported_load_steers_kv_load_mode() -> None:
    s = state_with(A, B)
    s.set_load(A, EngineLoad(kv_blocks_used=50, kv_blocks_total=1000))
    assert all(s.decide(RouterMode.KV_LOAD, [1, 2], cost_model=CostModel.BLOCKS).worker_id == B
               for _ in range(5))
    s.set_load(A, EngineLoad(running=3, kv_blocks_total=1000))  # three decoding
    assert all(s.decide(RouterMode.KV_LOAD, [1, 2], block_size=BS).worker_id == B
               for _ in range(5))


def test_time_model_forecasts_queues_of_tracked_requests() -> None:
    """Routed requests queue their uncached tokens on their worker: a group's prefix stays
    on its worker while that costs less time than computing it elsewhere, unrelated
    prompts go to the shorter queue, and ending a request frees its worker."""
    s = state_with(A, B)
    t = 100.0
    group = [prompt(7, 64) + prompt(100 + i, 1) for i in range(3)]
    keys = iter(range(100))

    def route(tokens: list[int], now: float) -> tuple[int, int]:
        hashes = hasher.block_hashes(tokens)
        d = s.decide(RouterMode.KV, hashes, prompt_tokens=len(tokens), block_size=BS, now=now)
        key = next(keys)
        s.begin(d.worker_id, hashes, key=key, now=now,
                uncached_tokens=max(len(tokens) - d.overlap_blocks * BS, 1))
        return d.worker_id, key

    first, k0 = route(group[0], t)
    assert s.queues[first].queued_tokens == 260
    other = B if first == A else A
    # half of it is computed (prior speed 1e-4 s per token): the group's next requests
    # hit the predicted prefix, 4 tokens each behind 130, rather than 260 elsewhere
    t += 0.013
    for tokens in group[1:]:
        assert route(tokens, t)[0] == first
    assert s.queues[first].queued_tokens == pytest.approx(138)
    # an unrelated prompt goes to the idle worker, the next one to the shorter queue
    lone, k_lone = route(prompt(9, 80), t)
    assert lone == other and s.queues[other].queued_tokens == 320
    assert route(prompt(10, 10), t)[0] == first
    # time passes: the queues drain; ending a request forgets it
    s.end(other, hasher.block_hashes(prompt(9, 80)), k_lone)
    _, loads = s.inputs([], now=t + 1.0)
    assert (s.queues[first].queued_tokens, s.queues[first].decoding) == (0, 4)
    assert (loads[first].decoding, loads[other].decoding) == (4, 0)


def test_load_reports_teach_speeds_and_correct_the_forecast() -> None:
    s = state_with(A, B)
    s.set_load(A, EngineLoad(requests_total=3), now=9.0)
    s.begin(A, [], key=1, uncached_tokens=5000, now=10.0)
    s.set_load(A, EngineLoad(requests_total=4, prefilling=1, prefill_tokens_total=2000,
                             prefill_seconds_total=1.0), now=10.2)
    assert s.rates(A).prefill_s_per_token > 1e-4  # learning towards 5e-4
    assert 0 < s.queues[A].queued_tokens < 5000
    s.set_load(A, EngineLoad(requests_total=4, prefilling=0, prefill_tokens_total=2000,
                             prefill_seconds_total=1.0), now=10.3)
    assert (s.queues[A].queued_tokens, s.queues[A].decoding) == (0, 1)
    s.end(A, [], 1)
    assert s.queues[A].decoding == 0


def test_learned_speeds_refresh_at_most_every_half_second_while_time_is_given() -> None:
    from dynagraph.llm.router.state import RATES_REFRESH_S

    s = state_with(A, B)
    slow = EngineLoad(prefill_tokens_total=2000, prefill_seconds_total=1.0)
    prior = s.rates(A, now=0.0).prefill_s_per_token
    s.set_load(A, slow, now=0.1)
    assert s.all_rates(0.2)[A].prefill_s_per_token == prior  # cached: O(1) per decision
    refreshed = s.all_rates(RATES_REFRESH_S)
    assert refreshed[A].prefill_s_per_token > prior
    assert refreshed[B] == refreshed[A]  # B has no data of its own: the fleet's (A's) speed
    # without a time, or after the fleet changed, always as learned so far
    s.set_load(A, EngineLoad(prefill_tokens_total=4000, prefill_seconds_total=3.0), now=0.6)
    assert s.all_rates(0.7)[A] == refreshed[A]
    assert s.all_rates()[A].prefill_s_per_token > refreshed[A].prefill_s_per_token
    s.add_worker(0xC3)
    assert 0xC3 in s.all_rates(0.8)


def test_modes_that_ignore_load_do_not_forecast_it() -> None:
    from dynagraph.llm.router.cost import WorkerLoad

    s = state_with(A, B)
    s.begin(A, [], key=1, uncached_tokens=500, now=1.0)
    _, loads = s.inputs([], now=1.0, costed=False)
    assert loads == {A: WorkerLoad(), B: WorkerLoad()}
    assert s.decide(RouterMode.RANDOM, [], now=1.0).costs == {}
    _, loads = s.inputs([], now=1.0)
    assert loads[A].queued_tokens == 500


def test_ended_requests_teach_how_long_requests_stay_and_full_batches_count() -> None:
    s = state_with(A, B)
    s.set_load(A, EngineLoad(running=4, max_num_seqs=4), now=0.0)
    s.set_load(B, EngineLoad(max_num_seqs=4), now=0.0)
    for key in range(3):
        s.begin(A, [], key=key, uncached_tokens=10, now=1.0)
        s.end(A, [], key, now=4.0)  # 3 s each
    learned = s.rates(A).request_s
    assert 2.0 < learned < 3.0  # from the prior (2 s) towards 3 s
    assert s.rates(B).request_s == learned  # the fleet's, without its own
    _, loads = s.inputs([], now=5.0)
    assert (loads[A].active, loads[A].slots, loads[B].active) == (4, 4, 0)
    d = s.decide(RouterMode.KV, [], now=5.0)
    # A's batch is full: one place frees every learned / 4 s (and A runs decode steps)
    assert d.worker_id == B
    assert d.ttft_s[A] - d.ttft_s[B] == pytest.approx(learned / 4 + s.rates(A).decode_step_s)


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
    """The workers' endpoints behind ``self.worker``: one queue per (worker, endpoint)
    stream; the workers are those registered in ``store``."""

    def __init__(self) -> None:
        self.queues: dict[tuple[int, str], asyncio.Queue[Any]] = {}
        self.opened: list[tuple[int, str]] = []

    def q(self, w: int, ep: str) -> asyncio.Queue[Any]:
        return self.queues.setdefault((w, ep), asyncio.Queue())

    def client(self, watch: Any) -> Any:
        endpoints = ("generate", "release", "kv_events", "load_metrics")
        return in_memory_client(
            VllmWorker, {ep: functools.partial(self.direct, endpoint=ep) for ep in endpoints},
            instance_ids=lambda: [i.instance_id for i in watch.instances()])

    async def direct(self, request: Any, instance_id: int, *,
                     endpoint: str = "generate") -> AsyncIterator[Any]:
        self.opened.append((instance_id, endpoint))
        q = self.q(instance_id, endpoint)
        while True:
            item = await q.get()
            if isinstance(item, Exception):
                raise item
            yield item


async def _router(store: MemoryStore, fake: FakeWorkers, **cfg: Any) -> Router:
    disc = MemoryDiscovery(store)
    await disc.start()
    runtime = RuntimeContext(namespace="dynamo", component="Router", worker_index=0,
                             instance_id=disc.instance_id, discovery=disc)
    watch = await disc.watch_instances("dynamo", "VllmWorker", "kv_events")
    cfg.setdefault("sync_timeout", 0.0)  # the fakes send no snapshot unless told
    router = Router(RouterConfig(seed=0, reconnect_delay=0.01, **cfg), runtime=runtime,
                    worker=fake.client(watch))
    await router.start()
    return router


async def _worker(store: MemoryStore) -> MemoryDiscovery:
    disc = MemoryDiscovery(store)
    await disc.start()
    meta = {"block_size": BS, "kv_hash_algo": "sha256", "kv_hash_seed": "vllm-none-hash"}
    for ep in ("generate", "kv_events", "load_metrics"):
        await disc.register("dynamo", "VllmWorker", ep, "127.0.0.1:1", meta)
    return disc


def wire(item: Any) -> Any:
    """An endpoint's item as it travels (plain values, defaults left out)."""
    return msgspec.to_builtins(item)


async def _route(router: Router, tokens: list[int]) -> dict[str, Any]:
    gen = router.generate(RouteRequest(token_ids=tokens))
    try:
        return wire(await anext(gen))  # type: ignore[no-any-return]
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
        assert wire(await anext(gen))["mode"] == "kv-load"
        await gen.aclose()  # type: ignore[attr-defined]
        await wa.put("/dynamo/settings/Router/mode", "round-robin")
        await until(lambda: router.mode_for(None) is RouterMode.ROUND_ROBIN)
        assert {(await _route(router, shared))["worker_id"] for _ in range(2)} == {a, b}
        gen = router.generate(RouteRequest(token_ids=shared, mode=RouterMode.KV_LOAD))
        assert wire(await anext(gen))["mode"] == "round-robin"  # etcd wins over the request
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
        assert first.worker_id == w
        assert len(router.state.inflight[w]) == 3
        waiter = asyncio.ensure_future(anext(gen))
        await asyncio.sleep(0.01)
        assert not waiter.done()  # the stream stays open while the request runs
        waiter.cancel()  # what the request plane does when the caller closes the stream
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert router.state.inflight[w] == {}
        assert router.pressure.inflight == {}
    finally:
        await router.stop()


async def test_gated_decisions_carry_the_pressure_before_the_request() -> None:
    from dynagraph.llm.tenants.slo import default_slo_classes
    from dynagraph.llm.tenants.slo_admission import SloAdmission, SloAdmissionConfig

    gate = SloAdmission(SloAdmissionConfig(enabled=True, delay_at_requests=50,
                                           shed_at_requests=90, delay_at_prefills=None),
                        default_slo_classes()).gate("batch")
    store, fake = MemoryStore(), FakeWorkers()
    w = (await _worker(store)).instance_id
    router = await _router(store, fake)
    try:
        await until(lambda: len(fake.opened) == 2)
        fake.q(w, "load_metrics").put_nowait(EngineLoad(
            running=3, waiting=2, kv_blocks_used=50, kv_blocks_total=200).model_dump())
        await until(lambda: w in router.state.healthy)
        plain = router.generate(RouteRequest(token_ids=prompt(9, 1), track=True))
        assert "pressure" not in wire(await anext(plain))  # only a gated request needs it
        await plain.aclose()  # type: ignore[attr-defined]
        gens = [router.generate(RouteRequest(token_ids=prompt(i, 1), track=True,
                                             admission=gate)) for i in range(2)]
        seen = [wire(await anext(g))["pressure"]["workers"][0] for g in gens]
        assert all(p.pop("predicted_ttft_s") > 0 for p in seen)
        # the first request may still be in prefill (forecast) when the second is decided
        first, second = (p.pop("prefilling", 0) for p in seen)
        assert first == 0 and second in (0, 1)
        assert seen == [{"worker_id": w, "running": 3, "waiting": 2, "kv_usage": 0.25},
                        {"worker_id": w, "running": 3, "waiting": 2, "inflight": 1,
                         "kv_usage": 0.25}]
        assert router.pressure.inflight == {w: 2}
        for g in gens:
            await g.aclose()  # type: ignore[attr-defined]
        assert router.pressure.inflight == {}
    finally:
        await router.stop()


async def test_admission_is_judged_and_counted_in_one_step() -> None:
    """Gated requests arriving together: each sees the ones admitted before it, so no more
    than delay-at-requests get through; a delayed one is not counted and its stream ends."""
    from dynagraph.llm.tenants.slo import default_slo_classes
    from dynagraph.llm.tenants.slo_admission import SloAdmission, SloAdmissionConfig

    gate = SloAdmission(SloAdmissionConfig(enabled=True, delay_at_requests=2,
                                           shed_at_requests=9, delay_step=0.1,
                                           delay_at_prefills=None),  # counts, not prefills
                        default_slo_classes()).gate("batch")
    store, fake = MemoryStore(), FakeWorkers()
    w = (await _worker(store)).instance_id
    router = await _router(store, fake)
    try:
        gens = [router.generate(RouteRequest(token_ids=prompt(i, 1), track=True,
                                             admission=gate)) for i in range(3)]
        got = [wire(await anext(g)) for g in gens]
        assert [d["verdict"]["action"] for d in got] == ["admit", "admit", "delay"]
        assert got[2]["verdict"]["delay_s"] == 0.1
        assert router.pressure.inflight == {w: 2}
        with pytest.raises(StopAsyncIteration):
            await anext(gens[2])  # not tracked: nothing to hold open
        for g in gens[:2]:
            await g.aclose()  # type: ignore[attr-defined]
        assert router.pressure.inflight == {} and router.state.inflight[w] == {}
    finally:
        await router.stop()


def test_pressure_counts_prefills_from_the_forecast_and_the_report() -> None:
    from dynagraph.llm.router.pressure import PressureView

    s, view = state_with(A, B), PressureView()
    s.begin(A, [], key=1, uncached_tokens=3000, now=0.0)  # forecast: still in prefill
    s.set_load(B, EngineLoad(kv_blocks_total=1000, running=2, prefilling=2))  # report says 2
    got = {p.worker_id: p.prefilling for p in view.summary(s).workers}
    assert got == {A: 1, B: 2}
    s.end(A, [], key=1)
    assert {p.worker_id: p.prefilling for p in view.summary(s).workers} == {A: 0, B: 2}


def test_the_slo_class_scales_the_overlap_weight() -> None:
    from dynagraph.llm.router.pressure import (
        DEFAULT_CLASS_OVERLAP_WEIGHTS,
        class_overlap_weight,
    )
    scales = DEFAULT_CLASS_OVERLAP_WEIGHTS
    assert class_overlap_weight(1.0, "interactive", scales) == 0.5
    assert class_overlap_weight(2.0, "batch", scales) == 4.0
    assert class_overlap_weight(1.5, "default", scales) == 1.5
    assert class_overlap_weight(1.5, None, scales) == 1.5
    # B holds 4 of the request's 6 blocks but is busier: a batch request takes the cache
    # hit, an interactive one the idle worker.
    s = state_with(A, B)
    s.set_load(A, EngineLoad(kv_blocks_used=0, kv_blocks_total=1000))
    s.set_load(B, EngineLoad(kv_blocks_used=3, kv_blocks_total=1000))
    shared = hasher.block_hashes(prompt(1, 4))
    s.apply(B, RelayBatch(seq=1, snapshot=True, stored=shared))
    req = hasher.block_hashes(prompt(1, 4) + prompt(2, 2))
    # Dynamo's block cost = w * (6 - overlap) + active + 6:  A = 6w + 6,  B = 2w + 9
    blocks = CostModel.BLOCKS
    assert s.decide(RouterMode.KV, req, cost_model=blocks,
                    overlap_weight=class_overlap_weight(1.0, "batch", scales)).worker_id == B
    assert s.decide(RouterMode.KV, req, cost_model=blocks, overlap_weight=class_overlap_weight(
        1.0, "interactive", scales)).worker_id == A


async def test_a_full_worker_is_asked_to_hand_back_waiting_requests_when_places_free_up() -> None:
    store, fake = MemoryStore(), FakeWorkers()
    busy, idle = [(await _worker(store)).instance_id for _ in range(2)]
    router = await _router(store, fake, rebalance_wait=1.0)
    try:
        await until(lambda: len(fake.opened) == 4)
        # 4 running and 6 waiting, a place freeing every 0.5 s (prior: 2 s a request)
        fake.q(busy, "load_metrics").put_nowait(
            EngineLoad(running=4, waiting=6, max_num_seqs=4).model_dump())
        await until(lambda: busy in router.state.healthy)
        assert (busy, "release") not in fake.opened  # no free place anywhere yet
        router._rebalanced_at = -1e9  # judge the next report at once
        fake.q(idle, "load_metrics").put_nowait(EngineLoad(max_num_seqs=4).model_dump())
        await until(lambda: (busy, "release") in fake.opened)
        # the 2 first in line start within 1 s; the other 4 fill the 4 free places
        metric = router.metrics.rebalanced_requests.labels(f"{busy:x}")
        assert metric._value.get() == 4  # type: ignore[attr-defined]
        assert (idle, "release") not in fake.opened
    finally:
        await router.stop()


def test_a_quiet_workers_load_follows_its_reports_and_this_routers_requests() -> None:
    """Loads of workers with none of this Router's requests are kept per report (the
    bulk of a large fleet costs a lookup per decision); a new report, or a request
    routed there, is seen at once, and equal loads are one object."""
    s = state_with(A, B)
    _, first = s.inputs([], now=1.0)
    assert first[A] is first[B]  # equal reports: one shared load
    s.set_load(A, EngineLoad(running=2, waiting=1, max_num_seqs=8), now=1.0)
    _, loads = s.inputs([], now=1.0)
    assert (loads[A].active, loads[A].slots, loads[B].active) == (3, 8, 0)
    s.begin(B, [], key=1, uncached_tokens=300, now=1.0)
    _, loads = s.inputs([], now=1.0)
    assert loads[B].queued_tokens == 300
    s.end(B, [], 1, now=1.5)
    _, loads = s.inputs([], now=1.5)
    assert loads[B] is first[B]  # quiet again, the same report
    s.remove_worker(A)
    assert A not in s.inputs([], now=2.0)[1]


def test_the_time_cost_is_the_same_however_loads_are_shared() -> None:
    """choose_worker prices each distinct (load, speeds, cached prefix) once: shared
    load objects must give every worker the cost its own copy would."""
    from dynagraph.llm.router.cost import WorkerLoad, choose_worker

    busy = WorkerLoad(queued_tokens=500, decoding=2, active=3, slots=4)
    workers = range(1, 9)
    overlaps = {1: 3, 2: 3, 5: 1}
    shared = {w: (busy if w % 2 else WorkerLoad()) for w in workers}
    copies = {w: WorkerLoad(**vars(load)) for w, load in shared.items()}
    got = [choose_worker(RouterMode.KV, overlaps, loads, 4, random.Random(0),
                         prompt_tokens=130, block_size=32).costs
           for loads in (shared, copies)]
    assert got[0] == got[1] and len(set(got[0].values())) > 2


# --- Router replicas: each follows the others' in-flight streams ----------------------


class RouterPlane:
    """The request plane between Router replicas: address -> the Router served there
    (an address with no Router is one that died: unreachable)."""

    def __init__(self) -> None:
        self.routers: dict[str, Router] = {}
        self._cuts: dict[str, asyncio.Event] = {}

    def cut(self, address: str) -> Router:
        """Break every stream from ``address`` and make it unreachable; returns its Router
        (put it back in ``routers`` to make it reachable again)."""
        self._cuts.pop(address, asyncio.Event()).set()
        return self.routers.pop(address)

    def call(self, address: str, endpoint: str, payload: Any, *,
             headers: dict[str, str] | None = None) -> AsyncIterator[Any]:
        return self._stream(address, endpoint, payload)

    async def _stream(self, address: str, endpoint: str, payload: Any) -> AsyncIterator[Any]:
        from contextlib import aclosing

        from dynagraph.errors import InstanceUnavailable
        from dynagraph.llm.protocol import Subscribe

        router = self.routers.get(address)
        if router is None:
            raise InstanceUnavailable(f"{address}: connection refused")
        gen = getattr(router, endpoint)(msgspec.convert(payload, Subscribe))
        cut = self._cuts.setdefault(address, asyncio.Event())
        async with aclosing(gen):
            while True:
                item = asyncio.ensure_future(anext(gen))
                broken = asyncio.ensure_future(cut.wait())
                await asyncio.wait({item, broken}, return_when=asyncio.FIRST_COMPLETED)
                broken.cancel()
                if not item.done():
                    item.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await item
                    raise StreamBroken(f"{address}: connection lost")
                try:
                    yield wire(item.result())
                except StopAsyncIteration:
                    return


async def _replica(store: MemoryStore, plane: RouterPlane, snapshots: dict[int, list[int]],
                   **cfg: Any) -> tuple[Router, MemoryDiscovery]:
    """A Router served as ``dynamo serve`` would: started, then registered; its workers'
    KV streams start with ``snapshots`` (worker -> block hashes)."""
    from dynagraph.sdk._client import ClientFactory

    fake = FakeWorkers()
    for w, hashes in snapshots.items():
        fake.q(w, "kv_events").put_nowait(
            RelayBatch(seq=0, snapshot=True, stored=hashes).to_wire())
    disc = MemoryDiscovery(store)
    await disc.start()
    runtime = RuntimeContext(namespace="dynamo", component="Router", worker_index=0,
                             instance_id=disc.instance_id, discovery=disc,
                             clients=ClientFactory(plane, disc))
    watch = await disc.watch_instances("dynamo", "VllmWorker", "kv_events")
    router = Router(RouterConfig(seed=0, reconnect_delay=0.01, **cfg), runtime=runtime,
                    worker=fake.client(watch))
    address = f"mem:{disc.instance_id}"
    plane.routers[address] = router
    await router.start()
    for ep in ("generate", "inflight"):
        await disc.register("dynamo", "Router", ep, address, {})
    return router, disc


async def test_router_replicas_count_each_others_inflight_requests() -> None:
    store, plane = MemoryStore(), RouterPlane()
    empty: dict[int, list[int]] = {(await _worker(store)).instance_id: [] for _ in range(2)}
    (r1, d1), (r2, d2) = [await _replica(store, plane, empty) for _ in range(2)]
    try:
        await until(lambda: r1.replicas.peers.peers() == {d2.instance_id}
                    and r2.replicas.peers.peers() == {d1.instance_id})
        shared = prompt(4, 16)
        gen = r1.generate(RouteRequest(token_ids=shared + prompt(5, 1), track=True))
        first = (await anext(gen)).worker_id
        # r2 counts it within a hop: a forecast queue, the predicted prefix, the pressure
        await until(lambda: r2.state.queues[first].size == 1)
        assert len(r2.state.inflight[first]) == 17 and r2.pressure.inflight == {first: 1}
        gen2 = r2.generate(RouteRequest(token_ids=shared + prompt(6, 1), track=True))
        d = await anext(gen2)
        assert (d.worker_id, d.overlap_blocks) == (first, 16)  # no KV event yet
        await until(lambda: r1.state.queues[first].size == 2)
        assert r1.replicas.peers.count(d2.instance_id) == 1
        await gen.aclose()  # type: ignore[attr-defined]
        await until(lambda: r2.state.queues[first].size == 1)
        assert r2.replicas.peers.count() == 0 and r2.pressure.inflight == {first: 1}  # its own
        # r2 dies with its request in flight: r1 forgets it once its lease is gone
        await r2.stop()
        d2.expire()
        await until(lambda: r1.replicas.peers.peers() == set())
        assert r1.state.queues[first].idle and r1.state.inflight[first] == {}
        await gen2.aclose()  # type: ignore[attr-defined]
    finally:
        await r1.stop()
        await r2.stop()


async def test_a_broken_peer_stream_drops_its_requests_until_the_next_snapshot() -> None:
    store, plane = MemoryStore(), RouterPlane()
    w = (await _worker(store)).instance_id
    (r1, d1), (r2, d2) = [await _replica(store, plane, {w: []}) for _ in range(2)]
    try:
        gens = [r1.generate(RouteRequest(token_ids=prompt(i, 2), track=True)) for i in range(3)]
        for g in gens:
            await anext(g)
        await until(lambda: r2.replicas.peers.count(d1.instance_id) == 3)
        assert r1.replicas.feed.subscribers == 1
        # r1 unreachable for a moment: r2's stream breaks, r2 forgets, then resubscribes
        address = f"mem:{d1.instance_id}"
        router = plane.cut(address)
        await until(lambda: r2.replicas.peers.count() == 0 and r1.replicas.feed.subscribers == 0)
        assert r2.state.queues[w].idle and r2.state.inflight[w] == {}
        plane.routers[address] = router
        await until(lambda: r2.replicas.peers.count(d1.instance_id) == 3)  # the fresh snapshot
        assert r2.state.queues[w].size == 3
        for g in gens:
            await g.aclose()  # type: ignore[attr-defined]
        await until(lambda: r2.replicas.peers.count() == 0)
        assert r2.state.queues[w].idle and r2.state.inflight[w] == {}
    finally:
        await r1.stop()
        await r2.stop()


async def test_a_restarted_router_takes_requests_only_with_a_full_index() -> None:
    """Workers hold blocks and a peer has requests in flight; a Router that starts (here:
    restarts, its dead predecessor's lease not yet expired) has them all once ``start``
    returns, and that well within 2 s."""
    store, plane = MemoryStore(), RouterPlane()
    workers = [(await _worker(store)).instance_id for _ in range(8)]
    blocks = {w: hasher.block_hashes(prompt(w, 512)) for w in workers}  # 8 x 512 blocks
    peer, _ = await _replica(store, plane, blocks)
    gen = peer.generate(RouteRequest(token_ids=prompt(3, 4), track=True))
    await anext(gen)
    dead = MemoryDiscovery(store)  # the Router that was killed: registered, unreachable
    await dead.start()
    await dead.register("dynamo", "Router", "inflight", "mem:dead", {})
    router, _ = await _replica(store, plane, blocks, sync_timeout=5.0)
    try:
        assert router.synced_in_s is not None and router.synced_in_s < 2.0
        assert all(router.state.index.num_blocks(w) == 512 for w in workers)
        assert router.replicas.peers.count() == 1
        assert sum(q.size for q in router.state.queues.values()) == 1
    finally:
        await gen.aclose()  # type: ignore[attr-defined]
        await router.stop()
        await peer.stop()
