"""Greedy output through the agg graph equals the same vLLM `AsyncLLM` called directly."""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
import pytest_asyncio
from transformers import AutoTokenizer

from tests.e2e.conftest import MAX_MODEL_LEN

pytestmark = pytest.mark.vllm

PROMPTS = [
    "The module",
    "In the beginning",
    "Tell me about the standard library: ",
    "def main():\n    ",
    "Les éléments 日本語 ✓",
    "A " * 200,
]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def direct_llm(model_dir: Path) -> AsyncIterator[Any]:
    """A plain vLLM AsyncLLM with the settings of configs/agg.yaml's VllmWorker.

    In-process engine core (fast start); the variable is restored at once so that
    processes spawned later by other tests do not inherit it.
    """
    saved = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING",
                                            "VLLM_CPU_KVCACHE_SPACE")}
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1")
    try:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=str(model_dir), block_size=32, max_model_len=MAX_MODEL_LEN,
            enforce_eager=True, seed=0, disable_log_stats=True))
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    try:
        yield llm
    finally:
        await asyncio.wait_for(asyncio.to_thread(llm.shutdown), 60)


async def direct_greedy(llm: Any, prompt_ids: list[int], n: int) -> list[int]:
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
    out: list[int] = []
    async for res in llm.generate(TokensPrompt(prompt_token_ids=prompt_ids), params,
                                  request_id=uuid.uuid4().hex):
        out = list(res.outputs[0].token_ids)
    return out


@pytest.mark.parametrize("prompt", PROMPTS)
async def test_graph_text_equals_direct_engine_tokens(
    prompt: str, direct_llm: Any, base_url: str, model_dir: Path
) -> None:
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok(prompt)["input_ids"]
    expected_ids = await direct_greedy(direct_llm, ids, 48)
    expected = tok.decode(expected_ids, skip_special_tokens=True)
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    stream = await client.completions.create(model="tiny-llama", prompt=ids, max_tokens=48,
                                             temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
    streamed = "".join([c.choices[0].text async for c in stream if c.choices])
    assert streamed == expected
    full = await client.completions.create(model="tiny-llama", prompt=ids, max_tokens=48,
                                           temperature=0, extra_body={"ignore_eos": True})
    assert full.choices[0].text == expected and full.usage.completion_tokens == 48
    await client.close()
