"""Greedy token ids from a plain vLLM ``AsyncLLM``, in a process of its own.

    python -m tests.e2e.direct_greedy MODEL_DIR MAX_MODEL_LEN N < prompts.json > ids.json

Reads a JSON list of token-id prompts on stdin, prints a JSON list of generated id lists.
The engine runs in its own process so that the test process never hosts vLLM's engine
(an in-process engine hung at shutdown when other async clients had run before it).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid


async def run(model: str, max_model_len: int, n: int, prompts: list[list[int]]) -> list[list[int]]:
    from vllm import AsyncEngineArgs, SamplingParams, TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=model, block_size=32, max_model_len=max_model_len, enforce_eager=True, seed=0,
        disable_log_stats=True))
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False)
    try:
        out: list[list[int]] = []
        for ids in prompts:
            last: list[int] = []
            async for res in llm.generate(TokensPrompt(prompt_token_ids=ids), params,
                                          request_id=uuid.uuid4().hex):
                last = list(res.outputs[0].token_ids)
            out.append(last)
        return out
    finally:
        llm.shutdown()


def main() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model, max_model_len, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    prompts = json.load(sys.stdin)
    result = asyncio.run(run(model, max_model_len, n, prompts))
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    os._exit(0)  # skip finalization of vLLM/torch objects


if __name__ == "__main__":
    main()
