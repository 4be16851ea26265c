"""EchoEngine: the in-memory Engine used by component unit tests."""

from __future__ import annotations

import asyncio

import pytest

from dynagraph.errors import EngineError, InvalidRequest, PromptTooLong
from dynagraph.llm.engines import Engine, EngineOutput, SamplingSpec
from dynagraph.llm.engines.echo import EchoEngine


async def run(
    engine: Engine, prompt: list[int], spec: SamplingSpec, rid: str = "r"
) -> list[EngineOutput]:
    async with asyncio.timeout(5):
        return [o async for o in engine.generate(rid, prompt, spec)]


def toks(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


@pytest.fixture
async def engine() -> EchoEngine:
    e = EchoEngine(eos_token_ids=[3], max_model_len=64)
    await e.start()
    return e


def test_is_an_engine() -> None:
    assert isinstance(EchoEngine(), Engine)


async def test_echoes_until_max_tokens(engine: EchoEngine) -> None:
    outs = await run(engine, [10, 11, 12], SamplingSpec(max_tokens=5))
    assert toks(outs) == [10, 11, 12, 10, 11]
    assert [o.finish_reason for o in outs] == [None] * 4 + ["length"]
    assert all(o.num_prompt_tokens == 3 for o in outs)


async def test_eos_stop_and_ignore_eos(engine: EchoEngine) -> None:
    assert toks(await run(engine, [10, 3, 12], SamplingSpec(max_tokens=5))) == [10, 3]
    ignored = await run(engine, [10, 3, 12], SamplingSpec(max_tokens=5, ignore_eos=True))
    assert toks(ignored) == [10, 3, 12, 10, 3]
    stopped = await run(engine, [10, 11, 12], SamplingSpec(max_tokens=5, stop_token_ids=[12]))
    assert toks(stopped) == [10, 11, 12] and stopped[-1].finish_reason == "stop"
    late = await run(engine, [3, 11], SamplingSpec(max_tokens=5, min_tokens=2))
    assert toks(late) == [3, 11, 3]


async def test_context_limits_length(engine: EchoEngine) -> None:
    outs = await run(engine, list(range(10, 70)), SamplingSpec())
    assert len(toks(outs)) == 4 and outs[-1].finish_reason == "length"
    with pytest.raises(PromptTooLong):
        await run(engine, list(range(64)), SamplingSpec())
    with pytest.raises(InvalidRequest):
        await run(engine, [], SamplingSpec())


async def test_abort_and_load() -> None:
    engine = EchoEngine(step_delay_s=0.001)
    await engine.start()
    outs: list[EngineOutput] = []
    async with asyncio.timeout(5):
        async for out in engine.generate("a", [5], SamplingSpec(max_tokens=1000)):
            outs.append(out)
            assert engine.load().running == 1
            if len(outs) == 3:
                await engine.abort("a")
    assert outs[-1].finish_reason == "abort" and len(outs) == 4
    assert engine.load().running == 0


async def test_closing_the_stream_frees_the_request(engine: EchoEngine) -> None:
    stream = engine.generate("c", [5], SamplingSpec(max_tokens=100, ignore_eos=True))
    await anext(stream)  # type: ignore[call-overload]
    assert engine.load().running == 1
    await stream.aclose()  # type: ignore[attr-defined]
    assert engine.load().running == 0


async def test_records_kv_transfer_params_and_requires_start() -> None:
    engine = EchoEngine()
    with pytest.raises(EngineError):
        await run(engine, [1], SamplingSpec(max_tokens=1))
    await engine.start()
    async with asyncio.timeout(5):
        async for _ in engine.generate(
            "k", [1], SamplingSpec(max_tokens=1), kv_transfer_params={"x": 1}
        ):
            pass
    assert engine.kv_transfer_params_seen == [{"x": 1}]
    assert engine.requests_seen == ["k"]
