"""Processor: a request resumed from another Processor's chunks (``envelope.resume``)
continues exactly where the uninterrupted request would have gone on."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from components.processor import Processor, ProcessorConfig
from components.worker import VllmWorker
from dynagraph.errors import InvalidRequest
from dynagraph.llm.protocol import (
    CompletionRequest,
    OpenAIRequestEnvelope,
    PreprocessedRequest,
    Resume,
    TextChunk,
)
from dynagraph.sdk.testing import in_memory_client
from tests.support.poll import collect


def next_token(context: list[int]) -> int:
    """The fake model's greedy choice: a function of the whole context (ids 3..402)."""
    return 3 + (sum(context) * 31 + len(context)) % 400


class Worker:
    def __init__(self) -> None:
        self.seen: list[PreprocessedRequest] = []

    async def generate(self, wire: Any, instance_id: int) -> AsyncIterator[Any]:
        req = msgspec.convert(wire, PreprocessedRequest)
        self.seen.append(req)
        context = list(req.token_ids)
        for i in range(req.sampling.max_tokens):
            context.append(next_token(context))
            last = i == req.sampling.max_tokens - 1
            yield {"token_ids": [context[-1]], "finish_reason": "length" if last else None,
                   **({"prompt_tokens": len(req.token_ids), "cached_tokens": 2} if i == 0
                      else {})}


@pytest.fixture
def processor(tiny_tokenizer_dir: Path) -> tuple[Processor, Worker]:
    worker = Worker()
    config = ProcessorConfig(model=str(tiny_tokenizer_dir), served_model_name="tiny")
    client = in_memory_client(VllmWorker, {"generate": worker.generate}, instance_ids=[7])
    return Processor(config, worker=client), worker


def envelope(resume: Resume | None = None, **body: Any) -> OpenAIRequestEnvelope:
    request = CompletionRequest.model_validate(
        {"model": "tiny", "prompt": "hello there", "max_tokens": 24, "temperature": 0, **body})
    env = OpenAIRequestEnvelope.wrap(request, "r1")
    return msgspec.structs.replace(env, resume=resume)


@pytest.mark.parametrize("cut", [1, 4, 9])
async def test_a_resumed_request_goes_on_where_the_first_processor_stopped(
        processor: tuple[Processor, Worker], cut: int) -> None:
    p, worker = processor
    whole: list[TextChunk] = await collect(p.generate(envelope()))
    sent = whole[:cut]
    resume = Resume(token_ids=[t for c in sent for t in c.token_ids or []],
                    prompt_tokens=sent[-1].prompt_tokens, cached_tokens=sent[-1].cached_tokens)
    rest: list[TextChunk] = await collect(p.generate(envelope(resume)))
    assert "".join(c.text for c in sent + rest) == "".join(c.text for c in whole)
    last, first = rest[-1], whole[-1]
    assert (last.finish_reason, last.completion_tokens, last.prompt_tokens,
            last.cached_tokens) == (first.finish_reason, first.completion_tokens,
                                    first.prompt_tokens, first.cached_tokens)
    # the worker was asked for the continuation: the prompt plus what the client has
    cont = worker.seen[-1]
    assert cont.token_ids == worker.seen[0].token_ids + resume.token_ids
    assert cont.sampling.max_tokens == 24 - len(resume.token_ids)
    assert cont.request_id != worker.seen[0].request_id


async def test_only_plain_requests_resume(processor: tuple[Processor, Worker]) -> None:
    p, _ = processor
    with pytest.raises(InvalidRequest, match="only a plain request") as info:
        await collect(p.generate(envelope(Resume(token_ids=[5], prompt_tokens=3), prompt=["a", "b"])))
    assert info.value.param == "resume"
