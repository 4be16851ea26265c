"""VllmWorker: a decode worker that embeds vLLM's ``AsyncLLM``.

Takes tokenized requests (``PreprocessedRequest``) and streams ``LLMEngineOutput``
token-id deltas. Closing the stream (the caller went away) aborts the request inside
the engine. Its load is exported on the process's ``/metrics`` at scrape time.

Router feeds (``components/kv_router.py`` subscribes to both):

- ``kv_events``: with ``publish-kv-events: true`` vLLM's KV cache events reach a
  ``KvEventRelay`` in this process (bound on 127.0.0.1, vLLM connects); the stream
  is a snapshot of the worker's block set, then net deltas (``RelayBatch``).
- ``load_metrics``: the engine's ``EngineLoad`` every ``load-metrics-interval`` s.
- ``release``: the Router's rebalancing asks for up to ``count`` of the requests waiting
  for a place in the engine's batch; the newest are handed back (their streams end with
  ``Requeued`` before any output, ``dynagraph.llm.waiting``) and the Processor places
  them again.

Disaggregated prefill (graph ``graphs/disagg.py`` links ``PrefillWorker``; config
``remote-prefill: true``): per request ``DecodeDisagg.plan`` decides local or remote
(``dynagraph.llm.disagg.policy``); a remote prefill's KV arrives over NIXL through the
``kv_transfer_params`` a ``PrefillWorker`` hands to ``prefill_done``. In the agg graph
``self.prefill`` is None and nothing of this is set up.

Attention-FFN disaggregation (graph ``graphs/agg_afd.py`` links ``FfnWorker``): before
the engine starts, ``AfdAttachment`` (``dynagraph.llm.afd.attach``) waits for FfnWorkers
covering every layer, hands their addresses to the engine and switches the model to
its AFD variant (attention here, FFN on the FfnWorkers); it keeps the engine's view of
the FfnWorkers current while serving. Without the link ``self.ffn`` is None.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from components.ffn_worker import FfnWorker
from components.prefill_worker import PrefillWorker
from dynagraph.aio import aclose, cancel_and_wait
from dynagraph.errors import ConfigError, EngineError
from dynagraph.llm.afd.settings import AfdOptions
from dynagraph.llm.disagg import DecodeDisaggKeys, PrefillAck, PrefillResult
from dynagraph.llm.disagg.decode import DecodeDisagg
from dynagraph.llm.disagg.policy import LIVE as DISAGG_LIVE
from dynagraph.llm.disagg.policy import DisaggConfig
from dynagraph.llm.engines.base import Engine, EngineLoad, SamplingSpec
from dynagraph.llm.engines.metrics import register_engine_load
from dynagraph.llm.engines.vllm.args import VllmEngineArgs
from dynagraph.llm.engines.vllm.engine import VllmEngine
from dynagraph.llm.engines.vllm.env import spread_bind
from dynagraph.llm.engines.vllm.kv_config import block_hasher
from dynagraph.llm.kv.events.relay import KvEventFeed, KvEventRelay, load_snapshots
from dynagraph.llm.kv.offload.tier_trim import TierJanitor, tier_janitor
from dynagraph.llm.kv.transfer.tier_handoff import is_shm, offer, tier_name
from dynagraph.llm.models import served_model_metadata
from dynagraph.llm.protocol import (
    LLMEngineOutput,
    PreprocessedRequest,
    Release,
    Released,
    Subscribe,
)
from dynagraph.llm.router.events import RelayBatch
from dynagraph.llm.tenants import Signer, cache_salt_of
from dynagraph.llm.waiting import WaitingRequests
from dynagraph.runtime.live_settings import LiveSpec
from dynagraph.sdk import (
    Component,
    async_on_shutdown,
    async_on_start,
    depends,
    endpoint,
    endpoint_client,
    service,
)

if TYPE_CHECKING:
    from dynagraph.llm.afd.attach import AfdAttachment

log = logging.getLogger(__name__)


class VllmWorkerConfig(VllmEngineArgs, DecodeDisaggKeys):
    """The engine's settings (see ``VllmEngineArgs``) and the disaggregation keys (see
    ``DecodeDisaggKeys``); YAML keys in kebab-case."""

    publish_kv_events: bool = False
    """Turn on vLLM's KV events and serve them on ``kv_events`` (for a KV Router)."""
    load_metrics_interval: float = 0.1
    """Seconds between two ``load_metrics`` samples."""
    afd: AfdOptions = AfdOptions()
    """Attention-FFN disaggregation settings (used when an FfnWorker is linked)."""


