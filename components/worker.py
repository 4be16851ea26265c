"""VllmWorker: a decode worker that embeds vLLM's ``AsyncLLM``.

Takes tokenized requests (``PreprocessedRequest``) and streams ``LLMEngineOutput``
token-id deltas. Closing the stream (the caller went away) aborts the request inside
the engine. Its load is exported on the process's ``/metrics`` at scrape time.

Router feeds (``components/kv_router.py`` subscribes to both):

- ``kv_events``: with ``publish-kv-events: true`` vLLM's KV cache events reach a
  ``KvEventRelay`` in this process (bound on 127.0.0.1, vLLM connects); the stream
  is a snapshot of the worker's block set, then net deltas (``RelayBatch``).
- ``load_metrics``: the engine's ``EngineLoad`` every ``load-metrics-interval`` s.

Disaggregated prefill (graph ``graphs/disagg.py`` links ``PrefillWorker``; config
``remote-prefill: true``): per request ``DecodeDisagg.plan`` decides local or remote
(``dynagraph.llm.disagg.policy``); a remote prefill's KV arrives over NIXL through the
``kv_transfer_params`` a ``PrefillWorker`` hands to ``prefill_done``. In the agg graph
``self.prefill`` is None and nothing of this is set up.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from components.prefill_worker import PrefillWorker
from dynagraph.errors import ConfigError, EngineError
from dynagraph.llm.disagg import DecodeDisaggKeys, PrefillResult
from dynagraph.llm.disagg.decode import DecodeDisagg
from dynagraph.llm.engines.base import SamplingSpec
from dynagraph.llm.engines.vllm_engine import VllmEngine, VllmEngineArgs
from dynagraph.llm.kv.relay import KvEventRelay, load_snapshots
from dynagraph.llm.protocol import LLMEngineOutput, PreprocessedRequest
from dynagraph.llm.router.hashing import BlockHasher, seed_from_env
from dynagraph.observability.worker_metrics import register_engine_load
from dynagraph.sdk import (
    Component,
    async_on_shutdown,
    async_on_start,
    depends,
    endpoint,
    service,
)

log = logging.getLogger(__name__)


class VllmWorkerConfig(VllmEngineArgs, DecodeDisaggKeys):
    """The engine's settings (see ``VllmEngineArgs``) and the disaggregation keys (see
    ``DecodeDisaggKeys``); YAML keys in kebab-case."""

    publish_kv_events: bool = False
    """Turn on vLLM's KV events and serve them on ``kv_events`` (for a KV Router)."""
    load_metrics_interval: float = 0.1
    """Seconds between two ``load_metrics`` samples."""


@service(dynamo={"namespace": "dynamo"}, resources={"cpu": 1}, workers=1)
class VllmWorker(Component):
    prefill = depends(PrefillWorker)

    def __init__(self, config: VllmWorkerConfig) -> None:
        self.config = config
        self.disagg = DecodeDisagg.create(config, self.runtime, self.prefill,
                                          config.kv_transfer_config)
        if self.disagg is not None:
            config = self.disagg.engine_args(config)
        self.hasher = BlockHasher(config.block_size, _hash_algo(config),
                                  seed_from_env(os.environ))
        self.relay: KvEventRelay | None = None
        if config.publish_kv_events:
            if config.kv_events_endpoint:
                raise ConfigError("set either publish-kv-events or kv-events-endpoint",
                                  component="VllmWorker", key="publish-kv-events")
            self.relay = KvEventRelay(hasher=self.hasher)
            config = config.model_copy(update={"kv_events_endpoint": self.relay.bind()})
        self.engine = VllmEngine(config)

    @async_on_start
    async def start(self) -> None:
        if self.relay is not None:
            await self.relay.start()
        await self.engine.start()
        if self.disagg is not None:
            await self.disagg.start(self.engine, self.hasher)
        register_engine_load(self.engine.load, worker=f"{self.runtime.instance_id:x}",
                             registry=self.runtime.registry)
        self.runtime.metadata.update(
            {"block_size": self.hasher.block_size, "max_model_len": self.engine.max_model_len,
             "kv_events": self.relay is not None, "kv_hash_algo": self.hasher.algo,
             "kv_hash_seed": self.hasher.seed}
        )
        log.info("engine ready in %.1fs (max_model_len %d)", self.engine.start_seconds,
                 self.engine.max_model_len)

    @async_on_shutdown
    async def stop(self) -> None:
        if self.disagg is not None:
            await self.disagg.stop()
        await self.engine.shutdown()
        if self.relay is not None:
            await self.relay.close()

    @endpoint()
    async def generate(self, request: PreprocessedRequest) -> AsyncIterator[dict[str, Any]]:
        first = True
        kv_params = None
        if self.disagg is not None:
            plan = await self.disagg.plan(request.request_id, request.token_ids,
                                          request.sampling.temperature, request.sampling.seed)
            kv_params = plan.kv_transfer_params
        async for out in self.engine.generate(request.request_id, request.token_ids,
                                              to_sampling_spec(request),
                                              kv_transfer_params=kv_params):
            msg = LLMEngineOutput(token_ids=out.token_ids, finish_reason=out.finish_reason)
            if first or out.finish_reason is not None:
                msg.prompt_tokens = out.num_prompt_tokens
                msg.cached_tokens = out.num_cached_tokens
                first = False
            yield msg.to_wire()

    @endpoint()
    async def prefill_done(self, result: PrefillResult) -> AsyncIterator[dict[str, Any]]:
        """A PrefillWorker hands over a remote prefill's KV transfer parameters."""
        accepted = self.disagg is not None and self.disagg.deliver(result)
        yield {"accepted": accepted}

    @endpoint()
    async def kv_events(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """A snapshot of this worker's cached blocks, then live deltas, until closed."""
        if self.relay is None:
            raise EngineError("this worker does not publish KV events (publish-kv-events)")
        async with self.relay.subscribe() as sub:
            async for batch in sub:
                yield batch.to_wire()

    @endpoint()
    async def load_metrics(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """The engine's load (``EngineLoad``) now and every ``load-metrics-interval`` s."""
        async for load in load_snapshots(self.engine.load, self.config.load_metrics_interval):
            yield load.model_dump()


def _hash_algo(config: VllmEngineArgs) -> Any:
    return config.extra_engine_args.get("prefix_caching_hash_algo", "sha256")


def to_sampling_spec(request: PreprocessedRequest) -> SamplingSpec:
    s = request.sampling
    return SamplingSpec(
        max_tokens=s.max_tokens, min_tokens=s.min_tokens, temperature=s.temperature,
        top_p=s.top_p, seed=s.seed, ignore_eos=s.ignore_eos, stop_token_ids=s.stop_token_ids,
    )
