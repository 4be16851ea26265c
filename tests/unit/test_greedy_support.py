"""tests.support.greedy: greedy texts agree up to a near tie of the reference."""

from __future__ import annotations

import pytest

from tests.support.greedy import NEAR_TIE, Greedy, assert_agrees

# " the cat sat" as tokens " the" | " cat" | " sat"; the reference was unsure at " cat"
REF = Greedy.of({"text": " the cat sat", "logprobs": {
    "tokens": [" the", " cat", " sat"], "text_offset": [0, 4, 8],
    "top_logprobs": [{" the": -0.1, " a": -2.5}, {" cat": -1.0, " dog": -1.0625},
                     {" sat": -0.2, " ran": -3.0}],
}})


def test_margins_are_the_lead_over_the_runner_up() -> None:
    assert REF.margins == (2.4, 0.0625, 2.8)


def test_the_same_text_agrees() -> None:
    assert REF.agrees(" the cat sat")


def test_parting_at_a_near_tie_agrees_whatever_follows() -> None:
    assert REF.agrees(" the dog ran away")


def test_parting_where_the_reference_was_sure_does_not() -> None:
    assert not REF.agrees(" a cat sat")
    why = REF.parting(" the cat ran")
    assert why is not None and "token 2" in why and "2.800" in why
    with pytest.raises(AssertionError, match="stream 3: parts from the reference"):
        assert_agrees(REF, " the cat ran", "stream 3")


def test_a_longer_choice_at_a_tie_parting_at_the_next_token_agrees() -> None:
    # " cats" instead of " cat": the texts part at " sat"'s first character
    assert REF.agrees(" the cats sat")
    sure = Greedy.of_parts(" the cat sat", [" the", " cat", " sat"],
                           [{" the": 0.0, " a": -9.0}] * 3)
    assert not sure.agrees(" the cats sat")


def test_near_tie_is_a_bound_in_nats() -> None:
    assert REF.agrees(" the dog", near_tie=0.0625)
    assert not REF.agrees(" the dog", near_tie=0.05)
    assert NEAR_TIE < 1.0


def test_a_reference_without_logprobs_is_refused() -> None:
    with pytest.raises(ValueError, match="logprobs"):
        Greedy.of({"text": "x", "logprobs": None})
    with pytest.raises(ValueError, match="2 tokens with 1 top logprobs"):
        Greedy.of_parts("ab", ["a", "b"], [{"a": 0.0}])


def test_tokens_the_text_leaves_out_are_aligned_past() -> None:
    # vLLM's text_offset counts special tokens' names; the text (skip_special_tokens)
    # has none of them, and a character split over two tokens shows as neither
    text = ".user\nIt’s"
    tokens = [".", "<|end_of_text|>", "<|im_start|>", "user", "\n", "It", "bytes:\\xe2",
              "bytes:\\x80\\x99", "s"]
    g = Greedy.of_parts(text, tokens, [{t: 0.0, "x": -1.0} for t in tokens])
    assert g.offsets == (0, 1, 1, 1, 5, 6, 8, 8, 9)
