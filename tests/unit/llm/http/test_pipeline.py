"""The OpenAI path end to end in memory: HTTP app -> (wire) -> Preprocessor -> fake engine
-> detokenize_stream -> (wire) -> SSE, with a real (tiny) tokenizer. This is what the
Frontend and Processor components glue together over the request plane."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing

import pytest
from prometheus_client import CollectorRegistry

from dynagraph.llm.detokenize import detokenize_stream
from dynagraph.llm.http import create_app
from dynagraph.llm.http.asgi import App
from dynagraph.llm.preprocess import Preprocessor
from dynagraph.llm.protocol import (
    EngineFinishReason,
    LLMEngineOutput,
    OpenAIRequest,
    OpenAIRequestEnvelope,
    PreprocessedRequest,
    TextChunk,
)
from dynagraph.llm.tenants import TenantToken
from dynagraph.llm.tokenizer import Tokenizer

from .conftest import MODEL, OneModelBackend, client_for, sse_events

REPLY = "Café 日本 🙂🚀 ### END ### tail"


class LocalPipeline(OneModelBackend):
    """A Backend doing the Processor's job in-process; the engine 'generates' REPLY + EOS."""

    def __init__(self, tok: Tokenizer, max_model_len: int | None) -> None:
        self.tok = tok
        self.pre = Preprocessor(tok, max_model_len=max_model_len)
        self.engine_closed = asyncio.Event()
        self.seen: list[PreprocessedRequest] = []

    async def generate(self, request: OpenAIRequest, request_id: str,
                       tenant: TenantToken | None = None) -> AsyncIterator[TextChunk]:
        envelope = OpenAIRequestEnvelope.wrap(request, request_id).to_wire()
        env = OpenAIRequestEnvelope.from_wire(envelope)
        pre = PreprocessedRequest.from_wire(
            self.pre.preprocess(env.unwrap(), env.request_id).to_wire()
        )
        self.seen.append(pre)
        detok = self.pre.detokenizer(pre)
        async with aclosing(detokenize_stream(detok, self._engine(pre))) as chunks:
            async for chunk in chunks:
                yield TextChunk.from_wire(chunk.to_wire())

    async def _engine(self, pre: PreprocessedRequest) -> AsyncIterator[LLMEngineOutput]:
        ids = self.tok.encode(REPLY, add_special_tokens=False) + [pre.eos_token_ids[0]]
        try:
            for n, token_id in enumerate(ids, start=1):
                await asyncio.sleep(0)
                finish: EngineFinishReason | None = "stop" if n == len(ids) else None
                if finish is None and n >= pre.sampling.max_tokens:
                    finish = "length"
                out = LLMEngineOutput(
                    token_ids=[token_id],
                    finish_reason=finish,
                    prompt_tokens=len(pre.token_ids) if n == 1 else None,
                )
                yield out
                if finish:
                    return
        finally:
            self.engine_closed.set()


@pytest.fixture
def app_for(tok: Tokenizer) -> Callable[..., tuple[App, LocalPipeline]]:
    def make(max_model_len: int | None = 512) -> tuple[App, LocalPipeline]:
        backend = LocalPipeline(tok, max_model_len)
        app = create_app(
            backend,
            served_model_name=MODEL,
            max_model_len=max_model_len,
            registry=CollectorRegistry(),
        )
        return app, backend

    return make


def chat(**fields: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say 日本"}], **fields}


async def test_streamed_multibyte_reply(
    app_for: Callable[..., tuple[App, LocalPipeline]],
) -> None:
    app, backend = app_for()
    body = chat(stream=True, stream_options={"include_usage": True})
    async with client_for(app) as client:
        resp = await client.post("/v1/chat/completions", json=body)
    events = sse_events(resp.text)
    deltas = [e["choices"][0]["delta"].get("content", "") for e in events[:-2]]
    assert "".join(deltas) == REPLY
    assert all("\ufffd" not in d for d in deltas)
    assert events[-3]["choices"][0]["finish_reason"] == "stop"
    usage = events[-2]["usage"]
    n_reply = len(backend.tok.encode(REPLY, add_special_tokens=False)) + 1
    assert usage["completion_tokens"] == n_reply
    assert usage["prompt_tokens"] == len(backend.seen[0].token_ids)


async def test_stop_string_cuts_the_reply_and_the_engine(
    app_for: Callable[..., tuple[App, LocalPipeline]],
) -> None:
    app, backend = app_for()
    async with client_for(app) as client:
        resp = await client.post("/v1/chat/completions", json=chat(stop=["###"]))
    choice = resp.json()["choices"][0]
    assert choice["message"]["content"] == "Café 日本 🙂🚀 "
    assert choice["finish_reason"] == "stop"
    assert backend.engine_closed.is_set()


async def test_max_tokens_and_completions_endpoint(
    app_for: Callable[..., tuple[App, LocalPipeline]],
) -> None:
    app, backend = app_for()
    async with client_for(app) as client:
        resp = await client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3}
        )
    body = resp.json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 3
    ids = backend.tok.encode(REPLY, add_special_tokens=False)[:3]
    assert body["choices"][0]["text"] == backend.tok.decode(ids)


async def test_prompt_too_long_is_a_400(
    app_for: Callable[..., tuple[App, LocalPipeline]],
) -> None:
    app, _ = app_for(max_model_len=32)
    long_prompt = "word " * 50
    async with client_for(app) as client:
        unary = await client.post("/v1/completions", json={"model": MODEL, "prompt": long_prompt})
        stream = await client.post(
            "/v1/completions", json={"model": MODEL, "prompt": long_prompt, "stream": True}
        )
    for resp in (unary, stream):
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
