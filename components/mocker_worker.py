"""MockerWorker: a decode worker on the simulated engine (``dynagraph.llm.engines.mocker``).

A drop-in for ``VllmWorker`` (``@service(stands_in_for=VllmWorker)``: linked instead of
it, it receives the Processor's and the Router's ``depends(VllmWorker)`` edges). Same
endpoints and wire messages, so the Processor, Router and disaggregation path cannot
tell the difference:

- ``generate``: ``PreprocessedRequest`` in, ``LLMEngineOutput`` token-id deltas out
  (the shared ``engine_stream``); closing the stream aborts the request in the engine.
- ``kv_events``: with ``publish-kv-events: true`` the engine's KV events
  (``MockerEngine(on_kv_events=...)``, the same block hashes vLLM publishes) feed a
  ``KvEventFeed``: a snapshot of the block set, then net deltas (``RelayBatch``).
- ``load_metrics``: ``EngineLoad`` sampled every ``load-metrics-interval`` s, sent only
  when it changed (an idle engine's stream is quiet; 256 idle engines do not send 2,560
  messages a second to the Router).
- ``release``: as VllmWorker's (requests waiting for a place handed back on the Router's
  request).
- ``prefill_done``: a ``MockerPrefillWorker`` hands over a remote prefill (graph
  ``graphs/mocker_disagg.py``, ``remote-prefill: true``); the engine then waits the
  simulated transfer (``kv-transfer-bandwidth-gbps``) and counts it in
  ``dynamo_worker_kv_transfer_*``. When the transfer is done the prefill worker is told
  (its ``kv_fetched`` endpoint) to free the blocks it held, as NIXL's notification does.

Discovery metadata: the served model (``model``, ``model_path``, ``max_model_len``; no
logprobs, no structured outputs), ``block_size``, ``kv_events``, ``kv_hash_algo``,
``kv_hash_seed`` as VllmWorker's, plus ``engine: mocker`` and ``profile``. Sampling
options the mocker cannot honour (``n`` > 1, logprobs, structured outputs, token
constraints) are refused with ``InvalidRequest`` by the engine.

``engines-per-process: N`` runs N engines in one process, each its own instance (own
lease, instance id, request-plane server; see ``dynagraph.sdk._process``). ``model``
names the served model's directory: output token ids are drawn from its tokenizer's
vocabulary without its special tokens, so the Processor detokenizes them as usual
(no weights are read).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncGenerator
from typing import Any, ClassVar

from pydantic import Field

from components.mocker_prefill_worker import KV_FETCHED_ENDPOINT, KvFetched
from components.prefill_worker import PrefillWorker
from components.worker import DecodeWorkerEndpoints, VllmWorker
from dynagraph.errors import RequestPlaneError
from dynagraph.llm.disagg import DecodeDisaggKeys
from dynagraph.llm.disagg.decode import DecodeDisagg
from dynagraph.llm.disagg.policy import LIVE as DISAGG_LIVE
from dynagraph.llm.disagg.policy import DisaggConfig
from dynagraph.llm.engines.metrics import register_engine_load
from dynagraph.llm.engines.mocker import KvTransferRegistry, MockerEngine, MockerEngineArgs
from dynagraph.llm.engines.mocker.serving import engine_args
from dynagraph.llm.kv.events.relay import KvEventFeed
from dynagraph.llm.protocol import LLMEngineOutput, PreprocessedRequest
from dynagraph.llm.router.events import KvEvent
from dynagraph.llm.tenants import Signer, cache_salt_of
from dynagraph.runtime.live_settings import LiveSpec
from dynagraph.sdk import (
    async_on_shutdown,
    async_on_start,
    depends,
    direct,
    endpoint,
    service,
)

log = logging.getLogger(__name__)

RELEASE_TIMEOUT_S = 2.0
"""Upper bound on telling a prefill worker its blocks were fetched (its lease is the
fallback: it frees them after ``kv-lease-seconds`` anyway)."""


class MockerWorkerConfig(MockerEngineArgs, DecodeDisaggKeys):
    """The simulated engine's settings (``MockerEngineArgs``), the disaggregation keys
    (``DecodeDisaggKeys``; ``nixl-progress-delay-us`` has no effect here) and the worker's;
    kebab-case in YAML."""

    model: str | None = None
    """Model directory whose tokenizer gives the output vocabulary (sets ``vocab-size``
    and excludes its special tokens); no weights are read. Published for model discovery
    like VllmWorker's (the Processor tokenizes with it)."""
    served_model_name: str | None = None
    """The model name clients ask for (default: the model directory's name)."""
    publish_kv_events: bool = False
    """Serve the engine's KV events on ``kv_events`` (for a KV Router)."""
    load_metrics_interval: float = Field(default=0.1, gt=0)
    """Seconds between two samples of the engine's load (sent when changed)."""
    engines_per_process: int = Field(default=1, ge=1, le=1024)
    """Engines one process runs, each its own instance in discovery."""


@service(dynamo={"namespace": "dynamo"}, resources={"cpu": 1}, workers=1,
         stands_in_for=VllmWorker, instances_key="engines-per-process")
