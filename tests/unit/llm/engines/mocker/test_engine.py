"""MockerEngine: the Engine protocol in wall-clock time, KV events, simulated KV transfers."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from dynagraph.errors import ConfigError, EngineError, InvalidRequest, PromptTooLong
from dynagraph.llm.engines import Engine, EngineOutput, SamplingSpec
from dynagraph.llm.engines.mocker import (
    KvTransferRegistry,
    MockerEngine,
    MockerEngineArgs,
    Profile,
)
from dynagraph.llm.router.events import BlocksStored, KvEvent
from dynagraph.llm.router.hashing import BlockHasher

BS = 16
SLACK_S = 0.3
"""How late a wall-clock step may be on a loaded 2-core machine."""


def flat_profile(prefill_s: float = 0.02, decode_s: float = 0.01) -> Profile:
    """Every prefill pass costs ``prefill_s`` and every decode step ``decode_s``."""
    return Profile.model_validate({
        "name": "flat", "model": {"name": "m", "hidden_size": 8, "num_layers": 1,
                                  "num_heads": 1, "num_kv_heads": 1, "head_dim": 8,
                                  "dtype": "float32"},
        "block_size": BS, "kv_bytes_per_token": 1000,
        "prefill": {"new_tokens": [1], "cached_tokens": [0], "seconds": [[prefill_s]]},
        "decode": {"batch_size": [1], "context_tokens": [1], "seconds": [[decode_s]]},
        "step_overhead_seconds": decode_s,
    })


def make(profile: Profile | None = None, events: list[KvEvent] | None = None,
         registry: KvTransferRegistry | None = None, **kw: Any) -> MockerEngine:
    """An engine of 64 blocks and a 256-token context; ``kw`` are args in kebab-case."""
    args = MockerEngineArgs.model_validate({"num-gpu-blocks": 64, "max-model-len": 256, **kw})
    return MockerEngine(args, profile=profile or flat_profile(),
                        on_kv_events=None if events is None else events.extend,
                        registry=registry or KvTransferRegistry())


def opts(**kw: Any) -> dict[str, Any]:
    """Engine args spelled in Python (``vocab_size``) for :func:`make`."""
    return {k.replace("_", "-"): v for k, v in kw.items()}


async def until(pred: Callable[[], bool], within: float = 2.0) -> None:
    async with asyncio.timeout(within):
        while not pred():  # noqa: ASYNC110 - polls state owned by the engine's task
            await asyncio.sleep(0.005)


@pytest.fixture
async def engine() -> AsyncIterator[MockerEngine]:
    e = make(speed=1000.0)
    await e.start()
    yield e
    await e.shutdown()


async def collect(stream: AsyncIterator[EngineOutput]) -> list[EngineOutput]:
    async with asyncio.timeout(5):
        return [o async for o in stream]


def toks(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def prompt(n: int, base: int = 100) -> list[int]:
    return [base + i % 900 for i in range(n)]


def test_is_an_engine() -> None:
    assert isinstance(make(), Engine)


async def test_streams_max_tokens_then_length(engine: MockerEngine) -> None:
    outs = await collect(engine.generate("r", prompt(40), SamplingSpec(max_tokens=6)))
    assert [len(o.token_ids) for o in outs] == [1] * 6
    assert [o.finish_reason for o in outs] == [None] * 5 + ["length"]
    assert all(o.num_prompt_tokens == 40 and o.num_cached_tokens == 0 for o in outs)
    assert all(0 <= t < 2048 for t in toks(outs))
    assert engine.load().kv_blocks_used == 0 and engine.load().running == 0


async def test_max_tokens_default_is_the_context_left(engine: MockerEngine) -> None:
    outs = await collect(engine.generate("r", prompt(250), SamplingSpec()))
    assert len(toks(outs)) == 6 and outs[-1].finish_reason == "length"


async def test_outputs_are_deterministic_and_never_eos() -> None:
    e = make(**opts(speed=1000.0, vocab_size=8, eos_token_ids=[0, 1]))
    await e.start()
    try:
        greedy = SamplingSpec(max_tokens=40, temperature=0)
        a = toks(await collect(e.generate("a", prompt(20), greedy)))
        b = toks(await collect(e.generate("b", prompt(20), greedy)))
        assert a == b  # greedy: the prompt decides
        assert set(a) <= set(range(2, 8))
        sampled = SamplingSpec(max_tokens=40, temperature=1.0, stop_token_ids=[7])
        c = toks(await collect(e.generate("c", prompt(20), sampled)))
        d = toks(await collect(e.generate("d", prompt(20), sampled)))
        assert c != d and 7 not in c + d  # sampled: the request id decides too
        seeded = SamplingSpec(max_tokens=40, temperature=1.0, seed=5)
        assert (toks(await collect(e.generate("e", prompt(20), seeded)))
                == toks(await collect(e.generate("f", prompt(20), seeded))))
    finally:
        await e.shutdown()


async def test_prefix_cache_hit_is_reported(engine: MockerEngine) -> None:
    await collect(engine.generate("a", prompt(40), SamplingSpec(max_tokens=2)))
    outs = await collect(engine.generate("b", prompt(40), SamplingSpec(max_tokens=2)))
    assert outs[0].num_cached_tokens == 32
    load = engine.load()
    assert (load.prefix_cache_queries, load.prefix_cache_hits) == (80, 32)


async def test_load_publishes_step_counters_and_the_profile_speeds() -> None:
    """What the Router learns speeds from: simulated seconds per step kind, and the
    profile's nominal speeds as its priors before any step."""
    e = make(flat_profile(prefill_s=0.05, decode_s=0.02), speed=10.0,
             **opts(max_num_batched_tokens=16, max_num_seqs=1))
    assert e.load().nominal_prefill_tokens_per_s == pytest.approx(16 * 10 / 0.05)
    assert e.load().nominal_decode_step_s == pytest.approx(0.02 / 10)
    await e.start()
    try:
        first = e.generate("r", prompt(40), SamplingSpec(max_tokens=4))
        second = e.generate("s", prompt(8, base=500), SamplingSpec(max_tokens=1))
        waiting = asyncio.ensure_future(collect(second))  # admitted; waits for the one slot
        await anext(first)
        assert (e.load().requests_total, e.load().prefilling) == (2, 1)
        await collect(first)
        await waiting
        load = e.load()
        # 40 prompt tokens in 3 chunks of <= 16, the third chunk's step makes the first
        # token, then 3 decode-only steps; then the 8-token prompt in one step
        assert (load.prefilling, load.prefill_tokens_total, load.decode_steps_total) == (0, 48, 3)
        assert load.prefill_seconds_total == pytest.approx(4 * 0.05 / 10)
        assert load.decode_seconds_total == pytest.approx(3 * 0.02 / 10)
        assert load.max_num_batched_tokens == 16
    finally:
        await e.shutdown()


