"""The OpenAI API, feature by feature, with the official ``openai`` client.

Every test runs twice: against the agg graph as users serve it (``dynamo serve``,
separate processes) and against vLLM's own OpenAI server on the same model, started
here with the same chat template and the ``hermes`` tool parser. Passing on both is
the point: we match the anchor, not our own idea of it. Where the tiny model's output
quality matters (constrained JSON is padded with whitespace) the constrained shape is
checked, not the content.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import regex
from transformers import AutoTokenizer

from tests.support.greedy import TOP_LOGPROBS, Greedy, assert_agrees

pytestmark = pytest.mark.vllm

MODEL = "tiny-llama"
CHAT = [{"role": "user", "content": "Tell me about the Python standard library."}]
PROMPT = "The module"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"], "additionalProperties": False},
        "strict": True,
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}


@pytest.fixture(scope="module", params=["dynagraph", "vllm"])
def url(request: pytest.FixtureRequest) -> str:
    """The server under test: the agg graph, then vLLM's own server."""
    return str(request.getfixturevalue("base_url" if request.param == "dynagraph"
                                       else "vllm_url"))


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def aclient(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(model_dir))


def complete(client: openai.OpenAI, **kw: Any) -> Any:
    kw.setdefault("temperature", 0)
    return client.completions.create(model=MODEL, prompt=kw.pop("prompt", PROMPT), **kw)


def chat(client: openai.OpenAI, **kw: Any) -> Any:
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=kw.pop("messages", CHAT), **kw)


def stream_chat(client: openai.OpenAI, **kw: Any) -> list[Any]:
    return list(chat(client, stream=True, **kw))


# --------------------------------------------------------------------------- models, tokenize


def test_models_lists_the_served_model(url: str) -> None:
    data = httpx.get(f"{url}/v1/models").json()["data"]
    assert [m["id"] for m in data] == [MODEL]


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=2)


def test_tokenize_and_detokenize(url: str, client: openai.OpenAI, tok: Any) -> None:
    r = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert r["tokens"] == tok("Hello world")["input_ids"] and r["count"] == len(r["tokens"])
    plain = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": "Hello world",
                                                "add_special_tokens": False}).json()["tokens"]
    back = httpx.post(f"{url}/detokenize", json={"model": MODEL, "tokens": plain}).json()
    assert back["prompt"] == "Hello world"
    messages = httpx.post(f"{url}/tokenize", json={"model": MODEL, "messages": CHAT}).json()
    used = chat(client, max_tokens=1).usage.prompt_tokens
    assert messages["count"] == used


# --------------------------------------------------------------------------- sampling


def test_greedy_equals_top_k_1_and_min_p_1(client: openai.OpenAI) -> None:
    """Up to a near tie: top_k 1 and min_p 1 keep every token tied with the best (bfloat16
    logits tie outright about once in 75 steps here) and sample among them."""
    greedy = Greedy.of(complete(client, max_tokens=24, logprobs=TOP_LOGPROBS,
                                extra_body={"ignore_eos": True}).choices[0].model_dump())
    top_k = complete(client, max_tokens=24, temperature=1.0, seed=3,
                     extra_body={"ignore_eos": True, "top_k": 1}).choices[0].text
    min_p = complete(client, max_tokens=24, temperature=1.0, seed=4,
                     extra_body={"ignore_eos": True, "min_p": 1.0}).choices[0].text
    assert_agrees(greedy, top_k, "top_k 1")
    assert_agrees(greedy, min_p, "min_p 1")


def test_penalties_change_a_repetitive_greedy_answer(client: openai.OpenAI) -> None:
    base = complete(client, max_tokens=48, extra_body={"ignore_eos": True}).choices[0].text
    for extra in ({"repetition_penalty": 1.8}, {"frequency_penalty": 1.5},
                  {"presence_penalty": 1.5}):
        body = {"ignore_eos": True, **extra}
        kw = {k: body.pop(k) for k in ("frequency_penalty", "presence_penalty") if k in body}
        text = complete(client, max_tokens=48, extra_body=body, **kw).choices[0].text
        assert text != base, extra


