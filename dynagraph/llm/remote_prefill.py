"""Decode-side remote prefill: decide, enqueue, wait for the KV hand-off, or fall back.

Flow for one request on a decode worker (``VllmWorker`` with ``remote-prefill: true``)::

    plan(request_id, prompt)                      (RemotePrefillCoordinator)
      cached   = PrefixCacheEstimate.cached_len(prompt)
      decision = LiveDisaggSettings.decide(len(prompt), cached, queue.depth())
      local?  -> PrefillPlan(kv_transfer_params=None)        engine prefills itself
      remote  -> enqueue RemotePrefillJob(reply_to = this instance's ``prefill_done``)
                 wait up to remote-prefill-timeout for deliver(PrefillResult)
                   arrived -> PrefillPlan(kv_transfer_params=...)  engine pulls KV over NIXL
                   timeout -> PrefillPlan(None, fallback="timeout")  prefill locally

A ``PrefillWorker`` calls the decode worker's ``prefill_done`` endpoint with a
``PrefillResult``; the endpoint calls :meth:`RemotePrefillCoordinator.deliver`, whose
answer (``PrefillAck.accepted``) tells the prefill worker whether anyone was still
waiting. Either way the prefill worker then acks the job: the hand-off happened, or the
decode worker already prefilled locally and the job is moot.

The request is never lost: every path that does not yield KV transfer params (queue
unreachable, no prefill worker registered, timeout) answers "prefill locally".

The decode worker's prefix cache is not visible from outside vLLM, so
``PrefixCacheEstimate`` keeps an LRU of the chained hashes of full prompt blocks this
worker has served, bounded by the engine's block count. It over-estimates after vLLM
evicts blocks early, which only makes a remote prefill less likely.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from dynagraph.llm.disagg import LiveDisaggSettings, PrefillDecision
from dynagraph.runtime.queue import (
    PrefillQueue,
    PrefillQueueError,
    PrefillSampling,
    RemotePrefillJob,
    ReplyTarget,
)

log = logging.getLogger(__name__)

PREFILL_DONE_ENDPOINT = "prefill_done"
"""The decode worker's endpoint a prefill worker hands its result to."""

Fallback = Literal["timeout", "queue-error", "no-prefill-worker"]


class PrefillResult(msgspec.Struct, frozen=True, kw_only=True):
    """PrefillWorker -> decode worker: the prefill is done, here is how to fetch its KV.

    ``kv_transfer_params`` is the prefill engine's output as is (for vLLM's NixlConnector:
    remote engine id, block ids, side-channel host and port); the decode engine gets it
    unchanged. Timings are the prefill worker's view, for the per-request breakdown.
    """

    request_id: str
    kv_transfer_params: dict[str, Any]
    prefill_instance: int = 0
    delivery: int = 1
    queue_wait_s: float = 0.0
    prefill_s: float = 0.0


class PrefillAck(msgspec.Struct, frozen=True, kw_only=True):
    """Decode worker -> PrefillWorker: ``accepted`` is False if nobody was waiting any more."""

    accepted: bool


@dataclass(frozen=True)
class PrefillPlan:
    """How to prefill one request. ``kv_transfer_params is None`` means locally."""

    decision: PrefillDecision
    kv_transfer_params: dict[str, Any] | None = None
    fallback: Fallback | None = None
    result: PrefillResult | None = None
    wait_s: float = 0.0
    """Time from enqueue to the result (or to giving up)."""

    @property
    def remote(self) -> bool:
        return self.kv_transfer_params is not None

    @property
    def label(self) -> str:
        """``local`` / ``remote`` / ``fallback``: where the prefill ran, as a metric label."""
        if self.remote:
            return "remote"
        return "fallback" if self.fallback else "local"


class PrefixCacheEstimate:
    """Which prompt prefixes this worker probably still has in its KV cache.

    Keys are chained hashes of full blocks (``hash((parent, block_tokens))``), kept in
    LRU order up to ``capacity_blocks``. Pure, synchronous, no I/O.
    """

    def __init__(self, block_size: int, capacity_blocks: int) -> None:
        if block_size < 1 or capacity_blocks < 0:
            raise ValueError("block_size must be >= 1 and capacity_blocks >= 0")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()

    def _hashes(self, tokens: Sequence[int]) -> list[int]:
        out: list[int] = []
        parent = 0
        bs = self.block_size
        for start in range(0, len(tokens) - bs + 1, bs):
            parent = hash((parent, tuple(tokens[start:start + bs])))
            out.append(parent)
        return out

    def cached_len(self, tokens: Sequence[int]) -> int:
        """Tokens of the longest cached full-block prefix of ``tokens``."""
        n = 0
        for h in self._hashes(tokens):
            if h not in self._lru:
                break
            n += 1
        return n * self.block_size

    def record(self, tokens: Sequence[int]) -> None:
        """``tokens`` was prefilled here (or its KV arrived): remember its full blocks."""
        for h in self._hashes(tokens):
            self._lru[h] = None
            self._lru.move_to_end(h)
        while len(self._lru) > self.capacity_blocks:
            self._lru.popitem(last=False)

    def __len__(self) -> int:
        return len(self._lru)