async def test_cache_salt_isolates_the_prefix_cache_as_the_router_hashes_it() -> None:
    events: list[KvEvent] = []
    engine = make(events=events)
    await engine.start()
    try:
        await collect(engine.generate("a", prompt(40), SamplingSpec(max_tokens=2,
                                                                    cache_salt="t1")))
        other = await collect(engine.generate("b", prompt(40), SamplingSpec(max_tokens=2)))
        same = await collect(engine.generate("c", prompt(40), SamplingSpec(max_tokens=2,
                                                                           cache_salt="t1")))
    finally:
        await engine.shutdown()
    assert (other[0].num_cached_tokens, same[0].num_cached_tokens) == (0, 32)
    salted = BlockHasher(16).block_hashes(prompt(40), cache_salt="t1")
    stored = [h for ev in events if isinstance(ev, BlocksStored) for h in ev.block_hashes]
    assert salted == stored[:2]


async def test_steps_take_the_profiled_time() -> None:
    e = make(flat_profile(prefill_s=0.05, decode_s=0.02))
    await e.start()
    try:
        began = time.monotonic()
        stamps = []
        async for _ in e.generate("r", prompt(20), SamplingSpec(max_tokens=6)):
            stamps.append(time.monotonic() - began)
        # token i is due at 0.05 + 0.02 i: never early; late only by what the OS adds
        due = [0.05 + 0.02 * i for i in range(6)]
        assert all(d - 1e-3 <= t < d + SLACK_S for t, d in zip(stamps, due, strict=True)), stamps
        assert e.stats.steps == 6
        assert e.stats.busy_seconds == pytest.approx(0.05 + 5 * 0.02)
    finally:
        await e.shutdown()


