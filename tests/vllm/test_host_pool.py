"""A real vLLM engine with a small cache and the host KV pool (``kv-offload-gib``).

A prefix the engine evicted comes back from the pool: the engine's load counts the
pool's hits, the relay publishes the pooled blocks as their own tier, and the greedy
tokens equal those of the same prompt served from the engine's own prefix cache (both
attend to the very same KV bytes and compute only the prompt's tail).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from dynagraph.errors import ConfigError
from dynagraph.llm.engines import SamplingSpec
from dynagraph.llm.engines.vllm.args import VllmEngineArgs
from dynagraph.llm.engines.vllm.engine import VllmEngine
from dynagraph.llm.kv.events.relay import KvEventRelay
from dynagraph.llm.kv.offload.tier_trim import TierTrimmer
from dynagraph.llm.router.hashing import BlockHasher
from tests.vllm.conftest import TEST_BLOCK_SIZE, in_process_model

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

ENGINE_BLOCKS = 16
PROMPT_BLOCKS = 6
HASHER = BlockHasher(TEST_BLOCK_SIZE)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def pooled_engine(model_dir: Path) -> AsyncIterator[tuple[VllmEngine, KvEventRelay]]:
    relay = KvEventRelay(hasher=HASHER)
    engine = VllmEngine(VllmEngineArgs(
        model=str(model_dir), block_size=TEST_BLOCK_SIZE, max_model_len=(ENGINE_BLOCKS - 1) * TEST_BLOCK_SIZE, max_num_seqs=2,
        num_gpu_blocks_override=ENGINE_BLOCKS, kv_offload_gib=0.05,
        kv_events_endpoint=relay.bind(), kv_events_topic="pool-test"))
    await relay.start()
    try:
        with in_process_model():
            await engine.start()
        yield engine, relay
    finally:
        await engine.shutdown()
        await relay.close()


def prompt(tag: int) -> list[int]:
    return [7 + (tag * 131 + i * 17) % 1900 for i in range(PROMPT_BLOCKS * TEST_BLOCK_SIZE + 5)]


async def greedy(engine: VllmEngine, rid: str, tokens: list[int]) -> list[int]:
    out: list[int] = []
    async for step in engine.generate(rid, tokens, SamplingSpec(temperature=0.0, max_tokens=8,
                                                                ignore_eos=True)):
        out += step.token_ids
    return out


def pool_regions() -> list[Path]:
    return list(Path("/dev/shm").glob("vllm_offload_*"))


async def until(check: object, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


@pytest.mark.asyncio(loop_scope="session")
async def test_an_evicted_prefix_is_loaded_from_the_pool(
        pooled_engine: tuple[VllmEngine, KvEventRelay]) -> None:
    engine, relay = pooled_engine
    a = prompt(1)
    hashes = HASHER.block_hashes(a)
    assert len(hashes) == PROMPT_BLOCKS
    await greedy(engine, "a-1", a)
    from_engine = await greedy(engine, "a-2", a)  # the engine's own prefix cache
    await until(lambda: all(h in relay.pooled for h in hashes))
    for tag in (2, 3, 4):  # 3 x 6 blocks through a 16-block cache evict a's
        await greedy(engine, f"fill-{tag}", prompt(tag))
    await until(lambda: not any(h in relay.blocks for h in hashes))
    hits_before = engine.load().kv_pool_hit_tokens
    from_pool = await greedy(engine, "a-3", a)
    assert from_pool == from_engine
    await until(lambda: engine.load().kv_pool_hit_tokens > hits_before)
    load = engine.load()
    # every full block but the last is loaded (vLLM computes at least the last token)
    assert load.kv_pool_hit_tokens - hits_before >= (PROMPT_BLOCKS - 1) * TEST_BLOCK_SIZE
    assert load.kv_pool_loaded_bytes > 0 and load.kv_pool_stored_bytes > 0


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("codec, passes", [
    ("int8", True), ("tests.support.bad_codec:SignOnly", False)])
async def test_the_quality_guard_passes_int8_and_refuses_a_bad_codec(
        model_dir: Path, codec: str, passes: bool) -> None:
    engine = VllmEngine(VllmEngineArgs(
        model=str(model_dir), block_size=TEST_BLOCK_SIZE, max_model_len=1024, max_num_seqs=2,
        kv_offload_gib=0.05, kv_compression=codec))
    with in_process_model():
        if not passes:
            with pytest.raises(ConfigError, match="quality guard refused.*SignOnly.*divergence"):
                await engine.start()
            assert not engine.started
            return
        await engine.start()
    try:
        report = engine.guard_report
        assert report.agreement >= 0.75 and 0 < report.divergence <= 0.05
        assert report.restored_tokens > 0
    finally:
        await engine.shutdown()


@pytest.mark.asyncio(loop_scope="session")
@pytest.mark.parametrize("codec", ["none", "int8"])
async def test_a_second_worker_loads_a_prefix_the_first_left_in_the_shared_tier(
        model_dir: Path, tmp_path: Path, codec: str) -> None:
    """``kv-offload-dir``: worker A's pool writes its blocks through to the directory;
    worker B (its own engine and pool, same directory) finds them there, loads them
    instead of computing them, and generates the same greedy tokens. With a codec the
    blocks are stored, and read back, compressed."""
    def tiered(events: str | None = None) -> VllmEngine:
        return VllmEngine(VllmEngineArgs(
            model=str(model_dir), block_size=TEST_BLOCK_SIZE, max_model_len=1024,
            max_num_seqs=2, kv_offload_gib=0.01, kv_offload_dir=str(tmp_path),
            kv_compression=codec, kv_events_endpoint=events, kv_events_topic="tier-test"))

    relay = KvEventRelay(hasher=HASHER)
    a, b = tiered(relay.bind()), tiered()
    await relay.start()
    try:
        with in_process_model():
            await a.start()
            await b.start()
        tokens = prompt(7)
        from_a = await greedy(a, "tier-a", tokens)
        assert a.load().kv_tier_hit_tokens == 0
        await until(lambda: len(list(tmp_path.rglob("*.bin"))) >= PROMPT_BLOCKS)
        sizes = {f.stat().st_size for f in (tmp_path / codec).rglob("*.bin")}
        raw = 4 * 2 * TEST_BLOCK_SIZE * 2 * 64 * 2  # layers x K,V x tokens x heads x dim x bf16
        assert sizes == {raw} if codec == "none" else max(sizes) < 0.6 * raw, sizes
        # A's relay publishes what A wrote to the tier, for the Router (medium STORAGE)
        await until(lambda: all(h in relay.tiered for h in HASHER.block_hashes(tokens)))
        from_b = await greedy(b, "tier-b", tokens)
        assert from_b == from_a
        await until(lambda: b.load().kv_tier_hit_tokens > 0)
        load = b.load()
        assert load.kv_tier_hit_tokens >= (PROMPT_BLOCKS - 1) * TEST_BLOCK_SIZE
        assert load.kv_pool_hit_tokens >= load.kv_tier_hit_tokens
        assert load.kv_pool_loaded_bytes > 0
    finally:
        await a.shutdown()
        await b.shutdown()
        await relay.close()
    assert not pool_regions()  # the pools' shared regions went with them


def tier_files(root: Path) -> list[Path]:
    return list(root.rglob("*.bin"))


def cut_short(root: Path) -> None:
    for f in tier_files(root):
        f.write_bytes(f.read_bytes()[:100])


@pytest.mark.asyncio(loop_scope="session")
async def test_tier_files_cut_short_or_trimmed_away_are_computed_instead(
        model_dir: Path, tmp_path: Path) -> None:
    """A tier file that cannot be read after the lookup found it (cut short here; a
    file a trimmer or an operator deletes meanwhile fails the same way) and one trimmed
    away (``kv-offload-dir-gib``) both cost worker B a recompute, never the request:
    its greedy tokens equal A's."""
    def tiered() -> VllmEngine:
        return VllmEngine(VllmEngineArgs(
            model=str(model_dir), block_size=TEST_BLOCK_SIZE, max_model_len=1024,
            max_num_seqs=2, kv_offload_gib=0.01, kv_offload_dir=str(tmp_path)))

    a, b = tiered(), tiered()
    try:
        with in_process_model():
            await a.start()
            await b.start()
        cut = prompt(11)
        from_a = await greedy(a, "cut-a", cut)
        await until(lambda: len(tier_files(tmp_path)) >= PROMPT_BLOCKS)
        cut_short(tmp_path)
        assert await greedy(b, "cut-b", cut) == from_a
        assert b.load().kv_tier_hit_tokens == 0

        trimmed = prompt(12)
        from_a = await greedy(a, "trim-a", trimmed)
        await until(lambda: len(tier_files(tmp_path)) >= PROMPT_BLOCKS)
        result = TierTrimmer(tmp_path, 1, low_water=1.0).trim()
        assert len(result.removed) >= PROMPT_BLOCKS and result.bytes_after == 0
        assert not tier_files(tmp_path)
        assert await greedy(b, "trim-b", trimmed) == from_a
        assert b.load().kv_tier_hit_tokens == 0
    finally:
        await a.shutdown()
        await b.shutdown()
    assert not pool_regions()
