"""merge_outputs: which of a worker's piled-up outputs may become one."""

from __future__ import annotations

from typing import Any

import pytest

from dynagraph.llm.coalesce import merge_outputs
from dynagraph.llm.protocol import LLMEngineOutput


def test_tokens_and_their_logprobs_are_joined_and_the_latest_totals_kept() -> None:
    a = {"token_ids": [1, 2], "prompt_tokens": 9, "logprobs": [[[1], [-0.1]], [[2], [-0.2]]],
         "prompt_logprobs": [None, [[5], [-1.0], [1]]]}
    b = {"token_ids": [3], "logprobs": [[[3], [-0.3]]], "cached_tokens": 4,
         "finish_reason": "length"}
    merged = merge_outputs(a, b)
    assert merged == {"token_ids": [1, 2, 3], "prompt_tokens": 9, "cached_tokens": 4,
                      "logprobs": [[[1], [-0.1]], [[2], [-0.2]], [[3], [-0.3]]],
                      "prompt_logprobs": [None, [[5], [-1.0], [1]]], "finish_reason": "length"}
    assert a["token_ids"] == [1, 2]  # the inputs are left as they were
    LLMEngineOutput.from_wire(merged)  # still a valid output


@pytest.mark.parametrize("first, then", [
    ({"token_ids": [1], "finish_reason": "stop"}, {"token_ids": [2]}),  # first was the last
    ({"token_ids": [1], "index": 0}, {"token_ids": [2], "index": 1}),  # another choice
    ({"token_ids": [1]}, {"token_ids": [], "finish_reason": "error", "error": "boom"}),
    ({"token_ids": [1]}, {"token_ids": [2], "kv_transfer": {}}),  # a key it does not know
    ({"token_ids": [1], "logprobs": [[[1], [-0.1]]]}, {"token_ids": [2]}),  # logprobs on one only
    ({"token_ids": [1]}, {"token_ids": [2], "prompt_logprobs": [None]}),
    ({"token_ids": [1]}, "not an output"),
])
def test_outputs_that_must_stay_apart(first: Any, then: Any) -> None:
    assert merge_outputs(first, then) is None
