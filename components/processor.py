"""Processor: OpenAI request in, text chunks out.

Applies the chat template (with tools) and tokenizes (``Preprocessor``), resolves every
sampling and output option (``RequestPlan``), picks a worker of the request's model,
streams the worker's token ids back through the incremental detokenizer (stop strings,
finish reason, usage) and yields ``TextChunk``s to the Frontend. Requests that ask for
more than text (``n``, logprobs, echo, tool calls, several prompts) go through the
``ResponseAssembler``; plain ones through the detokenizer alone.

Models: every model the live workers publish (``dynagraph.llm.models``) is served;
a request goes only to workers of its ``model``, tokenized with that model's
tokenizer (``PreprocessorCache``). The ``tokenize`` endpoint answers ``/tokenize`` and
``/detokenize``.

Picking a worker (``router-mode``):

- ``round-robin`` / ``random``: among live workers, here in the Processor.
- ``kv`` / ``kv-load``: ask the Router (``components/kv_router.py``, linked in the
  ``*_router`` graphs) with the prompt's token ids, then call the chosen worker with
  ``direct()``. The Router's stream stays open until the request ends, so the Router
  counts it as in flight. The mode is passed as a default: a mode set live in etcd
  (``/{ns}/settings/Router/mode``) wins. If the Router is not linked, fails or does
  not answer within ``router-timeout`` s, the request goes round robin; if the chosen
  worker fails before its first output (dead, unreachable), the next live worker is
  tried (logged; the client sees no error).

SLO-aware admission (``slo-admission``; needs the Router): a request of a deferrable class
(``batch``) asks the Router with an admission gate; the Router judges the candidates'
pressure (``dynagraph.llm.tenants.slo_admission``) and counts the request only if it
admits it, in one step. Deferrable requests take turns and wait here
(``dynagraph.llm.tenants.turns``); past their limit they are refused with 429 and
``Retry-After``. Other classes are always sent on. Only a request's first dispatch is
judged, never a migration.

Migration (``dynagraph.llm.migration``): a worker stream that breaks after output has
started continues on another worker of the model (prompt + tokens already sent), up to
``migration-limit`` times per request; then the client gets an error, never a short
answer. Where a worker could not be reached and every live worker has failed the
request (the only one died), it first waits up to ``migration-wait`` seconds for another
to register (its restart).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Literal

import msgspec
from pydantic import Field

from components.kv_router import Router
from components.worker import VllmWorker
from dynagraph.config import ConfigModel
from dynagraph.errors import (
    ConfigError,
    InstanceUnavailable,
    InvalidRequest,
    NoInstancesError,
    RequestPlaneError,
    StreamBroken,
)
from dynagraph.llm.api.tools import TOOL_PARSERS
from dynagraph.llm.coalesce import merge_outputs
from dynagraph.llm.detokenize import detokenize_stream
from dynagraph.llm.http.limits import prompt_text_bytes
from dynagraph.llm.migration import Attempt, continuation, migrating
from dynagraph.llm.model_tokenizers import ModelContext, PreprocessorCache
from dynagraph.llm.models import ModelDirectory, ServedModel
from dynagraph.llm.postprocess import ResponseAssembler, assemble_stream
from dynagraph.llm.processor_metrics import ProcessorMetrics
from dynagraph.llm.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    LLMEngineOutput,
    OpenAIRequestEnvelope,
    PreprocessedRequest,
    TextChunk,
    TokenizeAnswer,
    TokenizeEnvelope,
    TokenizeRequest,
    TokenizeResponse,
)
from dynagraph.llm.router import RouteDecision, RouteRequest, RouterMode
from dynagraph.llm.tenants import Signer, TenantToken, verified
from dynagraph.llm.tenants.slo import SloClass, default_slo_classes
from dynagraph.llm.tenants.slo_admission import SloAdmissionConfig
from dynagraph.llm.tenants.turns import AdmissionTurns
from dynagraph.runtime.round_robin import RoundRobin
from dynagraph.sdk import (
    Component,
    depends,
    direct,
    endpoint,
    failover,
    instance_ids,
    instances,
    service,
)

log = logging.getLogger(__name__)

INLINE_PROMPT_BYTES = 16 * 1024
"""Larger prompts are templated and tokenized in a worker thread: a huge prompt must not
stall every other request on this event loop (a thread costs ~50 us, a small prompt less)."""


WORKER_POLL_S = 0.1
"""How often a request waiting for a worker (``migration-wait``) looks at discovery."""


class ProcessorConfig(ConfigModel):
    model: str
    """Model directory: the tokenizer and chat template come from here."""
    max_model_len: int | None = Field(default=None, ge=16)
    """Context length (prompt + completion); longer prompts are refused with 400."""
    router_mode: Literal["round-robin", "random", "kv", "kv-load"] = "round-robin"
    router_timeout: float = Field(default=2.0, gt=0.0)
    """Seconds to wait for the Router's decision before falling back to round robin."""
    migration_limit: int = Field(default=3, ge=0)
    """How many times one request may move to another worker after its worker failed
    mid-stream (``dynagraph.llm.migration``); 0 turns migration off."""
    migration_wait: float = Field(default=10.0, ge=0.0)
    """Seconds a request whose worker could not be reached waits for a live worker that has
    not failed it (say the restart of the only one) before it tries again anyway (as the
    Frontend's ``worker-wait`` for a new request)."""
    served_model_name: str | None = None
    """The model name of workers that publish none (engines from before model discovery)."""
    tool_call_parser: str | None = None
    """Parses tool calls from model output (``hermes``); unset, requests with tools get
    plain text and tool_choice auto/required/named is refused."""
    chat_template: str | None = None
    """A Jinja chat template file used instead of the model's own (vLLM's --chat-template)."""
    slo_classes: dict[str, SloClass] = Field(default_factory=default_slo_classes)
    """The SLO classes (as the Frontend's ``slo-classes``: share it via common-configs)."""
    slo_admission: SloAdmissionConfig = Field(default_factory=SloAdmissionConfig)
    """Delay, then shed, deferrable classes under pressure (needs router-mode kv/kv-load)."""


