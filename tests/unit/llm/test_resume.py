"""Frontend-level migration over fake Processors that detokenize a deterministic model."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from dynagraph.errors import InstanceUnavailable, StreamBroken
from dynagraph.llm.migration import Attempt, MigrationExhausted
from dynagraph.llm.protocol import OpenAIRequestEnvelope, TextChunk
from dynagraph.llm.resume import resuming
from tests.support.poll import collect

ANSWER = list(range(100, 120))  # the "model's" completion token ids
ENVELOPE = OpenAIRequestEnvelope(request_id="r", endpoint="completion", body={})


class Processors:
    """Processors 1..k; ``die_after[p] = n``: Processor ``p`` breaks after n chunks."""

    def __init__(self, k: int, die_after: dict[int, int] | None = None, *,
                 plain: bool = True, error: Exception | None = None) -> None:
        self.ids = list(range(1, k + 1))
        self.die_after = dict(die_after or {})
        self.plain = plain
        self.error = error or StreamBroken("connection reset")
        self.calls: list[tuple[int, OpenAIRequestEnvelope]] = []

    async def open(self, envelope: OpenAIRequestEnvelope, attempt: Attempt
                   ) -> AsyncIterator[TextChunk]:
        p = attempt.allowed(self.ids)[0]
        attempt.worker = p
        self.calls.append((p, envelope))
        done = len(envelope.resume.token_ids) if envelope.resume is not None else 0
        for n, tok in enumerate(ANSWER[done:]):
            if self.die_after.get(p) == n:
                self.die_after.pop(p)
                raise self.error
            count = done + n + 1
            yield TextChunk(text=f"<{tok}>", completion_tokens=count, prompt_tokens=7,
                            finish_reason="length" if count == len(ANSWER) else None,
                            token_ids=[tok] if self.plain else None)


def text(chunks: list[TextChunk]) -> str:
    return "".join(c.text for c in chunks)


async def test_an_unbroken_stream_passes_through() -> None:
    ps = Processors(2)
    chunks = await collect(resuming(ENVELOPE, ps.open, limit=3))
    assert text(chunks) == "".join(f"<{t}>" for t in ANSWER) and len(ps.calls) == 1


@pytest.mark.parametrize("error", [StreamBroken("reset"), InstanceUnavailable("refused")])
async def test_a_dead_processor_hands_over_what_the_client_has(error: Exception) -> None:
    ps = Processors(2, die_after={1: 5}, error=error)
    migrated: list[tuple[int | None, str]] = []
    chunks = await collect(resuming(ENVELOPE, ps.open, limit=3,
                                    on_migrate=lambda p, e: migrated.append((p, str(e)))))
    assert text(chunks) == "".join(f"<{t}>" for t in ANSWER)  # no gap, no duplicate
    assert [c.completion_tokens for c in chunks] == list(range(1, len(ANSWER) + 1))
    assert [p for p, _ in ps.calls] == [1, 2] and migrated == [(1, str(error))]
    resume = ps.calls[1][1].resume
    assert resume is not None and resume.token_ids == ANSWER[:5] and resume.prompt_tokens == 7


async def test_a_failure_before_any_chunk_sends_the_request_again_as_it_was() -> None:
    ps = Processors(2, die_after={1: 0})
    chunks = await collect(resuming(ENVELOPE, ps.open, limit=3))
    assert len(chunks) == len(ANSWER) and ps.calls[1][1].resume is None


async def test_the_limit_and_non_plain_requests_end_in_an_error_never_a_short_answer() -> None:
    ps = Processors(3, die_after={1: 2, 2: 2, 3: 2})
    got: list[TextChunk] = []
    with pytest.raises(MigrationExhausted, match="failed 3 times \\(migration-limit 2\\)"):
        async for c in resuming(ENVELOPE, ps.open, limit=2):
            got.append(c)
    assert text(got) == "".join(f"<{t}>" for t in ANSWER[:6])
    with pytest.raises(MigrationExhausted, match="only a plain request"):
        await collect(resuming(ENVELOPE, Processors(2, {1: 2}, plain=False).open, limit=3))


async def test_request_errors_are_not_migrated() -> None:
    from dynagraph.errors import InvalidRequest

    ps = Processors(2, die_after={1: 1}, error=InvalidRequest("bad", param="x"))
    with pytest.raises(InvalidRequest):
        await collect(resuming(ENVELOPE, ps.open, limit=3))
    assert len(ps.calls) == 1
