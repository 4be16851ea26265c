"""VllmEngine against a real vLLM engine core running the tiny local model."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from dynagraph.errors import InvalidRequest, PromptTooLong
from dynagraph.llm.engines import Engine, EngineLoad, EngineOutput, SamplingSpec
from dynagraph.llm.engines.vllm.engine import VllmEngine
from tests.support.memory import anon_huge_kib
from tests.vllm.conftest import TEST_BLOCK_SIZE

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

GREEDY = SamplingSpec(temperature=0.0, max_tokens=24)
_ids = itertools.count()


def rid(prefix: str = "t") -> str:
    return f"{prefix}-{next(_ids)}"


def prompt(n: int, salt: int = 0) -> list[int]:
    """``n`` token ids that start with BOS and differ per ``salt``."""
    return [0] + [5 + (salt * 7919 + i * 31) % 2000 for i in range(n - 1)]


async def collect(
    engine: Engine, ids: list[int], sampling: SamplingSpec, request_id: str | None = None
) -> list[EngineOutput]:
    async with asyncio.timeout(60):
        return [o async for o in engine.generate(request_id or rid(), ids, sampling)]


def tokens(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


async def wait_for_load(
    engine: Engine, pred: Callable[[EngineLoad], bool], within_s: float = 10.0
) -> EngineLoad:
    deadline = time.monotonic() + within_s
    while True:
        load = engine.load()
        if pred(load):
            return load
        if time.monotonic() > deadline:
            raise AssertionError(f"load never matched within {within_s}s; last: {load}")
        await asyncio.sleep(0.02)


def test_is_an_engine(vllm_engine: VllmEngine) -> None:
    assert isinstance(vllm_engine, Engine)
    assert vllm_engine.max_model_len == 8192


async def test_greedy_is_deterministic(vllm_engine: VllmEngine) -> None:
    ids = prompt(40)
    first = await collect(vllm_engine, ids, GREEDY)
    second = await collect(vllm_engine, ids, GREEDY)
    assert tokens(first) == tokens(second)
    assert first[-1].finish_reason in ("stop", "length")
    assert all(o.finish_reason is None for o in first[:-1])


async def test_streams_deltas_with_prompt_counts(vllm_engine: VllmEngine) -> None:
    outs = await collect(
        vllm_engine,
        prompt(17, salt=1),
        GREEDY.model_copy(update={"max_tokens": 5, "ignore_eos": True}),
    )
    assert len(outs) >= 2  # one output per step, not one at the end
    assert all(o.num_prompt_tokens == 17 for o in outs)
    assert all(o.kv_transfer_params is None for o in outs)


@pytest.mark.parametrize("n", [1, 37])
async def test_max_tokens_with_ignore_eos_is_exact(vllm_engine: VllmEngine, n: int) -> None:
    spec = SamplingSpec(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = await collect(vllm_engine, prompt(20, salt=2), spec)
    assert len(tokens(outs)) == n
    assert outs[-1].finish_reason == "length"


async def test_sampling_with_seed_is_reproducible(vllm_engine: VllmEngine) -> None:
    spec = SamplingSpec(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    ids = prompt(30, salt=3)
    first = tokens(await collect(vllm_engine, ids, spec))
    assert first == tokens(await collect(vllm_engine, ids, spec))
    # the control: another seed samples another text, so the seed is what repeats it
    other = tokens(await collect(vllm_engine, ids, spec.model_copy(update={"seed": 4321})))
    assert other != first


async def test_stop_token_ids_end_the_stream(vllm_engine: VllmEngine) -> None:
    ids = prompt(30, salt=4)
    free = tokens(
        await collect(
            vllm_engine, ids, SamplingSpec(temperature=0.0, max_tokens=12, ignore_eos=True)
        )
    )
    stop_at = free[3]
    cut = free.index(stop_at)  # first occurrence
    outs = await collect(
        vllm_engine,
        ids,
        SamplingSpec(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_at]),
    )
    assert outs[-1].finish_reason == "stop"
    assert tokens(outs) == free[: cut + 1]  # the stop token itself is reported


async def test_cancelling_the_consumer_aborts_and_frees_blocks(vllm_engine: VllmEngine) -> None:
    got_some = asyncio.Event()
    received: list[int] = []

    async def consume() -> None:
        spec = SamplingSpec(temperature=0.0, max_tokens=4000, ignore_eos=True)
        async for out in vllm_engine.generate(rid("cancel"), prompt(300, salt=5), spec):
            received.extend(out.token_ids)
            if len(received) >= 5:
                got_some.set()

    task = asyncio.create_task(consume())
    async with asyncio.timeout(60):
        await got_some.wait()
    busy = vllm_engine.load()
    assert busy.running == 1
    assert busy.kv_blocks_used >= 300 // TEST_BLOCK_SIZE
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    idle = await wait_for_load(vllm_engine, lambda ld: ld.running == 0 and ld.kv_blocks_used == 0)
    assert idle.waiting == 0
    assert len(received) < 4000


async def test_closing_the_iterator_aborts(vllm_engine: VllmEngine) -> None:
    spec = SamplingSpec(temperature=0.0, max_tokens=4000, ignore_eos=True)
    stream = vllm_engine.generate(rid("close"), prompt(100, salt=6), spec)
    async with asyncio.timeout(60):
        async for out in stream:
            if out.token_ids:
                break
    await stream.aclose()  # type: ignore[attr-defined]
    await wait_for_load(vllm_engine, lambda ld: ld.running == 0 and ld.kv_blocks_used == 0)


async def test_abort_by_id_ends_the_stream_with_abort(vllm_engine: VllmEngine) -> None:
    request_id = rid("abort")
    spec = SamplingSpec(temperature=0.0, max_tokens=4000, ignore_eos=True)
    outs: list[EngineOutput] = []
    async with asyncio.timeout(60):
        async for out in vllm_engine.generate(request_id, prompt(50, salt=7), spec):
            outs.append(out)
            if len(outs) == 3:
                await vllm_engine.abort(request_id)
    assert outs[-1].finish_reason == "abort"
    assert len(tokens(outs)) < 4000
    await wait_for_load(vllm_engine, lambda ld: ld.running == 0 and ld.kv_blocks_used == 0)
    await vllm_engine.abort("no-such-request")  # ignored


async def test_load_reports_running_requests_and_blocks(vllm_engine: VllmEngine) -> None:
    spec = SamplingSpec(temperature=0.0, max_tokens=200, ignore_eos=True)
    tasks = [
        asyncio.create_task(collect(vllm_engine, prompt(200, salt=10 + i), spec)) for i in range(3)
    ]
    busy = await wait_for_load(vllm_engine, lambda ld: ld.running + ld.waiting == 3, within_s=30)
    assert busy.kv_blocks_total > 0
    assert busy.kv_blocks_used >= 3 * (200 // TEST_BLOCK_SIZE)
    assert 0.0 < busy.kv_usage < 1.0
    async with asyncio.timeout(120):
        results = await asyncio.gather(*tasks)
    assert all(len(tokens(r)) == 200 for r in results)
    idle = await wait_for_load(vllm_engine, lambda ld: ld.running == 0)
    assert idle.kv_blocks_used == 0


async def test_prefix_cache_hits_rise_on_a_repeated_prompt(vllm_engine: VllmEngine) -> None:
    ids = prompt(700, salt=20)
    before = vllm_engine.load()
    first = await collect(vllm_engine, ids, GREEDY)
    second = await collect(vllm_engine, ids, GREEDY)
    assert first[-1].num_cached_tokens == 0
    full_blocks = (len(ids) - 1) // TEST_BLOCK_SIZE * TEST_BLOCK_SIZE
    assert second[-1].num_cached_tokens >= full_blocks - TEST_BLOCK_SIZE
    assert tokens(first) == tokens(second)
    after = await wait_for_load(
        vllm_engine, lambda ld: ld.prefix_cache_queries >= before.prefix_cache_queries + 2 * 700
    )
    assert after.prefix_cache_hits - before.prefix_cache_hits >= second[-1].num_cached_tokens


async def test_a_4k_token_prompt_works(vllm_engine: VllmEngine) -> None:
    outs = await collect(
        vllm_engine, prompt(4096, salt=30), GREEDY.model_copy(update={"max_tokens": 4})
    )
    assert outs[-1].num_prompt_tokens == 4096
    assert 1 <= len(tokens(outs)) <= 4


async def test_rejects_bad_prompts(vllm_engine: VllmEngine) -> None:
    with pytest.raises(PromptTooLong):
        await collect(vllm_engine, prompt(8192), GREEDY)
    with pytest.raises(InvalidRequest):
        await collect(vllm_engine, [], GREEDY)
    with pytest.raises(InvalidRequest):
        await collect(vllm_engine, [0, 999_999], GREEDY)  # outside the vocabulary


async def test_duplicate_request_id_in_flight_is_rejected(vllm_engine: VllmEngine) -> None:
    request_id = rid("dup")
    spec = SamplingSpec(temperature=0.0, max_tokens=4000, ignore_eos=True)
    stream = vllm_engine.generate(request_id, prompt(20, salt=40), spec)
    async with asyncio.timeout(60):
        await anext(stream)  # type: ignore[call-overload]
        with pytest.raises(InvalidRequest):
            await collect(vllm_engine, prompt(20), GREEDY, request_id=request_id)
    await stream.aclose()  # type: ignore[attr-defined]
    await wait_for_load(vllm_engine, lambda ld: ld.running == 0)


@pytest.mark.timeout(240)
def test_engine_processes_die_with_a_sigkilled_owner(model_dir: Path) -> None:
    """vLLM's engine core outlives a SIGKILLed parent unless the reaper ends it."""
    code = (
        "import asyncio, os, sys\n"
        "from dynagraph.llm.engines.vllm.args import VllmEngineArgs\n"
        "from dynagraph.llm.engines.vllm.engine import VllmEngine\n"
        "async def main():\n"
        f"    engine = VllmEngine(VllmEngineArgs(model={str(model_dir)!r}, block_size=32))\n"
        "    await engine.start()\n"
        "    print('PIDS', *engine._reaper.pids, flush=True)\n"
        "    await asyncio.sleep(120)\n"
        "if __name__ == '__main__':\n"
        "    asyncio.run(main())\n"
    )
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    owner = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    helpers: list[int] = []
    try:
        assert owner.stdout is not None
        for line in owner.stdout:  # vLLM logs to stdout too
            if line.startswith("PIDS"):
                helpers = [int(p) for p in line.split()[1:]]
                break
        assert helpers, "the engine reported no helper processes"
        os.kill(owner.pid, signal.SIGKILL)
        owner.wait(timeout=10)
        deadline = time.monotonic() + 30
        while any(_running(p) for p in helpers):
            assert time.monotonic() < deadline, f"vLLM helpers {helpers} outlived their owner"
            time.sleep(0.1)
    finally:
        for pid in [owner.pid, *helpers]:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_engine_kv_cache_is_not_in_huge_pages_by_default(vllm_engine: VllmEngine) -> None:
    """``huge-pages`` unset, no NIXL: the 1 GiB KV cache is in 4 KiB pages (huge ones
    took this engine 10 s to allocate here, and only a NIXL read gains from them; the
    NIXL graph's engines hold theirs in huge pages, ``tests/e2e_disagg``)."""
    pids = vllm_engine.engine_pids
    assert pids
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        thp_always = "[always]" in f.read()
    huge = sum(anon_huge_kib(pid) for pid in pids)
    assert thp_always or huge < 64 * 1024, f"{huge} KiB in huge pages"
