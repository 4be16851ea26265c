"""Prefill-side job handling: pull a job, prefill it, hand the KV over, then settle it.

One job, in order (``PrefillJobHandler.handle``):

1. past its deadline -> ``term`` (the decode worker already prefilled locally);
2. prefill with ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": True}``
   while a heartbeat calls ``item.in_progress()`` so the queue does not redeliver a
   long prefill; an engine failure -> ``nak`` (another worker may succeed); a prefill
   still running at the deadline is cancelled -> ``term``;
3. call the decode worker back (``reply(job.reply_to, PrefillResult)``);
4. only once that call returned -> ``ack``. If the decode worker is gone
   (``NoInstancesError``) -> ``term``; any other failure of the call -> ``nak`` so the
   job is delivered again (to this or another prefill worker) while its deadline lasts.

A prefill worker killed at any point before 4 never acks: the queue redelivers the job
after ``ack_wait``; a redelivery past the deadline is dropped by ``pull``.

``serve_queue`` runs the pull loop with at most ``concurrency`` jobs at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import KW_ONLY, dataclass
from typing import Any, Literal, Protocol

from dynagraph.errors import EngineError, NoInstancesError, RequestPlaneError
from dynagraph.llm.disagg.coordinator import PrefillAck, PrefillResult
from dynagraph.llm.engines.base import EngineOutput, SamplingSpec
from dynagraph.llm.kv.transfer.tier_handoff import accepts, handed_over, wait_for_blocks
from dynagraph.llm.router.hashing import BlockHasher
from dynagraph.runtime.queue import PrefillQueue, PrefillQueueError, QueueItem, ReplyTarget

log = logging.getLogger(__name__)

REMOTE_DECODE_PARAMS: dict[str, Any] = {"do_remote_decode": True}
"""What a producer engine (vLLM NixlConnector, kv_producer) needs to keep the KV for a peer."""

Status = Literal["handed-off", "late", "expired", "decode-gone", "reply-failed", "engine-failed"]


class PrefillEngine(Protocol):
    """The part of an engine a prefill worker uses (``VllmEngine`` satisfies it)."""

    def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling: SamplingSpec, *,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> AsyncIterator[EngineOutput]: ...


class PullObserver(Protocol):
    """Told about every pulled job (``dynagraph.observability.PrefillQueueMetrics``)."""

    def pulled(self, enqueued_at: float, delivery_count: int) -> None: ...


ReplyFn = Callable[[ReplyTarget, PrefillResult], Awaitable[PrefillAck]]
"""Hands a result to the decode worker named by the job; raises RequestPlaneError."""


class EndpointClients(Protocol):
    """Finds an endpoint client by name (``RuntimeContext`` satisfies it)."""

    async def client(self, component: str, endpoint: str, *,
                     response_type: type | None = None) -> Any: ...


def reply_through(runtime: EndpointClients) -> ReplyFn:
    """The ``ReplyFn`` of a prefill worker: a direct call of the instance named in the
    job's ``reply_to`` (its ``prefill_done`` endpoint), found through ``runtime``."""

    async def reply(target: ReplyTarget, result: PrefillResult) -> PrefillAck:
        client = await runtime.client(target.component, target.endpoint,
                                      response_type=PrefillAck)
        stream = client.direct(result, target.instance_id)
        async with contextlib.aclosing(stream):
            async for ack in stream:
                return ack  # type: ignore[no-any-return]
        raise RequestPlaneError(f"{target.component}.{target.endpoint} answered nothing")

    return reply


@dataclass(frozen=True)
class JobOutcome:
    request_id: str
    status: Status
    queue_wait_s: float = 0.0
    prefill_s: float = 0.0
    reply_s: float = 0.0


