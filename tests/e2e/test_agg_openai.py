"""The agg graph through the official `openai` client and raw HTTP (issue 3's checks)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.e2e.conftest import MAX_MODEL_LEN
from tests.support.serve import ServeProcess

pytestmark = pytest.mark.vllm

MODEL = "tiny-llama"
MESSAGES = [{"role": "user", "content": "Tell me about the Python standard library."}]


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def aclient(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir: Path):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(str(model_dir))


def test_models_and_health(base_url: str) -> None:
    assert httpx.get(f"{base_url}/health").status_code == 200
    models = httpx.get(f"{base_url}/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]


def test_chat_streamed_equals_not_streamed_greedy(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24,
                                          temperature=0)
    text = full.choices[0].message.content
    assert text and full.choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    parts, usage, reasons = [], None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
    assert "".join(parts) == text
    assert reasons[-1] == full.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens
    assert usage.prompt_tokens == full.usage.prompt_tokens


def test_completions_streamed_and_not(client: openai.OpenAI) -> None:
    full = client.completions.create(model=MODEL, prompt="The module", max_tokens=16, temperature=0)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="The module", max_tokens=16, temperature=0, stream=True))
    assert streamed == full.choices[0].text and streamed


def test_max_tokens_with_ignore_eos_is_exact(client: openai.OpenAI) -> None:
    for n in (1, 7, 50):
        r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=n, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == n and r.choices[0].finish_reason == "length"


def test_usage_matches_the_tokenizer(client: openai.OpenAI, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0)
    expected = hf_tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)
    if isinstance(expected, dict) or hasattr(expected, "input_ids"):
        expected = expected["input_ids"]
    assert r.usage.prompt_tokens == len(expected)
    prompt = "Counting tokens in a plain prompt."
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == len(hf_tokenizer(prompt)["input_ids"])
    assert r.usage.total_tokens == r.usage.prompt_tokens + 3


def test_stop_string_cuts_the_text(client: openai.OpenAI) -> None:
    base = client.completions.create(model=MODEL, prompt="The module", max_tokens=40,
                                     temperature=0, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    words = [w for w in re.findall(r"[A-Za-z]{3,}", text)[2:]]
    assert words, text
    stop = words[0]
    cut = client.completions.create(model=MODEL, prompt="The module", max_tokens=40,
                                    temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_greedy_matches_token_ids_prompt(client: openai.OpenAI, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    """A token-id prompt and its text give the same greedy completion."""
    text_prompt = "In the beginning"
    ids = hf_tokenizer(text_prompt)["input_ids"]
    a = client.completions.create(model=MODEL, prompt=text_prompt, max_tokens=20, temperature=0)
    b = client.completions.create(model=MODEL, prompt=ids, max_tokens=20, temperature=0)
    assert a.choices[0].text == b.choices[0].text


async def test_32_concurrent_streams_complete(aclient: openai.AsyncOpenAI) -> None:
    async def one(i: int) -> int:
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Request number {i}"}],
            max_tokens=32, temperature=0.7, seed=i, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        assert usage is not None
        return usage.completion_tokens

    assert await asyncio.gather(*(one(i) for i in range(32))) == [32] * 32


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (json.dumps({"model": MODEL}).encode(), 400, "messages"),
        (json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": -1}).encode(), 400,
         "max_tokens"),
        (json.dumps({"model": "gpt-9", "messages": MESSAGES}).encode(), 404, "model"),
        (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "word " * 3000}]}
                    ).encode(), 400, None),
    ],
)
def test_bad_input_gets_openai_errors_and_service_keeps_serving(
    base_url: str, client: openai.OpenAI, body: bytes, status: int, param: str | None
) -> None:
    r = httpx.post(f"{base_url}/v1/chat/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param
    ok = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


async def test_client_disconnect_aborts_the_engine_request(
    base_url: str, agg_graph: ServeProcess, client: openai.OpenAI
) -> None:
    metrics_addr = agg_graph.metrics_addresses("VllmWorker")[0]

    def running() -> float:
        text = httpx.get(f"http://{metrics_addr}/metrics").text
        return float(re.search(r"^dynamo_worker_requests_running\{[^}]*\} (\S+)$", text,
                               re.M).group(1))  # type: ignore[union-attr]

    # As long as the context allows: left running, it would take ~1000 token steps.
    body = {"model": MODEL, "prompt": "Once", "max_tokens": MAX_MODEL_LEN - 8, "stream": True,
            "ignore_eos": True}
    loop = asyncio.get_running_loop()
    async with httpx.AsyncClient(timeout=30) as http:
        async with http.stream("POST", f"{base_url}/v1/completions", json=body) as r:
            arrivals: list[float] = []
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    arrivals.append(loop.time())
                if len(arrivals) >= 6:
                    break
    disconnected = loop.time()
    step = (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1)  # this machine's time per token
    left_alone = (body["max_tokens"] - len(arrivals)) * step  # type: ignore[operator]
    while True:  # a small request forces fresh scheduler stats after the abort
        client.completions.create(model=MODEL, prompt="x", max_tokens=1)
        if running() == 0:
            break
        assert loop.time() - disconnected < left_alone / 2, (
            f"still running {loop.time() - disconnected:.2f}s after the disconnect; "
            f"it would have finished by itself in {left_alone:.2f}s")
        await asyncio.sleep(0.05)
