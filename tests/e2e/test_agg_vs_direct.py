"""Greedy output through the agg graph equals the same vLLM `AsyncLLM` called directly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from transformers import AutoTokenizer

from tests.e2e.conftest import MAX_MODEL_LEN
from tests.support.serve import REPO

pytestmark = pytest.mark.vllm

N_TOKENS = 48
PROMPTS = [
    "The module",
    "In the beginning",
    "Tell me about the standard library: ",
    "def main():\n    ",
    "Les éléments 日本語 ✓",
    "A " * 200,
]


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.fixture(scope="module")
def direct(model_dir: Path, tokenizer) -> dict[str, list[int]]:  # type: ignore[no-untyped-def]
    """prompt -> greedy ids from a directly driven AsyncLLM with the agg worker's settings."""
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    out = subprocess.run(
        [sys.executable, "-m", "tests.e2e.direct_greedy", str(model_dir), str(MAX_MODEL_LEN),
         str(N_TOKENS)],
        input=json.dumps(prompts), capture_output=True, text=True, cwd=REPO, timeout=600,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    ids = json.loads(out.stdout.strip().splitlines()[-1])
    return dict(zip(PROMPTS, ids, strict=True))


@pytest.mark.parametrize("prompt", PROMPTS)
async def test_graph_text_equals_direct_engine_tokens(
    prompt: str, direct: dict[str, list[int]], base_url: str, tokenizer  # type: ignore[no-untyped-def]
) -> None:
    ids = tokenizer(prompt)["input_ids"]
    expected = tokenizer.decode(direct[prompt], skip_special_tokens=True)
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    try:
        stream = await client.completions.create(
            model="tiny-llama", prompt=ids, max_tokens=N_TOKENS, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        streamed = "".join([c.choices[0].text async for c in stream if c.choices])
        assert streamed == expected
        full = await client.completions.create(
            model="tiny-llama", prompt=ids, max_tokens=N_TOKENS, temperature=0,
            extra_body={"ignore_eos": True})
        assert full.choices[0].text == expected
        assert full.usage.completion_tokens == N_TOKENS
    finally:
        await client.close()
