"""VllmWorker: a decode worker that embeds vLLM's ``AsyncLLM``.

Takes tokenized requests (``PreprocessedRequest``) and streams ``LLMEngineOutput``
token-id deltas. Closing the stream (the caller went away) aborts the request inside
the engine. Its load is exported on the process's ``/metrics`` at scrape time.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from dynagraph.llm.engines.base import SamplingSpec
from dynagraph.llm.engines.vllm_engine import VllmEngine, VllmEngineArgs
from dynagraph.llm.protocol import LLMEngineOutput, PreprocessedRequest
from dynagraph.llm.worker_metrics import register_engine_load
from dynagraph.sdk import async_on_shutdown, async_on_start, endpoint, service

log = logging.getLogger(__name__)


class VllmWorkerConfig(VllmEngineArgs):
    """The engine's settings (see ``VllmEngineArgs``); YAML keys in kebab-case."""


@service(dynamo={"namespace": "dynamo"}, resources={"cpu": 1}, workers=1)
class VllmWorker:
    def __init__(self, config: VllmWorkerConfig) -> None:
        self.config = config
        self.engine = VllmEngine(config)

    @async_on_start
    async def start(self) -> None:
        await self.engine.start()
        register_engine_load(self.engine.load, worker=f"{self.runtime.instance_id:x}")
        self.runtime.metadata.update(
            {"block_size": self.config.block_size, "max_model_len": self.engine.max_model_len}
        )
        log.info("engine ready in %.1fs (max_model_len %d)", self.engine.start_seconds,
                 self.engine.max_model_len)

    @async_on_shutdown
    async def stop(self) -> None:
        await self.engine.shutdown()

    @endpoint()
    async def generate(self, request: PreprocessedRequest) -> AsyncIterator[dict[str, Any]]:
        first = True
        async for out in self.engine.generate(request.request_id, request.token_ids,
                                              to_sampling_spec(request)):
            msg = LLMEngineOutput(token_ids=out.token_ids, finish_reason=out.finish_reason)
            if first or out.finish_reason is not None:
                msg.prompt_tokens = out.num_prompt_tokens
                msg.cached_tokens = out.num_cached_tokens
                first = False
            yield msg.to_wire()


def to_sampling_spec(request: PreprocessedRequest) -> SamplingSpec:
    s = request.sampling
    return SamplingSpec(
        max_tokens=s.max_tokens, min_tokens=s.min_tokens, temperature=s.temperature,
        top_p=s.top_p, seed=s.seed, ignore_eos=s.ignore_eos, stop_token_ids=s.stop_token_ids,
    )