class _LoadConfig(Protocol):
    load_metrics_interval: float


class DecodeWorkerEndpoints(Component):
    """The endpoints a decode worker serves besides ``generate`` (VllmWorker, MockerWorker):
    remote-prefill hand-over, KV events for the Router, engine load."""

    LOAD_CHANGES_ONLY: ClassVar[bool] = False
    """``load_metrics`` sends a sample only when it changed (else every interval)."""
    config: _LoadConfig
    disagg: DecodeDisagg | None
    engine: Engine

    def _kv_feed(self) -> KvEventFeed | None:
        raise NotImplementedError

    @property
    def waiting(self) -> WaitingRequests:
        """Requests without output yet, which ``release`` can hand back."""
        found: WaitingRequests | None = self.__dict__.get("_waiting")
        if found is None:
            found = self.__dict__["_waiting"] = WaitingRequests()
        return found

    def _stream(self, request: PreprocessedRequest, kv_params: dict[str, Any] | None,
                salt: str | None) -> AsyncIterator[LLMEngineOutput]:
        """``engine_stream``; a request prefilled here (not remotely: its prefill is
        already paid for elsewhere) can be handed back until its first output."""
        return engine_stream(self.engine, request, kv_params, salt,
                             waiting=self.waiting if kv_params is None else None)

    @endpoint()
    async def release(self, request: Release) -> AsyncGenerator[Released, None]:
        """Hand back up to ``count`` of the requests waiting for a place, the newest first
        (the Router's rebalancing): their streams end with ``Requeued`` before any output
        and the Processor places them again."""
        count = min(request.count, self.engine.load().waiting)
        yield Released(released=len(self.waiting.release(count)))

    @endpoint()
    async def prefill_done(self, result: PrefillResult) -> AsyncGenerator[PrefillAck, None]:
        """A prefill worker hands over a remote prefill's KV transfer parameters."""
        accepted = self.disagg is not None and await self.disagg.deliver(result)
        yield PrefillAck(accepted=accepted)

    @endpoint(drain=False)
    async def kv_events(self, request: Subscribe) -> AsyncGenerator[RelayBatch, None]:
        """A snapshot of this worker's cached blocks, then live deltas, until closed."""
        feed = self._kv_feed()
        if feed is None:
            raise EngineError("this worker does not publish KV events (publish-kv-events)")
        async with feed.subscribe() as sub:
            async for batch in sub:
                yield batch

    @endpoint(drain=False)
    async def load_metrics(self, request: Subscribe) -> AsyncGenerator[EngineLoad, None]:
        """The engine's load every ``load-metrics-interval`` s (with ``LOAD_CHANGES_ONLY``:
        only when it changed)."""
        async for load in load_snapshots(self.engine.load, self.config.load_metrics_interval,
                                         changes_only=self.LOAD_CHANGES_ONLY):
            yield load