async def test_late_wake_ups_do_not_add_up() -> None:
    """Timers fire up to ~1 ms late; 300 back-to-back 1 ms steps still take ~0.3 s (they
    took 0.5-0.6 s when each step was timed from its late start). The best of three runs
    counts: a busy machine only adds time (one run in a full-suite took 0.89 s)."""
    e = make(flat_profile(prefill_s=0.001, decode_s=0.001), **opts(max_model_len=512))
    await e.start()
    try:
        took = []
        for i in range(3):
            began = time.monotonic()
            await collect(e.generate(f"r{i}", prompt(20 + i), SamplingSpec(max_tokens=300)))
            took.append(time.monotonic() - began)
            if took[-1] < 0.4:
                break
        assert 0.3 - 1e-3 <= min(took) < 0.3 + 0.1, took
    finally:
        await e.shutdown()


@pytest.mark.parametrize("speed", [10.0, 20.0])
async def test_speed_divides_the_time(speed: float) -> None:
    """Five steps of 1 s each take 5 / speed seconds, simulated and on the wall clock."""
    e = make(flat_profile(prefill_s=1.0, decode_s=1.0), speed=speed)
    await e.start()
    try:
        want = 5.0 / speed
        took = []
        for i in range(3):  # the best of three: a loaded 2-core machine delays some runs
            began = time.monotonic()
            await collect(e.generate(f"r{i}", prompt(20, 100 + i), SamplingSpec(max_tokens=5)))
            took.append(time.monotonic() - began)
            if took[-1] < want * 1.2:
                break
        assert e.stats.busy_seconds / len(took) == pytest.approx(want)
        assert want - 1e-3 <= min(took) < want * 1.2, took  # 20 % slack, not 7x
    finally:
        await e.shutdown()


async def test_concurrent_requests_share_steps(engine: MockerEngine) -> None:
    specs = [("a", 30), ("b", 50), ("c", 10)]
    results = await asyncio.gather(*(
        collect(engine.generate(rid, prompt(n, 200 + i), SamplingSpec(max_tokens=8)))
        for i, (rid, n) in enumerate(specs)))
    assert all(len(toks(r)) == 8 for r in results)
    assert engine.stats.steps < 3 * 8


async def test_idle_engine_takes_no_steps(engine: MockerEngine) -> None:
    await collect(engine.generate("a", prompt(10), SamplingSpec(max_tokens=2)))
    steps = engine.stats.steps
    await asyncio.sleep(0.05)
    assert engine.stats.steps == steps
    task = engine._task
    assert task is not None and not task.done()


async def test_abort_from_another_task_ends_the_stream() -> None:
    e = make(flat_profile(decode_s=0.01))
    await e.start()
    try:
        outs: list[EngineOutput] = []

        async def consume() -> None:
            async for o in e.generate("r", prompt(20), SamplingSpec(max_tokens=1000)):
                outs.append(o)

        task = asyncio.create_task(consume())
        await until(lambda: len(outs) >= 3)
        await e.abort("r")
        await asyncio.wait_for(task, 2)
        assert outs[-1].finish_reason == "abort" and outs[-1].token_ids == []
        assert e.load().kv_blocks_used == 0
        await e.abort("r")  # finished: ignored
    finally:
        await e.shutdown()


async def test_closing_the_iterator_aborts_and_frees_blocks() -> None:
    # 216 decode steps of 50 ms (the context's limit): left alone, the request would run
    # for ~11 s, so only an abort frees it within the 1 s waited below.
    e = make(flat_profile(decode_s=0.05))
    await e.start()
    try:
        stream = e.generate("r", prompt(40), SamplingSpec(max_tokens=1000))
        async for _ in stream:
            assert e.load().kv_blocks_used == 3 and e.load().running == 1
            break
        await stream.aclose()
        await until(lambda: not (e.load().running or e.load().kv_blocks_used), within=1.0)
        steps = e.stats.decode_steps
        assert steps < 20, steps  # stopped early, not run to its end
        await asyncio.sleep(0.15)
        assert e.stats.decode_steps == steps  # and takes no more steps
    finally:
        await e.shutdown()