class PrefillMetrics:
    """Decode-side counters: where prefills ran and why, and how long remote ones waited."""

    def __init__(self, registry: CollectorRegistry | None = REGISTRY) -> None:
        self.requests = Counter(
            "dynamo_worker_prefill_requests", "Prefills by where they ran (local, remote, "
            "fallback = wanted remote, ran local) and the reason.",
            ["where", "reason"], registry=registry,
        )
        self.remote_wait = Histogram(
            "dynamo_worker_remote_prefill_wait_seconds",
            "Enqueue of a remote prefill job to its KV transfer parameters (or giving up).",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=registry,
        )

    def observe(self, plan: PrefillPlan) -> None:
        reason = plan.fallback or plan.decision.reason
        self.requests.labels(plan.label, reason).inc()
        if plan.decision.remote:
            self.remote_wait.observe(plan.wait_s)


class RemotePrefillCoordinator:
    """Per decode worker: turns a prompt into a :class:`PrefillPlan` (see the module doc).

    Single event loop. ``plan`` is called by the worker's ``generate`` per request;
    ``deliver`` by its ``prefill_done`` endpoint. ``prefill_workers`` returns how many
    prefill workers are registered (0 means: don't wait for one).
    """

    def __init__(
        self,
        *,
        settings: LiveDisaggSettings,
        queue: PrefillQueue,
        reply_to: ReplyTarget,
        prefix: PrefixCacheEstimate,
        prefill_workers: Callable[[], int] = lambda: 1,
        metrics: PrefillMetrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self.queue = queue
        self.reply_to = reply_to
        self.prefix = prefix
        self.prefill_workers = prefill_workers
        self.metrics = metrics
        self.clock = clock
        self._pending: dict[str, asyncio.Future[PrefillResult]] = {}

    @property
    def pending(self) -> int:
        """Remote prefills being waited for."""
        return len(self._pending)

    async def plan(
        self, request_id: str, prompt: Sequence[int], sampling: PrefillSampling | None = None
    ) -> PrefillPlan:
        """Decide and, for a remote prefill, wait for it; never raises for infra failures."""
        plan = await self._plan(request_id, prompt, sampling)
        self.prefix.record(prompt)
        if self.metrics is not None:
            self.metrics.observe(plan)
        log.debug("prefill plan for %s: %s (%s)", request_id, plan.label,
                  plan.fallback or plan.decision.reason)
        return plan

    async def _plan(
        self, request_id: str, prompt: Sequence[int], sampling: PrefillSampling | None
    ) -> PrefillPlan:
        cached = self.prefix.cached_len(prompt)
        decision = self.settings.decide(len(prompt), cached, 0)
        if not decision.remote:
            return PrefillPlan(decision)
        try:
            depth = await self.queue.depth()
        except PrefillQueueError as e:
            log.warning("prefill queue unreachable, prefilling %s locally: %s", request_id, e)
            return PrefillPlan(decision, fallback="queue-error")
        decision = self.settings.decide(len(prompt), cached, depth)
        if not decision.remote:
            return PrefillPlan(decision)
        if self.prefill_workers() <= 0:
            return PrefillPlan(decision, fallback="no-prefill-worker")
        if request_id in self._pending:
            raise ValueError(f"request {request_id!r} is already waiting for a remote prefill")
        timeout = self.settings.current.remote_prefill_timeout
        job = RemotePrefillJob.create(
            request_id=request_id, prompt_token_ids=list(prompt), reply_to=self.reply_to,
            timeout=timeout, sampling=sampling, now=self.clock(),
        )
        fut: asyncio.Future[PrefillResult] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = fut
        began = time.monotonic()
        try:
            try:
                await self.queue.enqueue(job)
            except PrefillQueueError as e:
                log.warning("could not enqueue remote prefill of %s, prefilling locally: %s",
                            request_id, e)
                return PrefillPlan(decision, fallback="queue-error")
            try:
                result = await asyncio.wait_for(fut, timeout=max(job.deadline - self.clock(), 0.0))
            except TimeoutError:
                waited = time.monotonic() - began
                log.warning("no prefill result for %s within %.1fs, prefilling locally",
                            request_id, waited)
                return PrefillPlan(decision, fallback="timeout", wait_s=waited)
        finally:
            self._pending.pop(request_id, None)
        return PrefillPlan(decision, kv_transfer_params=result.kv_transfer_params, result=result,
                           wait_s=time.monotonic() - began)

    def deliver(self, result: PrefillResult) -> bool:
        """A prefill worker's result for ``result.request_id``; False if nobody waits for it."""
        fut = self._pending.get(result.request_id)
        if fut is None or fut.done():
            log.info("late prefill result for %s (delivery %d) ignored: already prefilled locally",
                     result.request_id, result.delivery)
            return False
        fut.set_result(result)
        return True