@service(dynamo={"namespace": "dynamo"}, resources={"cpu": 1}, workers=1)
class VllmWorker(DecodeWorkerEndpoints):
    config: VllmWorkerConfig
    engine: VllmEngine
    LIVE_SETTINGS: ClassVar[LiveSpec[DisaggConfig]] = DISAGG_LIVE
    """Live only with remote prefill on (the disagg graphs)."""
    prefill = depends(PrefillWorker)
    ffn = depends(FfnWorker)

    def __init__(self, config: VllmWorkerConfig) -> None:
        config = config.model_copy(update={"cpu_threads_bind": spread_bind(
            config.cpu_threads_bind, self.runtime.worker_index, os.cpu_count() or 1)})
        self.config = config
        self.signer = Signer.from_env()
        self.disagg = DecodeDisagg.create(config, self.runtime, self.prefill,
                                          config.kv_transfer_config,
                                          config.kv_transfer_compression)
        if self.disagg is not None:
            config = self.disagg.engine_args(config)
        self.hasher = block_hasher(config)
        self.relay: KvEventRelay | None = None
        if config.publish_kv_events:
            if config.kv_events_endpoint:
                raise ConfigError("set either publish-kv-events or kv-events-endpoint",
                                  component="VllmWorker", key="publish-kv-events")
            self.relay = KvEventRelay(hasher=self.hasher)
            config = config.model_copy(update={"kv_events_endpoint": self.relay.bind()})
        self.engine = VllmEngine(config)
        self.tier_janitor: TierJanitor | None = None
        self.afd: AfdAttachment | None = None
        self._afd_task: asyncio.Task[None] | None = None
        if self.ffn is not None:  # AFD (torch): imported only by a worker that uses it
            from dynagraph.llm.afd.attach import AfdAttachment

            self.afd = AfdAttachment(config.afd, config.model,
                                     endpoint_client(self.ffn.info).instances)

    @async_on_start
    async def start(self) -> None:
        if self.relay is not None:
            await self.relay.start()
        if self.afd is not None:
            self.engine.args = await self.afd.prepare(self.engine.args)
        await self.engine.start()
        if self.afd is not None:
            self._afd_task = asyncio.create_task(self.afd.follow(self._restart_engine),
                                                 name="afd-peers")
        if self.disagg is not None:
            await self.disagg.start(self.engine, self.hasher)
        register_engine_load(self.engine.load, worker=f"{self.runtime.instance_id:x}",
                             registry=self.runtime.registry)
        if self.afd is not None:
            from dynagraph.llm.afd.metrics import register_engine_afd

            register_engine_afd(self.afd.stats, worker=f"{self.runtime.instance_id:x}",
                                registry=self.runtime.registry)
        self.runtime.metadata.update(served_model_metadata(self.config, self.engine.max_model_len))
        self.runtime.metadata.update(
            {"block_size": self.hasher.block_size,
             "kv_events": self.relay is not None, "kv_hash_algo": self.hasher.algo,
             "kv_hash_seed": self.hasher.seed}
        )
        tier = offer(self.config.kv_offload_dir, self.config.kv_compression)
        if tier is not None:  # the Router credits this worker with the tier's blocks
            self.runtime.metadata["kv_tier"] = tier_name(tier)
        self.tier_janitor = tier_janitor(
            self.config.kv_offload_dir, self.config.kv_offload_dir_gib,
            worker=f"{self.runtime.instance_id:x}", registry=self.runtime.registry,
            feed=self.relay)
        if self.tier_janitor is not None:
            self.tier_janitor.start()
        log.info("engine ready in %.1fs (max_model_len %d)", self.engine.start_seconds,
                 self.engine.max_model_len)

    async def _restart_engine(self) -> None:
        """A new engine after the old one died for want of FfnWorkers (AFD)."""
        try:
            await self.engine.shutdown()
        except Exception:  # the dead engine may fail its own shutdown; start anew anyway
            log.exception("shutting the failed engine down")
        await self.engine.start()

    @async_on_shutdown
    async def stop(self) -> None:
        if self.tier_janitor is not None:
            await self.tier_janitor.stop()
        if self.disagg is not None:
            await self.disagg.stop()
        await self.engine.shutdown()
        if self.afd is not None:
            if self._afd_task is not None:
                await cancel_and_wait([self._afd_task])
            self.afd.close()
        if self.relay is not None:
            await self.relay.close()

    @endpoint()
    async def generate(self, request: PreprocessedRequest
                       ) -> AsyncGenerator[LLMEngineOutput, None]:
        kv_params = None
        s = request.sampling
        salt = cache_salt_of(self.signer, request.tenant)
        # Prompt logprobs need the prompt computed here; n > 1 forks one local prefill.
        if self.disagg is not None and s.prompt_logprobs is None and s.n == 1:
            plan = await self.disagg.plan(request.request_id, request.token_ids,
                                          s.temperature, s.seed, salt)
            # the KV in the shared tier: the engine finds it there as for a local prefill
            kv_params = None if is_shm(plan.kv_transfer_params) else plan.kv_transfer_params
        stream = self._stream(request, kv_params, salt)
        try:
            async for msg in stream:
                if (self.afd is not None and msg.finish_reason == "abort"
                        and self.afd.failure() is not None):
                    # the engine restart after an AFD failure aborted it: say why (below)
                    raise EngineError("the engine aborted the request")
                yield msg
        except EngineError as exc:
            if self.afd is None:
                raise
            raise self.afd.explain(exc) from exc  # AFD: name the layer no FfnWorker computes
        finally:
            await aclose(stream)  # a caller gone early aborts the request in the engine now

    def _kv_feed(self) -> KvEventFeed | None:
        return self.relay


