"""The Engine protocol (``dynagraph.llm.engines.base``) as a contract every engine keeps.

``EngineContract`` holds the promises of the protocol's docstrings; each engine runs
them through a subclass whose ``subject`` fixture hands over a started engine: the echo
and mocker engines here (fast, no marker), vLLM's in ``tests/vllm/test_engine_contract.py``
(the session's engine, marker ``vllm``).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from dynagraph.errors import InvalidRequest, PromptTooLong
from dynagraph.llm.engines import Engine, EngineLoad, EngineOutput, SamplingSpec
from dynagraph.llm.engines.echo import EchoEngine
from dynagraph.llm.engines.mocker import KvTransferRegistry, MockerEngine, MockerEngineArgs
from tests.unit.llm.engines.mocker.test_engine import flat_profile

_ids = itertools.count()
LONG = 4000
"""max_tokens of a request that runs far longer than any wait below."""


@dataclass
class Subject:
    """A started engine under contract and what the contract needs to know of it."""

    engine: Any
    max_model_len: int
    samples_stop_tokens: bool = True
    """False for an engine that never samples a request's stop tokens (the mocker): its
    streams end by length, and the stop test checks only that."""
    kv_blocks: bool = True
    """Whether ``load()`` counts KV blocks (the echo engine has none)."""


def rid() -> str:
    return f"contract-{next(_ids)}"


def prompt(n: int, salt: int = 0) -> list[int]:
    """``n`` token ids that start with BOS (0) and differ per ``salt``."""
    return [0] + [5 + (salt * 7919 + i * 31) % 2000 for i in range(n - 1)]


def tokens(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


async def collect(engine: Engine, ids: list[int], spec: SamplingSpec,
                  request_id: str | None = None) -> list[EngineOutput]:
    async with asyncio.timeout(60):
        return [o async for o in engine.generate(request_id or rid(), ids, spec)]


async def until_load(engine: Engine, pred: Callable[[EngineLoad], bool],
                     within: float = 2.0) -> EngineLoad:
    async with asyncio.timeout(within):
        while not pred(load := engine.load()):  # noqa: ASYNC110 - the engine's own state
            await asyncio.sleep(0.01)
    return load


def greedy(n: int, **kw: Any) -> SamplingSpec:
    return SamplingSpec(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


class EngineContract:
    """The promises of ``base.Engine``; a subclass provides the ``subject`` fixture."""

    def test_is_an_engine(self, subject: Subject) -> None:
        assert isinstance(subject.engine, Engine)
        assert isinstance(subject.engine.load(), EngineLoad)

    async def test_streams_token_deltas_and_finishes_once(self, subject: Subject) -> None:
        ids = prompt(17, salt=1)
        outs = await collect(subject.engine, ids, greedy(5))
        assert len(outs) >= 2  # deltas per step, not one output at the end
        assert all(isinstance(o, EngineOutput) and o.index == 0 for o in outs)
        assert [o.finish_reason for o in outs[:-1]] == [None] * (len(outs) - 1)
        assert outs[-1].finish_reason == "length"
        assert all(o.num_prompt_tokens == len(ids) for o in outs)
        assert all(o.kv_transfer_params is None and o.logprobs is None for o in outs)

    @pytest.mark.parametrize("n", [1, 9])
    async def test_max_tokens_is_exact_with_ignore_eos(self, subject: Subject, n: int) -> None:
        outs = await collect(subject.engine, prompt(20, salt=2), greedy(n))
        assert len(tokens(outs)) == n and outs[-1].finish_reason == "length"

    async def test_greedy_is_deterministic(self, subject: Subject) -> None:
        ids = prompt(30, salt=3)
        first = tokens(await collect(subject.engine, ids, greedy(12)))
        assert first == tokens(await collect(subject.engine, ids, greedy(12)))

    async def test_stop_token_ids_end_the_stream(self, subject: Subject) -> None:
        ids = prompt(30, salt=4)
        free = tokens(await collect(subject.engine, ids, greedy(12)))
        stop = free[3]
        outs = await collect(subject.engine, ids, greedy(12, stop_token_ids=[stop]))
        got = tokens(outs)
        if subject.samples_stop_tokens:
            cut = free.index(stop)
            assert got == free[: cut + 1]  # the stop token itself is reported
            assert outs[-1].finish_reason == "stop"
        else:
            assert stop not in got and len(got) == 12 and outs[-1].finish_reason == "length"

    async def test_min_tokens_holds_off_a_stop(self, subject: Subject) -> None:
        ids = prompt(30, salt=5)
        free = tokens(await collect(subject.engine, ids, greedy(12)))
        stop = free[0]
        outs = await collect(subject.engine, ids, greedy(12, min_tokens=4,
                                                             stop_token_ids=[stop]))
        got = tokens(outs)
        if not subject.samples_stop_tokens:  # its stream runs to its length regardless
            assert stop not in got and len(got) == 12 and outs[-1].finish_reason == "length"
            return
        # the stream does not end before 4 tokens (vLLM masks the stop token until then,
        # so its first tokens may differ from the free run's; the echo engine emits it)
        assert len(got) >= 4
        assert outs[-1].finish_reason in ("stop", "length")
        assert (outs[-1].finish_reason == "stop") == (got[-1] == stop and len(got) > 4)

    async def test_refuses_an_empty_or_too_long_prompt(self, subject: Subject) -> None:
        with pytest.raises(InvalidRequest):
            await collect(subject.engine, [], greedy(2))
        with pytest.raises(PromptTooLong):
            await collect(subject.engine, prompt(subject.max_model_len, salt=6), greedy(2))

    @pytest.mark.parametrize("field", ["n", "logprobs"])
    async def test_honours_a_field_or_refuses_it_by_name(self, subject: Subject,
                                                        field: str) -> None:
        """"An engine honours every field or refuses the request with InvalidRequest
        naming the field; it never ignores one." """
        spec = (SamplingSpec(temperature=1.0, seed=7, max_tokens=4, ignore_eos=True, n=2)
                if field == "n" else greedy(4, logprobs=1))
        try:
            outs = await collect(subject.engine, prompt(12, salt=7), spec)
        except InvalidRequest as exc:
            assert exc.param == field, exc
            return
        if field == "n":
            assert sorted(o.index for o in outs if o.finish_reason) == [0, 1]
            assert all(len([t for o in outs if o.index == i for t in o.token_ids]) == 4
                       for i in (0, 1))
        else:
            assert all(o.logprobs is not None and len(o.logprobs) == len(o.token_ids)
                       for o in outs if o.token_ids)

    async def test_load_counts_the_request_in_flight(self, subject: Subject) -> None:
        engine = subject.engine
        stream = engine.generate(rid(), prompt(40, salt=8), greedy(LONG))
        try:
            await anext(stream)
            load = engine.load()
            assert load.running == 1
            assert not subject.kv_blocks or load.kv_blocks_used > 0
        finally:
            await stream.aclose()

    async def test_closing_the_iterator_aborts_and_frees_the_request(
            self, subject: Subject) -> None:
        engine = subject.engine
        stream = engine.generate(rid(), prompt(40, salt=9), greedy(LONG))
        async for _ in stream:
            break
        await stream.aclose()  # LONG tokens would take far longer than the wait below
        load = await until_load(engine, lambda ld: ld.running == 0 and ld.kv_blocks_used == 0)
        assert load.waiting == 0

    async def test_abort_from_another_task_ends_the_stream(self, subject: Subject) -> None:
        engine = subject.engine
        request_id = rid()
        outs: list[EngineOutput] = []

        async def consume() -> None:
            async for o in engine.generate(request_id, prompt(40, salt=10), greedy(LONG)):
                outs.append(o)

        task = asyncio.create_task(consume())
        try:
            async with asyncio.timeout(30):
                while not outs:  # noqa: ASYNC110 - the consumer task's progress
                    await asyncio.sleep(0.01)
            await engine.abort(request_id)
            await asyncio.wait_for(task, 5)
        finally:
            task.cancel()
        assert outs[-1].finish_reason == "abort" and len(tokens(outs)) < LONG
        await until_load(engine, lambda ld: ld.running == 0 and ld.kv_blocks_used == 0)
        await engine.abort(request_id)  # finished: ignored
        await engine.abort("never-seen")  # unknown: ignored


class TestEchoEngine(EngineContract):
    @pytest.fixture
    async def subject(self) -> AsyncIterator[Subject]:
        engine = EchoEngine(max_model_len=100_000, step_delay_s=0.002)
        await engine.start()
        yield Subject(engine, engine.max_model_len, kv_blocks=False)
        await engine.shutdown()


class TestMockerEngine(EngineContract):
    @pytest.fixture
    async def subject(self) -> AsyncIterator[Subject]:
        args = MockerEngineArgs.model_validate({"num-gpu-blocks": 1024, "max-model-len": 8192})
        engine = MockerEngine(args, profile=flat_profile(prefill_s=0.002, decode_s=0.002),
                              registry=KvTransferRegistry())
        await engine.start()
        yield Subject(engine, engine.max_model_len, samples_stop_tokens=False)
        await engine.shutdown()