async def test_kv_event_hashes_are_the_router_hashes() -> None:
    events: list[KvEvent] = []
    e = make(events=events, speed=1000.0)
    await e.start()
    try:
        p = prompt(70)
        outs = await collect(e.generate("r", p, SamplingSpec(max_tokens=30)))
        seq = p + toks(outs)
        computed = len(seq) - 1  # the last sampled token is never computed
        expected = BlockHasher(BS).block_hashes(seq)[: computed // BS]
        stored = [ev for ev in events if isinstance(ev, BlocksStored)]
        assert [h for ev in stored for h in ev.block_hashes] == expected
        assert all(ev.block_size == BS for ev in stored)
        assert stored[0].parent_hash is None
        for prev, ev in zip(stored, stored[1:], strict=False):
            assert ev.parent_hash == prev.block_hashes[-1]
    finally:
        await e.shutdown()


async def test_refused_requests(engine: MockerEngine) -> None:
    with pytest.raises(InvalidRequest, match="empty"):
        await collect(engine.generate("r", [], SamplingSpec()))
    with pytest.raises(PromptTooLong):
        await collect(engine.generate("r", prompt(256), SamplingSpec()))
    stream = engine.generate("dup", prompt(10), SamplingSpec(max_tokens=50))
    first = await anext(stream)
    assert first.token_ids
    with pytest.raises(InvalidRequest, match="already in flight"):
        await collect(engine.generate("dup", prompt(10), SamplingSpec()))
    await stream.aclose()


async def test_not_started_and_shutdown() -> None:
    e = make(flat_profile(decode_s=0.01))
    with pytest.raises(EngineError, match="not started"):
        await collect(e.generate("r", prompt(10), SamplingSpec()))
    await e.start()
    stream = e.generate("r", prompt(10), SamplingSpec(max_tokens=1000))
    await anext(stream)
    await e.shutdown()
    rest = await collect(stream)
    assert rest[-1].finish_reason == "abort"
    await e.shutdown()  # idempotent


def test_a_cache_too_small_for_one_request_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="max-model-len"):
        make(**opts(num_gpu_blocks=4))


def test_default_block_count_follows_the_kv_cache_space() -> None:
    e = MockerEngine(MockerEngineArgs(kv_cache_space_gib=1), profile=flat_profile())
    assert e.num_blocks == 2**30 // (1000 * BS)


# -- simulated KV transfer (disaggregated prefill) ------------------------------------------

async def disagg_pair(**decode_kw: Any) -> tuple[MockerEngine, MockerEngine, KvTransferRegistry]:
    registry = KvTransferRegistry()
    producer = make(registry=registry, **opts(speed=100.0, engine_id="P"))
    consumer = make(registry=registry, **opts(engine_id="D", **decode_kw))
    await producer.start()
    await consumer.start()
    return producer, consumer, registry


async def test_remote_prefill_hand_off() -> None:
    # 64 prompt tokens x 1000 bytes at 0.001 GB/s = 64 ms on the decode side
    producer, consumer, _ = await disagg_pair(kv_transfer_bandwidth_gbps=0.001, speed=1.0)
    transfers: list[tuple[int, float]] = []
    consumer.observe_kv_transfers(lambda n, s: transfers.append((n, s)))
    try:
        p = prompt(64)
        outs = await collect(producer.generate(
            "req-prefill", p, SamplingSpec(max_tokens=1),
            kv_transfer_params={"do_remote_decode": True}))
        params = outs[-1].kv_transfer_params
        assert params is not None and outs[-1].finish_reason == "length"
        assert params["remote_engine_id"] == "P" and params["remote_request_id"] == "req-prefill"
        assert params["remote_num_tokens"] == 64
        assert params["remote_block_hashes"] == BlockHasher(BS).block_hashes(p)
        assert producer.load().kv_blocks_used == 4  # held for the decode side

        began = time.monotonic()
        stamps: list[float] = []
        got: list[EngineOutput] = []
        async for o in consumer.generate("req", p, SamplingSpec(max_tokens=3),
                                         kv_transfer_params=params):
            stamps.append(time.monotonic() - began)
            got.append(o)
        assert len(toks(got)) == 3 and got[0].num_cached_tokens == 64
        assert stamps[0] >= 0.064  # waited for the transfer
        ((nbytes, seconds),) = transfers
        assert nbytes == 64_000 and seconds == pytest.approx(0.064)
        assert producer.load().kv_blocks_used == 0  # the consumer told the producer
        assert consumer.load().prefix_cache_queries == 64
    finally:
        await consumer.shutdown()
        await producer.shutdown()