async def engine_stream(engine: Engine, request: PreprocessedRequest,
                        kv_params: dict[str, Any] | None, cache_salt: str | None = None,
                        waiting: WaitingRequests | None = None
                        ) -> AsyncIterator[LLMEngineOutput]:
    """``request`` through ``engine``, as the ``generate`` endpoint's wire messages
    (``LLMEngineOutput``; prompt and cached token counts on the first and last).
    With ``waiting``, the request can be handed back until its first output
    (``Requeued``)."""
    first = True
    outs = engine.generate(request.request_id, request.token_ids,
                           to_sampling_spec(request, cache_salt),
                           kv_transfer_params=kv_params)
    try:
        out: Any = None
        if waiting is not None:
            try:
                out = await waiting.first(request.request_id, outs)
            except StopAsyncIteration:
                return
        while True:
            if out is None:
                try:
                    out = await anext(outs)
                except StopAsyncIteration:
                    return
            msg = LLMEngineOutput(token_ids=out.token_ids, finish_reason=out.finish_reason)
            if out.index or out.logprobs is not None or out.prompt_logprobs is not None:
                msg.index, msg.logprobs = out.index, out.logprobs
                msg.prompt_logprobs = out.prompt_logprobs
            if first or out.finish_reason is not None:
                msg.prompt_tokens = out.num_prompt_tokens
                msg.cached_tokens = out.num_cached_tokens
                first = False
            out = None
            yield msg
    finally:
        await aclose(outs)  # closing early aborts the request in the engine, now


def to_sampling_spec(request: PreprocessedRequest, cache_salt: str | None = None
                     ) -> SamplingSpec:
    s = request.sampling
    return SamplingSpec(
        cache_salt=cache_salt,
        priority=request.tenant.priority if request.tenant is not None else 0,
        max_tokens=s.max_tokens, min_tokens=s.min_tokens, temperature=s.temperature,
        top_p=s.top_p, top_k=s.top_k if s.top_k > 0 else None, min_p=s.min_p, seed=s.seed,
        ignore_eos=s.ignore_eos, stop_token_ids=s.stop_token_ids,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        repetition_penalty=s.repetition_penalty, logit_bias=s.logit_bias,
        bad_words=s.bad_words, allowed_token_ids=s.allowed_token_ids, n=s.n,
        logprobs=s.logprobs, prompt_logprobs=s.prompt_logprobs,
        structured_outputs=(None if s.structured_outputs is None
                            else s.structured_outputs.to_wire()),
    )