def test_seed_makes_sampling_repeatable(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        return str(complete(client, max_tokens=24, temperature=1.0, seed=seed,
                            extra_body={"ignore_eos": True}).choices[0].text)
    assert sample(7) == sample(7)
    assert len({sample(7), sample(8), sample(9)}) > 1


def test_logit_bias_forces_a_token(client: openai.OpenAI, tok: Any) -> None:
    (token,) = tok(" the", add_special_tokens=False)["input_ids"]
    r = complete(client, max_tokens=5, logit_bias={str(token): 100},
                 extra_body={"ignore_eos": True})
    assert r.choices[0].text == " the" * 5


def test_min_tokens_holds_off_eos_and_stop_token_ids_end_the_text(
    client: openai.OpenAI, tok: Any
) -> None:
    eos = tok.eos_token_id
    r = complete(client, max_tokens=20, logit_bias={str(eos): 100},
                 extra_body={"min_tokens": 5})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 6
    (token,) = tok(" the", add_special_tokens=False)["input_ids"]
    r = complete(client, max_tokens=20, logit_bias={str(token): 100},
                 extra_body={"stop_token_ids": [token]})
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
    assert r.choices[0].text == ""


def _contains(tokens: list[str], run: list[str]) -> bool:
    return any(tokens[i:i + len(run)] == run for i in range(len(tokens) - len(run) + 1))


def test_bad_words_are_never_generated(client: openai.OpenAI, tok: Any) -> None:
    """What ``bad_words`` promises (vLLM's rule, ``SamplingParams.update_from_tokenizer``):
    the word's tokens never come out, nor its space-prefixed tokens where those are as
    many and start differently (" definition" as one token next to "def" + "inition" is
    not banned). So the check is on tokens, for a word whose banned tokens the unbanned
    text has: a different model build (another CPU's numerics) picks other words."""
    def ids(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def banned(word: str) -> list[list[str]]:
        bare, spaced = ids(word), ids(" " + word)
        runs = [bare] + ([spaced] if spaced[0] != bare[0] and len(spaced) == len(bare) else [])
        return [[tok.decode([i]) for i in run] for run in runs]

    base = complete(client, max_tokens=32, logprobs=1, extra_body={"ignore_eos": True})
    base_tokens = base.choices[0].logprobs.tokens
    words = [w for w in re.findall(r"[A-Za-z]{3,}", base.choices[0].text)
             if any(_contains(base_tokens, run) for run in banned(w))]
    assert words, f"no word of {base.choices[0].text!r} comes out as its banned tokens"
    r = complete(client, max_tokens=32, logprobs=1,
                 extra_body={"ignore_eos": True, "bad_words": [words[0]]})
    tokens = r.choices[0].logprobs.tokens
    assert not any(_contains(tokens, run) for run in banned(words[0])), (words[0], tokens)
    assert r.choices[0].text != base.choices[0].text


def test_allowed_token_ids_and_truncated_prompt(client: openai.OpenAI, tok: Any) -> None:
    (token,) = tok(" the", add_special_tokens=False)["input_ids"]
    r = complete(client, max_tokens=4, extra_body={"ignore_eos": True,
                                                   "allowed_token_ids": [token]})
    assert r.choices[0].text == " the" * 4
    r = complete(client, prompt="word " * 40, max_tokens=1,
                 extra_body={"truncate_prompt_tokens": 10})
    assert r.usage.prompt_tokens == 10


def test_stop_string_included_on_request(client: openai.OpenAI) -> None:
    base = complete(client, max_tokens=40, extra_body={"ignore_eos": True}).choices[0].text
    stop = re.findall(r"[A-Za-z]{3,}", base)[1]
    cut = complete(client, max_tokens=40, stop=[stop],
                   extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    assert cut.choices[0].text == base[: base.index(stop) + len(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_n_choices_non_streamed_and_streamed(client: openai.OpenAI) -> None:
    r = chat(client, n=3, temperature=1.0, seed=5, max_tokens=12)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    usage = None
    for chunk in stream_chat(client, n=3, temperature=1.0, seed=5, max_tokens=12,
                             stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert sorted(finishes) == [0, 1, 2]
    assert usage is not None and usage.completion_tokens == r.usage.completion_tokens
    assert [texts[i] for i in range(3)] == [c.message.content for c in
                                            sorted(r.choices, key=lambda c: c.index)]


def test_completions_batch_of_prompts_times_n(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=["One", "Two"], n=2, max_tokens=4,
                                  temperature=1.0, seed=1)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    each = [client.completions.create(model=MODEL, prompt=p, max_tokens=1).usage.prompt_tokens
            for p in ("One", "Two")]
    assert r.usage.prompt_tokens == sum(each)


# --------------------------------------------------------------------------- logprobs, echo


def test_chat_logprobs_streamed_and_not(client: openai.OpenAI) -> None:
    r = chat(client, max_tokens=10, logprobs=True, top_logprobs=3,
             extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 10
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3 and t.bytes == list(t.token.encode())
        assert t.logprob == max(x.logprob for x in t.top_logprobs)  # greedy picks the top
    streamed = [lp for chunk in stream_chat(client, max_tokens=10, logprobs=True,
                                             top_logprobs=3, extra_body={"ignore_eos": True})
                for c in chunk.choices if c.logprobs and c.logprobs.content
                for lp in c.logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content],
                                                          abs=1e-4)


def test_completion_logprobs_and_echo(client: openai.OpenAI, tok: Any) -> None:
    r = complete(client, max_tokens=6, logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text and len(lp.tokens) == 6
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    assert all(1 <= len(top) <= 3 for top in lp.top_logprobs)
    e = complete(client, max_tokens=6, logprobs=2, echo=True, extra_body={"ignore_eos": True})
    choice = e.choices[0]
    prompt_len = len(tok(PROMPT)["input_ids"])
    assert choice.text == PROMPT + r.choices[0].text
    assert len(choice.logprobs.tokens) == prompt_len + 6
    assert choice.logprobs.token_logprobs[0] is None
    assert all(x is not None for x in choice.logprobs.token_logprobs[1:])
    streamed = list(complete(client, max_tokens=6, echo=True, stream=True,
                             extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == choice.text


def test_completion_logprobs_streamed_equal_non_streamed(client: openai.OpenAI) -> None:
    whole = complete(client, max_tokens=8, logprobs=1,
                     extra_body={"ignore_eos": True}).choices[0].logprobs
    tokens: list[str] = []
    offsets: list[int] = []
    for chunk in complete(client, max_tokens=8, logprobs=1, stream=True,
                          extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            if c.logprobs:
                tokens += c.logprobs.tokens
                offsets += c.logprobs.text_offset
    assert tokens == whole.tokens and offsets == whole.text_offset


def test_echo_with_zero_max_tokens_returns_the_prompt(client: openai.OpenAI) -> None:
    r = complete(client, max_tokens=0, echo=True)
    assert r.choices[0].text == PROMPT


def test_prompt_logprobs(client: openai.OpenAI, tok: Any) -> None:
    r = complete(client, max_tokens=1, extra_body={"prompt_logprobs": 1})
    plp = r.choices[0].model_extra["prompt_logprobs"]
    ids = tok(PROMPT)["input_ids"]
    assert len(plp) == len(ids) and plp[0] is None
    for token_id, entry in zip(ids[1:], plp[1:], strict=True):
        assert str(token_id) in entry and 1 <= len(entry) <= 2
        assert {"logprob", "rank", "decoded_token"} <= set(entry[str(token_id)])
    c = chat(client, max_tokens=1, extra_body={"prompt_logprobs": 0})
    assert len(c.model_extra["prompt_logprobs"]) == c.usage.prompt_tokens


def test_chat_echo_continues_the_assistant_message(client: openai.OpenAI) -> None:
    messages = [*CHAT, {"role": "assistant", "content": "The library"}]
    r = chat(client, messages=messages, max_tokens=5, extra_body={
        "echo": True, "add_generation_prompt": False, "continue_final_message": True})
    assert r.choices[0].message.content.startswith("The library")


# --------------------------------------------------------------------------- structured output


def test_json_schema_constrains_the_shape(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = chat(client, max_tokens=60, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    assert_json_shape(r.choices[0].message.content, r.choices[0].finish_reason, PERSON)
    r = complete(client, max_tokens=60, extra_body={"structured_outputs": {"json": schema}})
    assert_json_shape(r.choices[0].text, r.choices[0].finish_reason, PERSON)


_STR = r'"(?:[^"\\]|\\.)*"'
_INT = r"-?(?:0|[1-9][0-9]*)"
PERSON = (rf'\{{(?:"name":{_STR},"age":{_INT}|"age":{_INT},"name":{_STR})\}}')


def _compact(text: str) -> str:
    """``text`` without whitespace outside JSON strings."""
    out, in_str, escaped = [], False, False
    for ch in text:
        if in_str:
            out.append(ch)
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif not ch.isspace():
            out.append(ch)
            in_str = ch == '"'
    return "".join(out)


def assert_json_shape(text: str, finish: str | None, pattern: str) -> None:
    """Whole JSON of the pattern's shape, or (cut by max_tokens while the tiny model pads
    with whitespace) a prefix of one."""
    compact = _compact(text)
    if finish == "stop":
        assert regex.fullmatch(pattern, compact), text
        json.loads(text)
    else:
        assert regex.fullmatch(pattern, compact, partial=True), text


def test_json_object(client: openai.OpenAI) -> None:
    r = chat(client, max_tokens=40, response_format={"type": "json_object"})
    text = _compact(r.choices[0].message.content)
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_regex_choice_and_grammar(client: openai.OpenAI) -> None:
    r = chat(client, max_tokens=20, extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}})
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", r.choices[0].message.content)
    r = complete(client, max_tokens=10, extra_body={"structured_outputs": {
        "choice": ["yes", "no", "maybe"]}})
    assert r.choices[0].text in ("yes", "no", "maybe")
    grammar = 'root ::= "call(" [a-z]+ ")"'
    r = chat(client, max_tokens=20, extra_body={"structured_outputs": {"grammar": grammar}})
    assert re.fullmatch(r"call\([a-z]+\)", r.choices[0].message.content)


def test_two_constraints_are_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError):
        chat(client, max_tokens=5, extra_body={"structured_outputs": {
            "regex": "a+", "choice": ["a"]}})


# --------------------------------------------------------------------------- tools


def _args(call: Any) -> Any:
    return json.loads(call.function.arguments)


def assert_called(choice: Any, name: str, arg: str) -> list[Any]:
    """The choice called ``name`` with a string ``arg`` (the tool is strict), or ran out
    of tokens inside such a call: the tiny model pads the arguments' JSON with
    whitespace, which the tool-call grammar allows (vLLM's too), so then the text must
    be a prefix of a well-formed call."""
    calls = choice.message.tool_calls
    if not calls:
        assert choice.finish_reason == "length", choice
        head = re.match(rf'<tool_call>\n?\{{"name": "{name}", "arguments": ',
                        choice.message.content)
        assert head is not None, choice.message.content
        rest = _compact(choice.message.content[head.end():])
        assert regex.fullmatch(rf'\{{"{arg}":{_STR}\}}\}}\n?</tool_call>', rest,
                               partial=True), rest
        return []
    for call in calls:
        assert call.function.name == name and call.id and call.type == "function"
        assert isinstance(_args(call)[arg], str)
    return list(calls)


def test_named_tool_choice(client: openai.OpenAI) -> None:
    r = chat(client, max_tokens=60, tools=[WEATHER, TIME],
             tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls = assert_called(r.choices[0], "get_weather", "city")
    assert len(calls) <= 1
    if calls:
        assert r.choices[0].finish_reason == "stop"


def test_required_tool_choice_streamed_and_not(client: openai.OpenAI) -> None:
    r = chat(client, max_tokens=60, tools=[WEATHER], tool_choice="required")
    calls = assert_called(r.choices[0], "get_weather", "city")
    assert r.choices[0].finish_reason in ("tool_calls", "length")
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    finish = None
    for chunk in stream_chat(client, max_tokens=60, tools=[WEATHER], tool_choice="required"):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or ():
                if d.function and d.function.name:
                    names[d.index] = d.function.name
                if d.function and d.function.arguments:
                    args[d.index] = args.get(d.index, "") + d.function.arguments
    assert names and set(names.values()) == {"get_weather"}
    if calls:
        assert names == {i: c.function.name for i, c in enumerate(calls)}
        assert args == {i: c.function.arguments for i, c in enumerate(calls)}
    assert finish == r.choices[0].finish_reason


def test_auto_tool_choice_parses_the_hermes_format(client: openai.OpenAI) -> None:
    """The tiny model does not call tools by itself; a regex makes it write one hermes
    tool call, which the configured parser must turn into ``tool_calls``. (The tools are
    not strict: with a strict one, vLLM lets the model choose between the regex and a
    constrained tool call.)"""
    weather = {"type": "function", "function": {
        k: v for k, v in WEATHER["function"].items() if k != "strict"}}  # type: ignore[attr-defined]
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    body = {"structured_outputs": {"regex": re.escape(call)}}
    r = chat(client, max_tokens=200, tools=[weather, TIME], tool_choice="auto", extra_body=body)
    (tc,) = r.choices[0].message.tool_calls
    assert tc.function.name == "get_weather" and _args(tc) == {"city": "Paris"}
    assert r.choices[0].finish_reason == "tool_calls" and not r.choices[0].message.content
    deltas = [d for chunk in stream_chat(client, max_tokens=200, tools=[weather, TIME],
                                         extra_body=body)
              for c in chunk.choices for d in (c.delta.tool_calls or ())]
    assert deltas[0].function.name == "get_weather" and deltas[0].id
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Paris"}


def test_tool_messages_in_the_conversation(client: openai.OpenAI, url: str) -> None:
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]
    r = chat(client, messages=messages, tools=[WEATHER], max_tokens=8)
    assert r.choices[0].message.role == "assistant"
    counted = httpx.post(f"{url}/tokenize", json={"model": MODEL, "messages": messages,
                                                  "tools": [WEATHER]}).json()["count"]
    assert r.usage.prompt_tokens == counted
    without = httpx.post(f"{url}/tokenize", json={"model": MODEL,
                                                  "messages": messages[:1]}).json()["count"]
    assert counted > without + 40  # the tools, the call and its result are in the prompt


# --------------------------------------------------------------------------- usage


def test_continuous_usage_in_every_chunk(client: openai.OpenAI) -> None:
    chunks = stream_chat(client, max_tokens=6, extra_body={"ignore_eos": True},
                         stream_options={"include_usage": True,
                                         "continuous_usage_stats": True})
    counts = [c.usage.completion_tokens for c in chunks if c.choices]
    assert counts == sorted(counts) and counts[-1] == 6
    assert chunks[-1].usage.completion_tokens == 6 and not chunks[-1].choices


async def test_cached_prompt_tokens_in_usage(aclient: openai.AsyncOpenAI) -> None:
    prompt = "A prompt long enough to fill a few KV blocks of 32 tokens each. " * 8

    async def cached() -> int:
        r = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
        details = r.usage.prompt_tokens_details
        assert details is not None
        return int(details.cached_tokens or 0)

    await cached()
    await asyncio.sleep(0.05)
    assert await cached() >= 64