@dataclass(eq=False)
class PrefillJobHandler:
    """Handles one queue item at a time per call; safe to run several calls concurrently."""

    engine: PrefillEngine
    reply: ReplyFn
    _: KW_ONLY
    instance_id: int = 0
    heartbeat_s: float = 5.0
    reply_timeout: float = 10.0
    hold_s: Callable[[], float] = lambda: 0.0
    """Seconds to wait between prefill and hand-off (fault-injection tests; 0 normally)."""
    clock: Callable[[], float] = time.time
    observer: PullObserver | None = None
    tier: dict[str, str] | None = None
    """This worker's shared KV tier (``tier_handoff.offer``): a job whose decode worker
    offers the same one is handed over through it instead of NIXL."""
    hasher: BlockHasher | None = None
    """Hashes blocks as the engine does, to find a prompt's blocks in the tier."""
    tier_wait_s: float = 2.0
    """Longest wait for a prompt's blocks to reach the tier (then the decode worker
    computes what is missing)."""

    async def handle(self, item: QueueItem) -> JobOutcome:
        job = item.job
        pulled = self.clock()
        wait = max(pulled - job.enqueued_at, 0.0)
        if self.observer is not None:
            self.observer.pulled(job.enqueued_at, item.delivery_count)
        if job.expired(pulled):
            await item.term()
            return JobOutcome(job.request_id, "expired", wait)
        async with _heartbeat(item, self.heartbeat_s):
            began = time.monotonic()
            try:
                # Never past the job's deadline: the decode worker prefills locally then, and
                # an engine request that never finishes must not hold this slot (and, with
                # the heartbeat, the job) for ever.
                params = await asyncio.wait_for(
                    self._prefill(job.request_id, job.prompt_token_ids, job,
                                  item.delivery_count),
                    max(job.deadline - self.clock(), 0.0))
            except TimeoutError:
                log.warning("prefill of %s not done by its deadline (%.1fs after the pull); "
                            "the decode worker prefills it itself: dropped", job.request_id,
                            time.monotonic() - began)
                await item.term()
                return JobOutcome(job.request_id, "expired", wait, time.monotonic() - began)
            except EngineError as e:
                log.warning("prefill of %s failed (delivery %d), giving it back: %s",
                            job.request_id, item.delivery_count, e)
                await item.nak()
                return JobOutcome(job.request_id, "engine-failed", wait)
            prefill_s = time.monotonic() - began
            hold = self.hold_s()
            if hold > 0:
                log.warning("holding job %s for %.1fs before the hand-off (fault injection)",
                            job.request_id, hold)
                await asyncio.sleep(hold)
            if job.expired(self.clock()):
                await item.term()
                return JobOutcome(job.request_id, "expired", wait, prefill_s)
            result = PrefillResult(
                request_id=job.request_id, kv_transfer_params=params,
                prefill_instance=self.instance_id, delivery=item.delivery_count,
                queue_wait_s=wait, prefill_s=prefill_s,
            )
            sent = time.monotonic()
            try:
                ack = await asyncio.wait_for(self.reply(job.reply_to, result), self.reply_timeout)
            except NoInstancesError:
                log.warning("decode worker %x of %s is gone; dropping the job",
                            job.reply_to.instance_id, job.request_id)
                await item.term()
                return JobOutcome(job.request_id, "decode-gone", wait, prefill_s)
            except (RequestPlaneError, TimeoutError) as e:
                log.warning("hand-off of %s to %x failed, giving the job back: %s",
                            job.request_id, job.reply_to.instance_id, e)
                await item.nak()
                return JobOutcome(job.request_id, "reply-failed", wait, prefill_s)
            reply_s = time.monotonic() - sent
        await item.ack()
        status: Status = "handed-off" if ack.accepted else "late"
        log.info("prefill %s: %s (queue wait %.3fs, prefill %.3fs, hand-off %.3fs)",
                 job.request_id, status, wait, prefill_s, reply_s)
        return JobOutcome(job.request_id, status, wait, prefill_s, reply_s)

    async def _prefill(self, request_id: str, prompt: list[int], job: Any,
                       delivery: int) -> dict[str, Any]:
        s = job.sampling
        spec = SamplingSpec(max_tokens=1, temperature=s.temperature, top_p=s.top_p,
                            top_k=s.top_k, seed=s.seed, cache_salt=s.cache_salt)
        rid = f"{request_id}-prefill-{delivery}"
        if self.tier is not None and self.hasher is not None and accepts(self.tier,
                                                                         job.engine_params):
            return await self._prefill_into_tier(
                rid, prompt, spec, self.hasher.digests(prompt, cache_salt=s.cache_salt))
        params: dict[str, Any] | None = None
        async for out in self.engine.generate(rid, prompt, spec,
                                              kv_transfer_params=dict(REMOTE_DECODE_PARAMS)):
            if out.kv_transfer_params is not None:
                params = out.kv_transfer_params
        if params is None:
            raise EngineError("the engine returned no KV transfer parameters; is it a KV "
                              "producer (kv_transfer_config with kv_role kv_producer)?")
        return params

    async def _prefill_into_tier(self, rid: str, prompt: list[int], spec: SamplingSpec,
                                 digests: list[bytes]) -> dict[str, Any]:
        """Prefill as a local request; its blocks go through the engine's pool to the
        shared tier, where the decode engine finds them (``tier_handoff``)."""
        assert self.tier is not None
        async for _ in self.engine.generate(rid, prompt, spec):
            pass
        present, waited = await wait_for_blocks(self.tier["dir"], digests, self.tier_wait_s)
        if not present:
            log.warning("%d blocks of %s not in the shared KV tier %s after %.1fs; the decode "
                        "worker computes what is missing", len(digests), rid,
                        self.tier["dir"], waited)
        return handed_over(len(digests), present, waited)


