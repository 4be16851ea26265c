"""VllmEngine's sampling and output options against the real engine: n, logprobs,
prompt logprobs, penalties, logit bias, structured outputs, and refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from dynagraph.errors import InvalidRequest
from dynagraph.llm.engines import SamplingSpec
from dynagraph.llm.engines.vllm.engine import VllmEngine
from tests.vllm.test_vllm_engine import collect, prompt, tokens

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


async def test_n_choices_come_back_indexed_and_finish_each(vllm_engine: VllmEngine) -> None:
    spec = SamplingSpec(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, n=3)
    outs = await collect(vllm_engine, prompt(20, salt=11), spec)
    by_index = {i: [t for o in outs if o.index == i for t in o.token_ids] for i in range(3)}
    assert all(len(ids) == 6 for ids in by_index.values())
    assert sorted(o.index for o in outs if o.finish_reason == "length") == [0, 1, 2]
    assert len({tuple(ids) for ids in by_index.values()}) > 1


async def test_logprobs_follow_the_tokens(vllm_engine: VllmEngine) -> None:
    spec = SamplingSpec(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2,
                        prompt_logprobs=1)
    ids = prompt(12, salt=12)
    outs = await collect(vllm_engine, ids, spec)
    positions = [p for o in outs for p in (o.logprobs or [])]
    assert len(positions) == len(tokens(outs)) == 5
    for token, (alt_ids, lps) in zip(tokens(outs), positions, strict=True):
        # The sampled token, then the top 2; vLLM lists an id once when the sampled token
        # ties with a top one (seen 1 run in 6 with bf16 logits): 2 or 3 entries.
        assert alt_ids[0] == token and len(alt_ids) == len(lps) and len(alt_ids) in (2, 3)
        assert lps[0] == pytest.approx(max(lps))  # greedy picked the top token
    prompt_lp = outs[0].prompt_logprobs
    assert prompt_lp is not None and len(prompt_lp) == len(ids) and prompt_lp[0] is None
    for token, entry in zip(ids[1:], prompt_lp[1:], strict=True):
        assert entry is not None and entry[0][0] == token and entry[2][0] >= 1
    assert all(o.prompt_logprobs is None for o in outs[1:])


async def test_logit_bias_and_repetition_penalty(vllm_engine: VllmEngine) -> None:
    ids = prompt(16, salt=13)
    forced = await collect(vllm_engine, ids, SamplingSpec(
        temperature=0.0, max_tokens=4, ignore_eos=True, logit_bias={777: 100.0}))
    assert tokens(forced) == [777] * 4
    penalized = await collect(vllm_engine, ids, SamplingSpec(
        temperature=0.0, max_tokens=4, ignore_eos=True, logit_bias={777: 100.0},
        repetition_penalty=1e6))
    assert tokens(penalized)[0] == 777 and 777 not in tokens(penalized)[1:]


async def test_structured_outputs_constrain_the_tokens(
        vllm_engine: VllmEngine, model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = prompt(10, salt=14)
    free = tokenizer.decode(tokens(await collect(vllm_engine, ids, SamplingSpec(
        temperature=0.0, max_tokens=10))), skip_special_tokens=True)
    assert free not in ("alpha", "beta")  # the constraint, not the model, picks the text
    spec = SamplingSpec(temperature=0.0, max_tokens=10,
                        structured_outputs={"choice": ["alpha", "beta"]})
    outs = await collect(vllm_engine, ids, spec)
    assert outs[-1].finish_reason == "stop"
    assert tokenizer.decode(tokens(outs), skip_special_tokens=True) in ("alpha", "beta")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    outs = await collect(vllm_engine, ids, SamplingSpec(
        temperature=0.0, max_tokens=40, structured_outputs={"json": json.dumps(schema)}))
    text = tokenizer.decode(tokens(outs), skip_special_tokens=True)
    if outs[-1].finish_reason == "stop":  # a finished JSON text of the schema's shape
        value = json.loads(text)
        assert set(value) == {"n"} and isinstance(value["n"], int), text
    else:  # ran out of tokens inside it: a prefix of such a text
        assert text.lstrip().startswith("{"), text


async def test_refusals_name_the_parameter(vllm_engine: VllmEngine) -> None:
    with pytest.raises(InvalidRequest):
        await collect(vllm_engine, prompt(8), SamplingSpec(temperature=0.0, max_tokens=2, n=2))
    with pytest.raises(InvalidRequest) as exc:
        await collect(vllm_engine, prompt(8), SamplingSpec(max_tokens=2, logprobs=50))
    assert exc.value.param == "logprobs"
    bad = {"json": json.dumps({"type": "object", "properties": {"a": {"type": "nope"}}})}
    with pytest.raises(InvalidRequest):
        await collect(vllm_engine, prompt(8), SamplingSpec(max_tokens=2,
                                                           structured_outputs=bad))
