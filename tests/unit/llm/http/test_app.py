from __future__ import annotations

from typing import Any

import pytest

from dynagraph.errors import (
    EngineError,
    InvalidRequest,
    NoInstancesError,
    PromptTooLong,
    RemoteError,
)
from dynagraph.llm.protocol import ChatCompletionRequest, CompletionRequest, TextChunk, TokenizeKind

from .conftest import (
    MODEL,
    AppFactory,
    FakeBackend,
    chat_body,
    chunks_for,
    client_for,
    completion_body,
    sse_events,
)


async def test_chat_non_streamed(make_app: AppFactory) -> None:
    backend = FakeBackend(chunks_for(["Hello", " wörld", "!"], prompt_tokens=7))
    async with client_for(make_app(backend)) as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(max_tokens=5))
    assert resp.status_code == 200
    assert resp.headers["content-type"] == "application/json"
    body = resp.json()
    rid = resp.headers["x-request-id"]
    assert body["id"] == f"chatcmpl-{rid}"
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"content": "Hello wörld!", "role": "assistant"},
            "finish_reason": "stop",
            "logprobs": None,
        }
    ]
    assert body["usage"]["prompt_tokens"] == 7
    assert body["usage"]["completion_tokens"] == 3
    assert body["usage"]["total_tokens"] == 10
    request, request_id = backend.calls[0]
    assert isinstance(request, ChatCompletionRequest) and request.max_tokens == 5
    assert request_id == rid
    assert backend.closed.is_set()


async def test_completion_non_streamed(make_app: AppFactory) -> None:
    backend = FakeBackend(chunks_for(["a", "b"], finish="length"))
    async with client_for(make_app(backend)) as client:
        resp = await client.post("/v1/completions", json=completion_body(prompt=[1, 2]))
    body = resp.json()
    assert resp.status_code == 200
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == "ab"
    assert body["choices"][0]["finish_reason"] == "length"
    assert isinstance(backend.calls[0][0], CompletionRequest)


async def test_request_id_header_is_honored_or_generated(make_app: AppFactory) -> None:
    backend = FakeBackend()
    async with client_for(make_app(backend)) as client:
        given = await client.post(
            "/v1/chat/completions", json=chat_body(), headers={"x-request-id": "abc-123"}
        )
        bad = await client.post(
            "/v1/chat/completions", json=chat_body(), headers={"x-request-id": "a b\tc"}
        )
        generated = await client.post("/v1/chat/completions", json=chat_body())
    assert given.headers["x-request-id"] == "abc-123"
    assert backend.calls[0][1] == "abc-123"
    assert bad.headers["x-request-id"] != "a b\tc"
    ids = {bad.headers["x-request-id"], generated.headers["x-request-id"]}
    assert len(ids) == 2 and all(len(i) == 32 for i in ids)


async def test_models_and_health(make_app: AppFactory) -> None:
    backend = FakeBackend(ready=False)
    async with client_for(make_app(backend)) as client:
        models = await client.get("/v1/models")
        down = await client.get("/health")
        backend.is_ready = True
        up = await client.get("/health")
    assert models.json()["object"] == "list"
    card = models.json()["data"][0]
    assert card["id"] == MODEL and card["object"] == "model" and card["max_model_len"] == 2048
    assert down.status_code == 503
    assert down.json()["error"]["type"] == "service_unavailable"
    assert up.status_code == 200 and up.json() == {"status": "healthy"}


def assert_error(resp: object, status: int, param: str | None = None) -> dict[str, object]:
    import httpx

    assert isinstance(resp, httpx.Response)
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if param is not None:
        assert error["param"] == param
    return dict(error)


async def test_malformed_json(make_app: AppFactory) -> None:
    backend = FakeBackend()
    async with client_for(make_app(backend)) as client:
        resp = await client.post(
            "/v1/chat/completions",
            content=b'{"model": ',
            headers={"content-type": "application/json"},
        )
        empty = await client.post("/v1/completions", content=b"")
        array = await client.post("/v1/completions", content=b"[1, 2]")
    error = assert_error(resp, 400)
    assert "not valid JSON" in str(error["message"])
    assert error["type"] == "invalid_request_error"
    assert_error(empty, 400)
    assert "JSON object" in str(assert_error(array, 400)["message"])
    assert backend.calls == []


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL}, "messages"),
        (chat_body(messages=[]), "messages"),
        (chat_body(max_tokens=-1), "max_tokens"),
        (chat_body(temperature="hot"), "temperature"),
        (chat_body(n=0), "n"),
        (chat_body(messages=[{"content": "x"}]), "messages.0.role"),
        (chat_body(stream_options={"include_usage": 1}), "stream_options.include_usage"),
        (chat_body(max_tokens=4096), "max_tokens"),  # >= max_model_len
    ],
)
async def test_validation_errors_name_the_field(
    make_app: AppFactory, body: dict[str, object], param: str
) -> None:
    backend = FakeBackend()
    async with client_for(make_app(backend)) as client:
        resp = await client.post("/v1/chat/completions", json=body)
    assert_error(resp, 400, param)
    assert backend.calls == []


async def test_completion_prompt_type_error(make_app: AppFactory) -> None:
    async with client_for(make_app(FakeBackend())) as client:
        resp = await client.post("/v1/completions", json=completion_body(prompt=[1, "a"]))
    assert_error(resp, 400, "prompt")