@contextlib.asynccontextmanager
async def _heartbeat(item: QueueItem, every: float) -> AsyncIterator[None]:
    async def beat() -> None:
        while True:
            await asyncio.sleep(every)
            try:
                await item.in_progress()
            except PrefillQueueError as e:
                log.warning("in_progress for %s failed: %s", item.job.request_id, e)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def serve_queue(
    queue: PrefillQueue,
    handler: PrefillJobHandler,
    *,
    concurrency: int = 2,
    pull_timeout: float = 1.0,
    on_outcome: Callable[[JobOutcome], None] | None = None,
    stopping: asyncio.Event | None = None,
    drain_s: float = 5.0,
) -> None:
    """Pull and handle jobs until cancelled; at most ``concurrency`` at once.

    When ``stopping`` is set (a worker being scaled down), no further job is pulled and the
    function returns once the jobs in hand are done (at most ``drain_s`` seconds; any left
    are cancelled, unacked, so the queue delivers them again)."""
    if concurrency < 1:
        raise ValueError("concurrency must be >= 1")
    slots = asyncio.Semaphore(concurrency)
    running: set[asyncio.Task[None]] = set()

    async def run(item: QueueItem) -> None:
        try:
            outcome = await handler.handle(item)
            if on_outcome is not None:
                on_outcome(outcome)
        except PrefillQueueError as e:
            log.warning("settling job %s failed (it may be delivered again): %s",
                        item.job.request_id, e)
        except Exception:
            log.exception("job %s failed unexpectedly; giving it back", item.job.request_id)
            with contextlib.suppress(PrefillQueueError):
                await item.nak()
        finally:
            slots.release()

    try:
        while stopping is None or not stopping.is_set():
            await slots.acquire()
            try:
                item = await queue.pull(pull_timeout)
            except BaseException:
                slots.release()
                raise
            if item is None:
                slots.release()
                continue
            task = asyncio.create_task(run(item))
            running.add(task)
            task.add_done_callback(running.discard)
        if running:
            log.info("stopping: finishing %d prefill job(s) in hand", len(running))
            await asyncio.wait(set(running), timeout=drain_s)
    finally:
        for task in running:
            task.cancel()
        if running:
            await asyncio.wait(running, timeout=5)
