"""Mid-stream migration over fake workers that compute a deterministic "greedy model"."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from dynagraph.errors import InstanceUnavailable, InvalidRequest, Requeued, StreamBroken
from dynagraph.llm.migration import (
    MAX_REQUEUES,
    Attempt,
    MigrationExhausted,
    continuation,
    migrating,
)
from dynagraph.llm.protocol import LLMEngineOutput, PreprocessedRequest, SamplingParams
from tests.support.poll import collect


def next_token(context: list[int]) -> int:
    """The fake model's greedy choice: a function of the whole context."""
    return (sum(context) * 31 + len(context)) % 997


class Workers:
    """Workers 1..k; ``fail_after[w] = n``: worker ``w`` breaks after n tokens of a stream."""

    def __init__(self, k: int, fail_after: dict[int, int] | None = None,
                 error: Exception | None = None) -> None:
        self.ids = list(range(1, k + 1))
        self.fail_after = dict(fail_after or {})
        self.error = error or StreamBroken("connection reset")
        self.calls: list[tuple[int, PreprocessedRequest]] = []

    async def dispatch(self, req: PreprocessedRequest, attempt: Attempt
                       ) -> AsyncIterator[LLMEngineOutput]:
        w = attempt.allowed(self.ids)[0]
        attempt.worker = w
        self.calls.append((w, req))
        n = req.sampling.n if hasattr(req.sampling, "n") else 1
        for index in range(n):
            context = list(req.token_ids)  # greedy: every choice the same
            for i in range(req.sampling.max_tokens):
                if self.fail_after.get(w) == i:
                    self.fail_after.pop(w)  # a worker fails once
                    raise self.error
                tok = next_token(context)
                context.append(tok)
                last = i == req.sampling.max_tokens - 1
                out = LLMEngineOutput(token_ids=[tok], finish_reason="length" if last else None)
                if i == 0:
                    out.prompt_tokens, out.cached_tokens = len(req.token_ids), 3
                if n > 1:
                    out.index = index
                yield out
                await asyncio.sleep(0)


def request(max_tokens: int = 12, prompt: list[int] | None = None) -> PreprocessedRequest:
    return PreprocessedRequest(request_id="r1", token_ids=prompt or [5, 6, 7, 8],
                               sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                       min_tokens=4))