async def test_producer_lease_frees_blocks_nobody_fetches() -> None:
    registry = KvTransferRegistry()
    producer = make(registry=registry, **opts(speed=1000.0, kv_lease_seconds=30.0))
    await producer.start()
    try:
        await collect(producer.generate("x", prompt(40), SamplingSpec(max_tokens=1),
                                        kv_transfer_params={"do_remote_decode": True}))
        assert producer.load().kv_blocks_used == 3
        await until(lambda: not producer.load().kv_blocks_used)  # 30 s / speed 1000
        assert not producer.release_transfer("x")
    finally:
        await producer.shutdown()


async def test_consumer_in_another_process_leaves_the_producer_to_its_lease() -> None:
    producer, _, _ = await disagg_pair()
    elsewhere = make(registry=KvTransferRegistry(), speed=1000.0)  # does not know "P"
    await elsewhere.start()
    try:
        outs = await collect(producer.generate(
            "x", prompt(40), SamplingSpec(max_tokens=1),
            kv_transfer_params={"do_remote_decode": True}))
        params = outs[-1].kv_transfer_params
        got = await collect(elsewhere.generate("y", prompt(40), SamplingSpec(max_tokens=2),
                                               kv_transfer_params=params))
        assert len(toks(got)) == 2
        assert producer.load().kv_blocks_used == 3  # still held: nobody told it
    finally:
        await elsewhere.shutdown()
        await producer.shutdown()


async def test_aborting_a_waiting_decode_releases_the_producer() -> None:
    producer, consumer, _ = await disagg_pair(kv_transfer_bandwidth_gbps=1e-6, speed=1.0)
    try:
        outs = await collect(producer.generate(
            "x", prompt(40), SamplingSpec(max_tokens=1),
            kv_transfer_params={"do_remote_decode": True}))
        stream = consumer.generate("y", prompt(40), SamplingSpec(max_tokens=2),
                                   kv_transfer_params=outs[-1].kv_transfer_params)
        waiter = asyncio.create_task(collect(stream))
        await until(lambda: consumer.load().waiting == 1)
        await consumer.abort("y")
        got = await waiter
        assert got[-1].finish_reason == "abort"
        await until(lambda: not producer.load().kv_blocks_used)
        assert consumer.load().kv_blocks_used == 0
    finally:
        await consumer.shutdown()
        await producer.shutdown()


async def test_a_request_to_an_idle_engine_starts_when_it_arrives() -> None:
    e = make(flat_profile(prefill_s=0.05, decode_s=0.01))
    await e.start()
    try:
        await collect(e.generate("a", prompt(20), SamplingSpec(max_tokens=1)))
        await asyncio.sleep(0.02)  # idle for less than the catch-up window
        began = time.monotonic()
        outs = e.generate("b", prompt(20, 500), SamplingSpec(max_tokens=1))
        await anext(outs)
        assert time.monotonic() - began >= 0.05 - 1e-3  # not shortened by the idle gap
        await outs.aclose()
    finally:
        await e.shutdown()


@pytest.mark.parametrize("policy,order", [("priority", ["a", "c", "b"]),
                                          ("fcfs", ["a", "b", "c"])])
async def test_the_scheduling_policy_serves_waiting_requests_by_priority(
        policy: str, order: list[str]) -> None:
    e = make(**opts(max_num_seqs=1, scheduling_policy=policy))
    await e.start()
    done: list[str] = []

    async def run(rid: str, base: int, priority: int, max_tokens: int = 3) -> None:
        await collect(e.generate(rid, prompt(20, base), SamplingSpec(max_tokens=max_tokens,
                                                                     priority=priority)))
        done.append(rid)

    try:  # a runs for ~30 steps while b, then c, arrive behind it
        tasks = [asyncio.create_task(run("a", 100, 10, max_tokens=30))]
        await until(lambda: e.scheduler.num_running == 1)
        tasks.append(asyncio.create_task(run("b", 300, 10)))
        await until(lambda: len(e.scheduler.waiting) == 1)
        tasks.append(asyncio.create_task(run("c", 500, 0)))
        await asyncio.gather(*tasks)
        assert done == order
    finally:
        await e.shutdown()
