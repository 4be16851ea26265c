"""Our OpenAI pieces against vLLM's own code on the tiny model's tokenizer (no engine):
logprob token text and the hermes tool-call structural tags."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dynagraph.llm.api.logprobs import TokenTexts
from dynagraph.llm.api.requests import ChatCompletionRequest
from dynagraph.llm.api.tools import plan_tools, tool_constraint
from dynagraph.llm.tokenizer import Tokenizer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]

TEXT = "Café 日本 🙂 €, naïve — the module’s “quotes” ø"


def test_logprob_token_texts_match_vllm(model_dir: Path) -> None:
    from vllm.tokenizers import get_tokenizer
    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens
    from vllm.v1.engine.logprobs import LogprobsProcessor

    ours = Tokenizer.from_dir(model_dir)
    theirs = get_tokenizer(str(model_dir))
    processor = LogprobsProcessor(tokenizer=theirs, logprobs=[], prompt_logprobs=None,
                                  cumulative_logprob=0.0, num_logprobs=0,
                                  num_prompt_logprobs=None)
    texts = TokenTexts(ours.backend)
    ids = ours.encode(TEXT, add_special_tokens=True) + list(ours.eos_token_ids)
    for i, token in enumerate(ids):
        context = ids[max(0, i - 4):i]
        want = processor._verify_tokens(convert_ids_list_to_tokens(theirs, [token]), [token],
                                        context_token_ids=context)
        assert texts.text(token, context) == want[0], (i, token)


TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}, "strict": True}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}},
]


@pytest.mark.parametrize(
    ("tool_choice", "parallel"),
    [("required", True), ("required", False), ("auto", True), ("auto", False),
     ({"type": "function", "function": {"name": "get_time"}}, True)],
)
def test_tool_structural_tags_match_vllm(tool_choice: Any, parallel: bool) -> None:
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionRequest as VllmChatRequest,
    )
    from vllm.tool_parsers.structural_tag_registry import (
        get_model_structural_tag,
        limit_to_single_tool_call,
    )
    from vllm.tool_parsers.tool_strict_level import ToolStrictLevel
    from xgrammar.structural_tag import StructuralTag

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
            "tool_choice": tool_choice, "parallel_tool_calls": parallel}
    theirs_req = VllmChatRequest.model_validate(body)
    level = ToolStrictLevel.AUTO if parallel else ToolStrictLevel.FUNCTION
    theirs = get_model_structural_tag("hermes", theirs_req.tools, theirs_req.tool_choice,
                                      reasoning=False, strict_level=level)
    plan = plan_tools(ChatCompletionRequest.model_validate(body), "hermes")
    assert plan is not None
    ours = tool_constraint(plan, None)
    if theirs is None:
        assert ours is None
        return
    if not parallel:
        limit_to_single_tool_call(theirs)
    assert ours is not None and ours.structural_tag is not None
    parsed = StructuralTag.model_validate(json.loads(ours.structural_tag))
    assert parsed.model_dump() == theirs.model_dump()
