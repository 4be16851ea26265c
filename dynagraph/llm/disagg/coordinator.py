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
``PrefixCacheEstimate`` keeps an LRU of the engine's block hashes of the full prompt
blocks this worker has served, bounded by the engine's block count. It over-estimates after vLLM
evicts blocks early, which only makes a remote prefill less likely.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, Literal

import msgspec

from dynagraph.llm.disagg.metrics import PrefillMetrics
from dynagraph.llm.disagg.policy import LiveDisaggSettings, PrefillDecision
from dynagraph.llm.router.hashing import BlockHasher
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

    @property
    def reason(self) -> str:
        """Why: the policy's reason, or what made a wanted remote prefill run locally."""
        return self.fallback or self.decision.reason

    @property
    def wanted_remote(self) -> bool:
        return self.decision.remote


class PrefixCacheEstimate:
    """Which prompt prefixes this worker probably still has in its KV cache.

    Keys are the engine's own block hashes (``BlockHasher``, as the Router uses), kept in
    LRU order up to ``capacity_blocks``. Pure, synchronous, no I/O.
    """

    def __init__(self, hasher: BlockHasher, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError("capacity_blocks must be >= 0")
        self.hasher = hasher
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()

    def hashes(self, tokens: Sequence[int], cache_salt: str | None = None) -> list[int]:
        return self.hasher.block_hashes(tokens, cache_salt=cache_salt)

    def cached_len(self, hashes: Sequence[int]) -> int:
        """Tokens of the longest cached full-block prefix of the blocks ``hashes``."""
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        return n * self.hasher.block_size

    def record(self, hashes: Sequence[int]) -> None:
        """These blocks were prefilled here (or their KV arrived): remember them."""
        for h in hashes:
            self._lru[h] = None
            self._lru.move_to_end(h)
        while len(self._lru) > self.capacity_blocks:
            self._lru.popitem(last=False)

    def __len__(self) -> int:
        return len(self._lru)


@dataclass(eq=False)
class RemotePrefillCoordinator:
    """Per decode worker: turns a prompt into a :class:`PrefillPlan` (see the module doc).

    Single event loop. ``plan`` is called by the worker's ``generate`` per request;
    ``deliver`` by its ``prefill_done`` endpoint. ``prefill_workers`` returns how many
    prefill workers are registered (0 means: don't wait for one).
    """

    _: KW_ONLY
    settings: LiveDisaggSettings
    queue: PrefillQueue
    reply_to: ReplyTarget
    prefix: PrefixCacheEstimate
    prefill_workers: Callable[[], int] = lambda: 1
    metrics: PrefillMetrics | None = None
    engine_params: dict[str, Any] = field(default_factory=dict)
    """Put in every job (e.g. the decode worker's shared KV tier, ``tier_handoff.offer``)."""
    clock: Callable[[], float] = time.time
    _pending: dict[str, asyncio.Future[PrefillResult]] = field(default_factory=dict, init=False)

    @property
    def pending(self) -> int:
        """Remote prefills being waited for."""
        return len(self._pending)

    async def plan(
        self, request_id: str, prompt: Sequence[int], sampling: PrefillSampling | None = None
    ) -> PrefillPlan:
        """Decide and, for a remote prefill, wait for it; never raises for infra failures."""
        hashes = self.prefix.hashes(prompt, sampling.cache_salt if sampling else None)
        plan = await self._plan(request_id, prompt, self.prefix.cached_len(hashes), sampling)
        self.prefix.record(hashes)
        if self.metrics is not None:
            self.metrics.observe(plan)
        log.debug("prefill plan for %s: %s (%s)", request_id, plan.label,
                  plan.fallback or plan.decision.reason)
        return plan

    async def _plan(self, request_id: str, prompt: Sequence[int], cached: int,
                    sampling: PrefillSampling | None) -> PrefillPlan:
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
            engine_params=self.engine_params,
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
