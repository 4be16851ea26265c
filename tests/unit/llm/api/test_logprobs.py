"""Logprob token text and OpenAI shapes, with exact expected values."""

from __future__ import annotations

import pytest

from dynagraph.llm.api.logprobs import (
    FLOOR,
    LogprobFormatter,
    TokenTexts,
    echo_positions,
    prompt_logprobs,
)
from dynagraph.llm.tokenizer import Tokenizer


@pytest.fixture
def texts(tok: Tokenizer) -> TokenTexts:
    return TokenTexts(tok.backend)


def test_split_character_is_given_to_the_token_that_completes_it(
    tok: Tokenizer, texts: TokenTexts
) -> None:
    ids = tok.encode("a€b", add_special_tokens=False)
    assert len(ids) == 5  # 'a', three byte pieces of '€', 'b'
    got = [texts.text(t, ids[:i]) for i, t in enumerate(ids)]
    assert got == ["a", "", "", "€", "b"]


def test_special_tokens_keep_their_text(tok: Tokenizer, texts: TokenTexts) -> None:
    assert texts.raw(tok.eos_token_ids[0]) == "</s>"


def test_chat_entries_dedupe_the_sampled_token_and_floor(
    tok: Tokenizer, texts: TokenTexts
) -> None:
    the, hello = tok.encode(" the", add_special_tokens=False)[0], 304
    fmt = LogprobFormatter(texts, top=2)
    out = fmt.chat([the], [([the, the, hello], [-0.5, -0.5, float("-inf")])])
    assert out == [{
        "token": " the", "logprob": -0.5, "bytes": list(b" the"),
        "top_logprobs": [
            {"token": " the", "logprob": -0.5, "bytes": list(b" the")},
            {"token": "He", "logprob": FLOOR, "bytes": list(b"He")},
        ],
    }]


def test_chat_top_zero_and_missing_sampled(tok: Tokenizer, texts: TokenTexts) -> None:
    fmt = LogprobFormatter(texts, top=0)
    assert fmt.chat([304], [([304], [-1.0])])[0]["top_logprobs"] == []
    missing = fmt.chat([304], [([325], [-1.0])])[0]
    assert missing["logprob"] == FLOOR and missing["top_logprobs"] == []


def test_completion_shape_offsets_and_top_count(tok: Tokenizer, texts: TokenTexts) -> None:
    fmt = LogprobFormatter(texts, top=1)
    ids = tok.encode("Hello", add_special_tokens=False)  # 'He', 'll', 'o'
    first = fmt.completion(ids[:2], [([ids[0], 7, 8], [-1.0, -2.0, -3.0]),
                                     ([ids[1], ids[1]], [-0.1, -0.1])])
    second = fmt.completion(ids[2:], [([ids[2], 9], [-0.2, -0.3])])
    assert first["tokens"] == ["He", "ll"] and first["text_offset"] == [0, 2]
    assert first["token_logprobs"] == [-1.0, -0.1]
    assert [len(t) for t in first["top_logprobs"]] == [2, 1]  # logprobs + 1 entries
    assert second["text_offset"] == [4] and second["tokens"] == ["o"]


def test_echo_positions_and_prompt_logprobs(tok: Tokenizer, texts: TokenTexts) -> None:
    ids = tok.encode("Hello", add_special_tokens=False)
    raw = [None, ([ids[1], 5], [-1.5, -0.5], [2, 1]), ([ids[2]], [-0.25], [1])]
    plp = prompt_logprobs(texts, ids, raw)
    assert plp[0] is None
    assert plp[1] == {str(ids[1]): {"logprob": -1.5, "rank": 2, "decoded_token": "ll"},
                      "5": {"logprob": -0.5, "rank": 1, "decoded_token": texts.raw(5)}}
    fmt = LogprobFormatter(texts, top=0)
    echo = fmt.completion(ids, echo_positions(raw))
    assert echo["tokens"] == ["He", "ll", "o"] and echo["token_logprobs"] == [None, -1.5, -0.25]
    assert echo["top_logprobs"][0] is None and echo["text_offset"] == [0, 2, 4]
