from __future__ import annotations

import pytest
from pydantic import ValidationError

from dynagraph.errors import InvalidRequest, PromptTooLong
from dynagraph.llm.detokenize import ResponseDetokenizer
from dynagraph.llm.preprocess import Preprocessor
from dynagraph.llm.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LLMEngineOutput,
)
from dynagraph.llm.tokenizer import Tokenizer


def chat(**fields: object) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "Hello 日本"}], **fields}
    return ChatCompletionRequest.model_validate(body)


def completion(prompt: object, **fields: object) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": prompt, **fields})


def test_chat_is_templated_and_tokenized(tok: Tokenizer) -> None:
    pre = Preprocessor(tok, max_model_len=128).preprocess(chat(), "rid")
    assert pre.request_id == "rid"
    assert pre.token_ids == tok.encode_chat([{"role": "user", "content": "Hello 日本"}])
    assert pre.sampling.max_tokens == 128 - len(pre.token_ids)
    assert pre.sampling.temperature == 1.0 and pre.sampling.top_p == 1.0
    assert pre.eos_token_ids == list(tok.eos_token_ids)
    assert pre.stop == [] and pre.skip_special_tokens


def test_sampling_fields_are_carried(tok: Tokenizer) -> None:
    req = chat(
        max_completion_tokens=7,
        temperature=0.0,
        top_p=0.5,
        seed=3,
        ignore_eos=True,
        stop=["\n", "###"],
        stop_token_ids=[9],
        min_tokens=2,
    )
    pre = Preprocessor(tok).preprocess(req, "r")
    s = pre.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed) == (7, 0.0, 0.5, 3)
    assert s.ignore_eos and s.stop_token_ids == [9] and s.min_tokens == 2
    assert pre.stop == ["\n", "###"]


def test_content_parts_are_joined(tok: Tokenizer) -> None:
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "日本"}]
    req = chat(messages=[{"role": "user", "content": parts}])
    assert Preprocessor(tok).preprocess(req, "r").token_ids == (
        Preprocessor(tok).preprocess(chat(), "r").token_ids
    )


def test_non_text_content_is_rejected(tok: Tokenizer) -> None:
    req = chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}])
    with pytest.raises(InvalidRequest) as exc:
        Preprocessor(tok).preprocess(req, "r")
    assert exc.value.param == "messages.0.content"


@pytest.mark.parametrize("wrap", [lambda p: p, lambda p: [p]])
def test_completion_string_prompt(tok: Tokenizer, wrap: object) -> None:
    pre = Preprocessor(tok).preprocess(completion(wrap("Hello world")), "r")  # type: ignore[operator]
    assert pre.token_ids == tok.encode("Hello world")
    assert pre.sampling.max_tokens == 16  # OpenAI's and vLLM's default for completions


@pytest.mark.parametrize("prompt", [[5, 6, 7], [[5, 6, 7]]])
def test_completion_token_prompt(tok: Tokenizer, prompt: object) -> None:
    assert Preprocessor(tok).preprocess(completion(prompt), "r").token_ids == [5, 6, 7]


@pytest.mark.parametrize("prompt", [["a b", "c"], [[5, 6], [7]]])
def test_batched_prompts_become_one_engine_request_each(tok: Tokenizer, prompt: object) -> None:
    plan = Preprocessor(tok).plan(completion(prompt), "r")
    assert [p.request.request_id for p in plan.prompts] == ["r-0", "r-1"]
    first = prompt[0]  # type: ignore[index]
    want = tok.encode(first) if isinstance(first, str) else first
    assert plan.prompts[0].request.token_ids == want and not plan.plain


def test_out_of_vocab_and_empty_prompts(tok: Tokenizer) -> None:
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        Preprocessor(tok).preprocess(completion([1, tok.vocab_size]), "r")
    with pytest.raises(ValidationError, match="empty"):
        completion([])
    with pytest.raises(ValidationError, match="empty"):
        completion("")


def test_prompt_too_long(tok: Tokenizer) -> None:
    pre = Preprocessor(tok, max_model_len=8)
    with pytest.raises(PromptTooLong) as exc:
        pre.preprocess(completion(list(range(10, 18))), "r")
    assert exc.value.param == "prompt" and exc.value.code == "context_length_exceeded"
    with pytest.raises(PromptTooLong, match="6 in the prompt, 5 in the completion") as exc2:
        pre.preprocess(completion(list(range(10, 16)), max_tokens=5), "r")
    assert exc2.value.param == "max_tokens"
    assert (
        pre.preprocess(completion(list(range(10, 16)), max_tokens=2), "r").sampling.max_tokens == 2
    )


def test_detokenizer_factory(tok: Tokenizer) -> None:
    pp = Preprocessor(tok)
    pre = pp.preprocess(chat(stop="quick", max_tokens=50), "r")
    detok = pp.detokenizer(pre)
    assert isinstance(detok, ResponseDetokenizer)
    chunk = detok.process(
        LLMEngineOutput(token_ids=tok.encode("The quick fox", add_special_tokens=False))
    )
    assert chunk is not None and chunk.text == "The " and chunk.finish_reason == "stop"