def tokens(outs: list[LLMEngineOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


async def test_an_unbroken_stream_passes_through() -> None:
    w = Workers(2)
    outs = await collect(migrating(request(), w.dispatch, limit=3))
    assert len(tokens(outs)) == 12 and [c[0] for c in w.calls] == [1]


@pytest.mark.parametrize("error", [StreamBroken("reset"), InstanceUnavailable("refused")])
async def test_a_broken_stream_continues_elsewhere_token_for_token(error: Exception) -> None:
    whole = tokens(await collect(migrating(request(), Workers(1).dispatch, limit=0)))
    w = Workers(2, fail_after={1: 5}, error=error)
    migrated: list[int | None] = []
    outs = await collect(migrating(request(), w.dispatch, limit=3,
                                   on_migrate=lambda wid, exc: migrated.append(wid)))
    assert tokens(outs) == whole  # no duplicate, no gap: greedy output unchanged
    assert [o.finish_reason for o in outs].count("length") == 1
    assert migrated == [1]
    (_, first), (second_worker, second) = w.calls
    assert second_worker == 2  # the failed worker is not asked again
    assert second.token_ids == first.token_ids + whole[:5]
    assert second.sampling.max_tokens == 7 and second.sampling.min_tokens == 0
    assert second.request_id == "r1-m1"
    assert [o.prompt_tokens for o in outs if o.prompt_tokens is not None] == [4]  # the original


async def test_a_failure_before_any_output_is_retried_too() -> None:
    w = Workers(2, fail_after={1: 0})
    outs = await collect(migrating(request(), w.dispatch, limit=3))
    assert len(tokens(outs)) == 12 and w.calls[1][1].token_ids == [5, 6, 7, 8]


async def test_a_request_handed_back_is_placed_again_without_counting_a_failure() -> None:
    w = Workers(2, fail_after={1: 0}, error=Requeued("a place is free elsewhere"))
    migrated: list[int | None] = []
    outs = await collect(migrating(request(), w.dispatch, limit=0,
                                   on_migrate=lambda wid, exc: migrated.append(wid)))
    assert len(tokens(outs)) == 12 and migrated == []
    # not a failure: the same worker may take it again (here it does: the fake asks 1)
    assert [(wid, r.request_id, r.token_ids) for wid, r in w.calls] == [
        (1, "r1", [5, 6, 7, 8]), (1, "r1-q1", [5, 6, 7, 8])]
    assert [o.prompt_tokens for o in outs if o.prompt_tokens is not None] == [4]


async def test_endless_hand_backs_end_as_a_failure() -> None:
    calls = 0

    async def handing_back(req: PreprocessedRequest, attempt: Attempt
                           ) -> AsyncIterator[LLMEngineOutput]:
        nonlocal calls
        calls += 1
        attempt.worker = 1
        raise Requeued("again")
        yield {}  # an async generator

    with pytest.raises(MigrationExhausted, match="Requeued"):
        await collect(migrating(request(), handing_back, limit=0))
    assert calls == MAX_REQUEUES + 1


async def test_the_limit_gives_a_clear_error_never_a_short_answer() -> None:
    w = Workers(3, fail_after={1: 2, 2: 3})
    got: list[LLMEngineOutput] = []
    with pytest.raises(MigrationExhausted, match="failed 2 times .migration-limit 1."):
        async for out in migrating(request(), w.dispatch, limit=1):
            got.append(out)
    assert len(tokens(got)) == 5  # what was sent before the error


async def test_request_errors_are_not_migrated() -> None:
    w = Workers(2, fail_after={1: 2}, error=InvalidRequest("bad", param="x"))
    with pytest.raises(InvalidRequest):
        await collect(migrating(request(), w.dispatch, limit=3))
    assert len(w.calls) == 1


def test_continuation_keeps_at_least_one_token_to_generate() -> None:
    c = continuation(request(max_tokens=3), [1, 2, 3], "m1")
    assert c.sampling.max_tokens == 1 and c.token_ids[-3:] == [1, 2, 3]


async def test_n_choices_continue_one_by_one_with_their_index() -> None:
    req = PreprocessedRequest(request_id="r1", token_ids=[5, 6, 7, 8],
                              sampling=SamplingParams(max_tokens=6, temperature=0.0, n=3))
    whole = await collect(migrating(req, Workers(1).dispatch, limit=0))
    w = Workers(2, fail_after={1: 2})  # breaks inside choice 0: choices 1 and 2 never began
    outs = await collect(migrating(req, w.dispatch, limit=3))

    def by_index(got: list[LLMEngineOutput]) -> dict[int, list[int]]:
        per: dict[int, list[int]] = {}
        for o in got:
            per.setdefault(o.index, []).extend(o.token_ids)
        return per

    assert by_index(outs) == by_index(whole)
    assert sum(o.finish_reason == "length" for o in outs) == 3
    continued = [r for _, r in w.calls[1:]]
    assert {r.sampling.n for r in continued} == {1} and len(continued) == 3


async def test_constrained_output_is_not_continued_elsewhere() -> None:
    from dynagraph.llm.protocol import StructuredOutputsSpec

    req = PreprocessedRequest(request_id="r1", token_ids=[5, 6, 7, 8], sampling=SamplingParams(
        max_tokens=6, temperature=0.0, structured_outputs=StructuredOutputsSpec(regex="a+")))
    with pytest.raises(MigrationExhausted, match="constrained output"):
        await collect(migrating(req, Workers(2, fail_after={1: 2}).dispatch, limit=3))


def test_failed_workers_are_avoided_while_another_is_left() -> None:
    at = Attempt()
    at.failed(1)
    assert at.allowed([1, 2, 3]) == [2, 3]
    at.failed(3)
    at.failed(2)
    # every one failed: the one that failed longest ago
    assert at.allowed([1, 2, 3]) == [1]
    at.failed(1)
    nxt = at.after()
    assert nxt.worker is None and nxt.allowed([1, 2, 3]) == [3] and nxt.allowed([1, 2]) == [2]


async def test_before_retry_runs_between_a_failure_and_the_next_try() -> None:
    """The only worker dies; while the request waits in ``before_retry`` its restart
    registers (a new id), and the request goes on there, not on the dead one again."""
    whole = tokens(await collect(migrating(request(), Workers(1).dispatch, limit=0)))
    w = Workers(1, fail_after={1: 5})
    waited: list[tuple[list[int], str]] = []

    async def before_retry(attempt: Attempt, failure: Exception) -> None:
        waited.append((list(attempt.failures), str(failure)))
        w.ids = [2]  # worker 1 left discovery; its restart is worker 2

    outs = await collect(migrating(request(), w.dispatch, limit=1, before_retry=before_retry))
    assert tokens(outs) == whole
    assert waited == [([1], "connection reset")]
    assert [c[0] for c in w.calls] == [1, 2]