@service(dynamo={"namespace": "dynamo"}, resources={"cpu": 1}, workers=1)
class Processor(Component):
    router = depends(Router)
    worker = depends(VllmWorker)

    def __init__(self, config: ProcessorConfig) -> None:
        self.config = config
        if config.tool_call_parser is not None and config.tool_call_parser not in TOOL_PARSERS:
            raise ConfigError(f"unknown tool-call parser {config.tool_call_parser!r} "
                              f"(known: {', '.join(TOOL_PARSERS)})", component="Processor",
                              key="tool-call-parser")
        template = None
        if config.chat_template is not None:
            try:
                template = Path(config.chat_template).read_text()
            except OSError as exc:
                raise ConfigError(f"cannot read the chat template: {exc}",
                                  component="Processor", key="chat-template") from exc
        self.preprocessors = PreprocessorCache(config.model, max_model_len=config.max_model_len,
                                               tool_parser=config.tool_call_parser,
                                               chat_template=template)
        self._models = ModelDirectory(config.served_model_name)
        self._rr = RoundRobin()
        self._rng = random.Random()
        self.metrics = ProcessorMetrics(self.runtime.registry)
        self.signer = Signer.from_env()
        try:
            self.turns = AdmissionTurns(config.slo_admission, config.slo_classes, self.metrics)
        except ConfigError as exc:
            raise ConfigError(str(exc), component="Processor", key="slo-admission") from None
        self.use_router = config.router_mode in ("kv", "kv-load")
        if self.use_router and self.router is None:
            log.warning("router-mode %s needs a Router in the graph; routing round robin",
                        config.router_mode)
            self.use_router = False

    @endpoint()
    async def generate(self, request: OpenAIRequestEnvelope) -> AsyncGenerator[TextChunk, None]:
        timer = self.metrics.request()
        try:
            tenant = verified(self.signer, request.tenant)
            req = request.unwrap()
            ctx = await self._context(req.model)
            with timer.tokenizing():
                if prompt_text_bytes(req) > INLINE_PROMPT_BYTES:  # keep the loop responsive
                    plan = await asyncio.to_thread(ctx.preprocessor.plan, req,
                                                   request.request_id)
                else:
                    plan = ctx.preprocessor.plan(req, request.request_id)
            candidates = partial(self._workers_of, ctx.model.name)
            if plan.plain:
                pre = plan.prompts[0].request
                detok = timer.timed(ctx.preprocessor.detokenizer(pre))
                if request.resume is not None:  # another Processor began it
                    detok.resume(request.resume)
                    pre = continuation(pre, request.resume.token_ids, "resumed")
                timer.dispatched()
                stream = self._dispatch(pre, candidates, tenant,
                                        resumed=request.resume is not None)
                async with contextlib.aclosing(detokenize_stream(detok, stream)) as chunks:
                    async for chunk in chunks:
                        yield chunk
                return
            if request.resume is not None:
                raise InvalidRequest("only a plain request (one choice; no logprobs, tools or "
                                     "echo) can resume on another Processor", param="resume")
            assembler = timer.timed(ResponseAssembler(ctx.preprocessor.tokenizer, ctx.texts,
                                                      plan))
            timer.dispatched()
            streams = [self._dispatch(p.request, candidates, tenant) for p in plan.prompts]
            async with contextlib.aclosing(assemble_stream(assembler, streams)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            timer.finished()

    @endpoint()
    async def tokenize(self, request: TokenizeEnvelope) -> AsyncGenerator[TokenizeAnswer, None]:
        """``/tokenize`` and ``/detokenize`` for the model the body names."""
        pre = (await self._context(request.model)).preprocessor
        if request.kind == "detokenize":
            ids = pre.checked_token_ids(DetokenizeRequest.model_validate(request.body).tokens,
                                        "tokens")
            yield TokenizeAnswer(detokenized=DetokenizeResponse(
                prompt=pre.tokenizer.decode(ids, skip_special_tokens=False)))
            return
        tok = TokenizeRequest.model_validate(request.body)
        ids = pre.tokenize(tok)
        strs = None
        if tok.return_token_strs:
            strs = [pre.tokenizer.backend.id_to_token(i) or "" for i in ids]
        yield TokenizeAnswer(tokenized=TokenizeResponse(
            count=len(ids), max_model_len=pre.max_model_len or 0, tokens=ids, token_strs=strs))

    def _served(self) -> dict[str, ServedModel]:
        return self._models.models(instances(self.worker.generate))

    async def _context(self, name: str) -> ModelContext:
        models = self._served()
        deadline = asyncio.get_running_loop().time() + 2.0
        while not models and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)  # right after start-up the watch may lag etcd
            models = self._served()
        model = models.get(name)
        if model is None:
            if not models:
                raise NoInstancesError("no model worker is registered")
            raise InvalidRequest(f"the model {name!r} does not exist; served: "
                                 f"{', '.join(models)}", param="model", code="model_not_found")
        return await self.preprocessors.get(model)

    def _workers_of(self, model: str) -> tuple[int, ...]:
        """The model's live workers now (a migration also finds workers that joined since)."""
        served = self._served().get(model)
        return served.instance_ids if served is not None else ()

    def _dispatch(self, pre: PreprocessedRequest, candidates: Callable[[], tuple[int, ...]],
                  tenant: TenantToken | None = None, *, resumed: bool = False
                  ) -> AsyncGenerator[LLMEngineOutput, None]:
        """The worker stream for ``pre`` on ``candidates()`` (the live workers of its model,
        asked per attempt), continued on another of them if its worker fails mid-stream.
        ``resumed``: ``pre`` continues output the client already has (no admission, no
        prompt counts from the worker)."""
        if tenant is not None:
            pre = msgspec.structs.replace(pre, tenant=tenant)
        first = not resumed

        def attempt(req: PreprocessedRequest, at: Attempt) -> AsyncGenerator[LLMEngineOutput, None]:
            nonlocal first
            judged, first = first, False
            if self.use_router:
                return self._routed(req, candidates(), at, admission=judged)
            return self._first_reachable(req, None, candidates(), at)

        async def before_retry(at: Attempt, failure: Exception) -> None:
            if isinstance(failure, InstanceUnavailable):  # unreachable: it is gone
                await self._worker_besides(at.failures, candidates)

        return migrating(pre, attempt, limit=self.config.migration_limit,
                         on_migrate=self.metrics.migrated, continued=resumed,
                         before_retry=before_retry)

    async def _worker_besides(self, failed: list[int],
                              candidates: Callable[[], tuple[int, ...]]) -> None:
        """Wait until a live worker not in ``failed`` is registered, at most
        ``migration-wait`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.migration_wait
        while loop.time() < deadline:
            if any(w not in failed for w in candidates()):
                return
            await asyncio.sleep(WORKER_POLL_S)

    async def _routed(self, pre: PreprocessedRequest, candidates: tuple[int, ...],
                      attempt: Attempt, *, admission: bool = False
                      ) -> AsyncGenerator[LLMEngineOutput, None]:
        """The worker's stream for ``pre``, on the worker the Router picks; with
        ``admission``, once SLO-aware admission lets it through (``RequestShed`` if not)."""
        allowed = attempt.allowed(candidates)
        slo_class = pre.tenant.slo_class if pre.tenant is not None else "default"
        # every live worker allowed (one model, none failed): say "any", not every id
        workers = (None if len(allowed) == len(instance_ids(self.worker.generate))
                   else allowed)
        ask = RouteRequest(pre.token_ids, track=True, mode=RouterMode(self.config.router_mode),
                           tenant=pre.tenant, workers=workers,
                           slo_class=slo_class if pre.tenant is not None else None)
        turns = self.turns
        gated = admission and turns.deferrable(slo_class)
        began = time.monotonic()
        if gated:
            await turns.take(pre.request_id, slo_class, began)
        holding = gated  # the turn: released once the Router has admitted (and counted) it
        try:
            while True:
                waited = time.monotonic() - began
                if gated:
                    ask = msgspec.structs.replace(ask, admission=turns.gate(slo_class, waited))
                route = self.router.generate(ask)
                async with contextlib.aclosing(route):
                    decision = await self._decision(route)
                    wait = turns.wait_s(pre.request_id, slo_class, decision,
                                        waited) if gated else 0.0
                    if not wait:
                        if holding:
                            holding = False
                            turns.release()
                        async for item in self._on_worker(pre, decision, allowed, candidates,
                                                          attempt):
                            yield item
                        return
                await asyncio.sleep(wait)  # not counted by the Router meanwhile
        finally:
            if holding:
                turns.release()

    async def _decision(self, route: AsyncIterator[RouteDecision]) -> RouteDecision | None:
        try:
            async with asyncio.timeout(self.config.router_timeout):
                return await anext(route)
        except (RequestPlaneError, TimeoutError, StopAsyncIteration) as exc:
            log.warning("Router gave no decision (%s: %s): round robin (deferrable work "
                        "waits)", type(exc).__name__, exc)
            return None

    async def _on_worker(self, pre: PreprocessedRequest, decision: RouteDecision | None,
                         allowed: list[int], candidates: tuple[int, ...], attempt: Attempt
                         ) -> AsyncGenerator[LLMEngineOutput, None]:
        """The stream of the worker ``decision`` names (round robin without one)."""
        chosen = decision.worker_id if decision is not None else None
        if chosen is not None and chosen not in allowed:
            log.warning("Router chose worker %x, which cannot take this request", chosen)
            chosen = None
        stream = self._first_reachable(pre, chosen, candidates, attempt)
        async with contextlib.aclosing(stream):
            async for item in stream:
                yield item

    def _first_reachable(self, pre: PreprocessedRequest, chosen: int | None,
                         candidates: tuple[int, ...], attempt: Attempt
                         ) -> AsyncGenerator[LLMEngineOutput, None]:
        """Stream from ``chosen`` (None: the next candidate in turn, or a random one); if it
        fails before its first output, from the other candidates. A failure after the first
        output is raised as is (``migrating`` takes it from there). The worker in use is
        ``attempt.worker``; only ``attempt.allowed`` workers are asked."""
        among = set(candidates)
        live = attempt.allowed(w for w in instance_ids(self.worker.generate) if w in among)
        if self.config.router_mode == "random":
            self._rng.shuffle(live)
        else:
            live = self._rr.order(live)
        order: Iterator[int] = iter(([chosen] if chosen in live else [])
                                    + [w for w in live if w != chosen])

        async def next_worker(failed: list[int]) -> int | None:
            attempt.worker = next(order, None)
            return attempt.worker

        def retrying(w: int, exc: Exception) -> None:
            attempt.failed(w)
            log.warning("worker %x failed before its first output (%s); trying another", w, exc)

        def exhausted(last: Exception | None) -> Exception:
            return last or NoInstancesError("no live worker of this model to route to")

        return failover(next_worker,
                        lambda w: direct(self.worker.generate, pre, w, merge=merge_outputs),
                        retry_on=(InstanceUnavailable, NoInstancesError, StreamBroken),
                        exhausted=exhausted, on_retry=retrying)