class MockerWorker(DecodeWorkerEndpoints):
    config: MockerWorkerConfig
    engine: MockerEngine
    LOAD_CHANGES_ONLY = True  # 256 simulated engines: only changes go to the Router
    LIVE_SETTINGS: ClassVar[LiveSpec[DisaggConfig]] = DISAGG_LIVE
    """Live only with remote prefill on (``graphs.mocker_disagg``), as VllmWorker's."""
    prefill = depends(PrefillWorker)

    def __init__(self, config: MockerWorkerConfig) -> None:
        self.config = config
        self.signer = Signer.from_env()
        self.feed = KvEventFeed() if config.publish_kv_events else None
        self.disagg = DecodeDisagg.create_simulated(config, self.runtime, self.prefill)
        self._producers: dict[str, int] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.engine = MockerEngine(
            engine_args(config, f"{self.runtime.component}-{self.runtime.instance_id:x}"),
            on_kv_events=self._on_kv_events if self.feed is not None else None,
            registry=_ReleasingRegistry(self._release_remote))

    @async_on_start
    async def start(self) -> None:
        await self.engine.start()
        if self.disagg is not None:
            await self.disagg.start(self.engine, self.engine.hasher)
        rt = self.runtime
        register_engine_load(self.engine.load, worker=f"{rt.instance_id:x}",
                             registry=rt.registry)
        hasher = self.engine.hasher
        rt.metadata.update(model_metadata(self.config, self.engine.max_model_len))
        rt.metadata.update(
            {"block_size": hasher.block_size, "max_model_len": self.engine.max_model_len,
             "kv_events": self.feed is not None, "kv_hash_algo": hasher.algo,
             "kv_hash_seed": hasher.seed, "engine": "mocker",
             "profile": self.engine.profile.name})
        log.debug("mocker engine %s ready: %d blocks of %d tokens", self.engine.engine_id,
                  self.engine.num_blocks, hasher.block_size)

    @async_on_shutdown
    async def stop(self) -> None:
        if self.disagg is not None:
            await self.disagg.stop()
        await self.engine.shutdown()
        if self.feed is not None:
            self.feed.end()
        for task in list(self._tasks):
            task.cancel()

    @endpoint()
    async def generate(self, request: PreprocessedRequest
                       ) -> AsyncGenerator[LLMEngineOutput, None]:
        kv_params = None
        salt = cache_salt_of(self.signer, request.tenant)
        if self.disagg is not None:
            plan = await self.disagg.plan(request.request_id, request.token_ids,
                                          request.sampling.temperature, request.sampling.seed,
                                          salt)
            kv_params = plan.kv_transfer_params
            if plan.result is not None and kv_params is not None:
                self._producers[str(kv_params.get("remote_engine_id"))] = (
                    plan.result.prefill_instance)
        async for msg in self._stream(request, kv_params, salt):
            yield msg

    def _kv_feed(self) -> KvEventFeed | None:
        return self.feed

    def _on_kv_events(self, events: list[KvEvent]) -> None:
        assert self.feed is not None
        self.feed.publish(events)

    # -- freeing the producer's blocks once their simulated transfer is done ------------

    def _release_remote(self, engine_id: str, request_id: str) -> None:
        instance = self._producers.get(engine_id)
        if instance is None or self.prefill is None:
            return  # not ours to tell: the producer's lease frees the blocks
        task = asyncio.create_task(self._tell_fetched(instance, request_id),
                                   name=f"kv-fetched-{request_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _tell_fetched(self, instance: int, request_id: str) -> None:
        # an endpoint of the stand-in (MockerPrefillWorker), not of PrefillWorker: by name
        kv_fetched = getattr(self.prefill, KV_FETCHED_ENDPOINT)
        try:
            async with asyncio.timeout(RELEASE_TIMEOUT_S):
                stream = direct(kv_fetched, KvFetched(request_id=request_id), instance)
                async with contextlib.aclosing(stream):
                    async for _ in stream:
                        pass
        except (RequestPlaneError, TimeoutError) as exc:
            log.debug("could not tell prefill worker %x that %s was fetched (its lease "
                      "frees the blocks): %s", instance, request_id, exc)


def model_metadata(config: MockerWorkerConfig, max_model_len: int) -> dict[str, Any]:
    """Model discovery (``dynagraph.llm.models``): the served model, as VllmWorker
    publishes it; no ``max_logprobs`` and no structured outputs (the mocker has neither).
    Nothing without a ``model``: the worker then serves the deployment's default name."""
    if config.model is None:
        return {}
    return {"model": config.served_model_name or os.path.basename(os.path.normpath(config.model)),
            "model_path": config.model, "max_model_len": max_model_len,
            "structured_outputs": False}


class _ReleasingRegistry(KvTransferRegistry):
    """Producers in this process are told directly; others through ``remote``."""

    def __init__(self, remote: Any) -> None:
        super().__init__()
        self._remote = remote

    def fetched(self, engine_id: str, request_id: str) -> bool:
        if engine_id in self:
            return super().fetched(engine_id, request_id)
        self._remote(engine_id, request_id)
        return True