async def test_unknown_model_is_404(make_app: AppFactory) -> None:
    async with client_for(make_app(FakeBackend())) as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(model="gpt-9"))
    error = assert_error(resp, 404, "model")
    assert error["code"] == "model_not_found"


async def test_unknown_route_and_method(make_app: AppFactory) -> None:
    async with client_for(make_app(FakeBackend())) as client:
        missing = await client.get("/v1/nope")
        wrong_method = await client.get("/v1/chat/completions")
    assert assert_error(missing, 404)["code"] == "not_found"
    assert_error(wrong_method, 405)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("error", "status", "param"),
    [
        (PromptTooLong("prompt has 9000 tokens", param="messages"), 400, "messages"),
        (InvalidRequest("bad", param="prompt"), 400, "prompt"),
        (NoInstancesError("no workers for dynamo/Processor/generate"), 503, None),
        (RemoteError("PromptTooLong", "too long"), 400, None),
        (EngineError("boom"), 500, None),
        (RuntimeError("unexpected"), 500, None),
    ],
)
async def test_backend_errors_before_first_token(
    make_app: AppFactory, error: Exception, status: int, param: str | None, stream: bool
) -> None:
    backend = FakeBackend(error=error, error_at=0)
    async with client_for(make_app(backend)) as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(stream=stream))
    body = assert_error(resp, status, param)
    assert resp.headers["x-request-id"]
    if status == 503:
        assert body["type"] == "service_unavailable"
    assert backend.closed.is_set()


async def test_backend_stream_without_finish_is_500(make_app: AppFactory) -> None:
    backend = FakeBackend([TextChunk(text="a", completion_tokens=1)])
    async with client_for(make_app(backend)) as client:
        resp = await client.post("/v1/completions", json=completion_body())
        empty = await client.post(
            "/v1/completions", json=completion_body(stream=True)
        )  # same backend, first chunk ok
    assert_error(resp, 500)
    assert empty.status_code == 200
    assert '"error"' in empty.text


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", chat_body(audio={"voice": "alloy"}), "audio"),
        ("/v1/chat/completions", chat_body(use_beam_search=True), "use_beam_search"),
        ("/v1/completions", completion_body(suffix="!"), "suffix"),
        ("/v1/completions", completion_body(best_of=3), "best_of"),
    ],
)
async def test_what_we_cannot_honour_is_a_400_naming_it(
    make_app: AppFactory, path: str, body: dict[str, object], param: str
) -> None:
    backend = FakeBackend()
    async with client_for(make_app(backend)) as client:
        resp = await client.post(path, json=body)
    assert assert_error(resp, 400, param)["code"] == "unsupported_parameter"
    assert backend.calls == []


async def test_unknown_model_is_a_404_naming_the_served_ones(make_app: AppFactory) -> None:
    async with client_for(make_app(FakeBackend())) as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(model="gpt-9"))
    error = assert_error(resp, 404, "model")
    assert error["code"] == "model_not_found" and MODEL in str(error["message"])


async def test_choices_stream_with_their_index_and_logprobs(make_app: AppFactory) -> None:
    lp = {"content": [{"token": "a", "logprob": -1.0, "bytes": [97], "top_logprobs": []}]}
    chunks = [TextChunk(text="a", index=1, logprobs=lp, completion_tokens=1),
              TextChunk(text="b", index=0, completion_tokens=2, logprobs=lp),
              TextChunk(text="", index=1, finish_reason="stop", completion_tokens=2),
              TextChunk(text="", index=0, finish_reason="length", completion_tokens=3,
                        prompt_tokens=4)]
    async with client_for(make_app(FakeBackend(chunks))) as client:
        resp = await client.post("/v1/chat/completions", json=chat_body(
            n=2, temperature=1.0, logprobs=True, stream=True,
            stream_options={"include_usage": True}))
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    choices = [e["choices"][0] for e in events[:-2]]
    assert [c["index"] for c in choices] == [1, 0, 1, 0]
    assert [c["delta"].get("role") for c in choices] == ["assistant", "assistant", None, None]
    assert choices[0]["logprobs"] == lp and choices[2]["logprobs"] is None
    assert [c["finish_reason"] for c in choices] == [None, None, "stop", "length"]
    assert events[-2]["usage"]["completion_tokens"] == 3 and events[-2]["choices"] == []


async def test_tokenize_routes_reach_the_backend(make_app: AppFactory) -> None:
    class Tokenizing(FakeBackend):
        async def tokenize(self, kind: TokenizeKind, model: str, body: dict[str, Any]
                       ) -> dict[str, Any]:
            return {"kind": kind, "model": model, "body": body}

    async with client_for(make_app(Tokenizing())) as client:
        tok = await client.post("/tokenize", json={"prompt": "hi"})
        detok = await client.post("/detokenize", json={"model": MODEL, "tokens": [1, 2]})
        bad = await client.post("/tokenize", json={"model": MODEL})
        other = await client.post("/detokenize", json={"model": "x", "tokens": [1]})
    assert tok.json() == {"kind": "tokenize", "model": MODEL, "body": {"prompt": "hi"}}
    assert detok.json()["body"] == {"model": MODEL, "tokens": [1, 2]}
    assert_error(bad, 400)
    assert_error(other, 404, "model")
