"""Mid-stream migration: a worker stream that breaks goes on, on another worker.

The Processor calls workers through :func:`migrating`. When a worker's stream fails with
a *worker* failure (the connection is lost, the worker froze and its heartbeats stopped,
its engine died, or it could not be reached), the request is sent again, to another
worker, as its continuation:

    prompt      = original prompt + every token already received
    max_tokens  = original max_tokens - tokens received   (min_tokens likewise)

so the client's stream goes on without a duplicate or a missing token, with one finish
reason, and usage counts the whole answer (the continuation's outputs carry no
prompt/cached counts: the first worker's stand). Under greedy sampling the continued
output is the uninterrupted one, token for token. A request with ``n`` choices continues
as one single-choice request per unfinished choice, re-tagged with its ``index``.

After ``limit`` migrations the failure is raised as :class:`MigrationExhausted` (503),
never a silently short answer. A request its worker hands back before its first
output (``Requeued``: the Router's rebalancing found it a free place elsewhere) is placed
again as it is, not counted as a migration (up to ``MAX_REQUEUES`` times). Errors that
are the *request's* fault (``InvalidRequest``,
...) are raised at once. The workers that failed the request are avoided while another
live worker exists (``Attempt.allowed``; when every one has failed, the one that failed
longest ago is tried again: a worker that stalled, its lease lost to CPU starvation, may
be back, and one that died has left discovery); the dispatcher records which worker
it used in ``Attempt.worker``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from dynagraph.aio import aclose
from dynagraph.errors import InstanceUnavailable, NoInstancesError, Requeued, StreamBroken
from dynagraph.llm.protocol import LLMEngineOutput, PreprocessedRequest

log = logging.getLogger(__name__)

MAX_REQUEUES = 8
"""Times one request may be handed back (``Requeued``) and placed again; past that a hand
back counts as a worker failure (a migration)."""

WORKER_FAILURES: tuple[type[Exception], ...] = (StreamBroken, InstanceUnavailable)
"""Failures of the worker, not of the request: the request may go on elsewhere. (An
``EngineError`` may be the request's fault, so it is not retried.)"""


class MigrationExhausted(NoInstancesError):
    """A request's workers failed more often than its migration limit allows (HTTP 503)."""


@dataclass
class Attempt:
    """One dispatch of a request: the workers that failed it so far (oldest first), and
    the one that was used."""

    failures: list[int] = field(default_factory=list)
    worker: int | None = None

    def failed(self, worker: int) -> None:
        if worker in self.failures:
            self.failures.remove(worker)
        self.failures.append(worker)

    def allowed(self, workers: Iterable[int]) -> list[int]:
        """``workers`` less those that failed the request; if every one has, the one that
        failed longest ago (one that died leaves discovery; one that stalled may be back).
        ``migrating``'s limit bounds the tries."""
        workers = list(workers)
        return ([w for w in workers if w not in self.failures]
                or [w for w in self.failures if w in workers][:1])

    def after(self) -> Attempt:
        """The next dispatch's attempt: the same failures, no worker yet."""
        return Attempt(failures=list(self.failures))


Dispatch = Callable[[PreprocessedRequest, Attempt], AsyncIterator[LLMEngineOutput]]
"""Sends a request to one of ``attempt.allowed(workers)`` and streams its outputs; sets
``attempt.worker`` once it has chosen."""


@dataclass
class _Choice:
    tokens: list[int] = field(default_factory=list)
    finished: bool = False


async def migrating(request: PreprocessedRequest, dispatch: Dispatch, *, limit: int,
                    on_migrate: Callable[[int | None, Exception], None] | None = None,
                    earlier: Attempt | None = None,
                    continued: bool = False,
                    before_retry: Callable[[Attempt, Exception], Awaitable[None]] | None = None,
                    ) -> AsyncGenerator[LLMEngineOutput, None]:
    """``dispatch(request)``'s outputs, continued on other workers after worker failures.

    ``before_retry(attempt, failure)`` is awaited after each worker failure, before the
    request goes on: the caller may wait there (bounded) for a worker that has not failed
    it, such as the restart of the only one.

    A constrained request (structured outputs, forced tool calls) that already has output
    is not continued: its grammar would restart on the continuation's prompt.
    ``continued``: ``request`` is itself a continuation (its prompt holds output the
    client already has), so no output's prompt and cached counts stand.
    """
    n = _num_choices(request)
    choices = [_Choice() for _ in range(n)]
    attempt = earlier.after() if earlier is not None else Attempt()
    migrations = requeues = 0
    current = request
    first = not continued
    while True:
        stream = dispatch(current, attempt)
        requeued = False
        failure: Exception
        try:
            async for out in stream:
                choice = choices[out.index if n > 1 else 0]
                choice.tokens.extend(out.token_ids)
                if out.finish_reason is not None:
                    choice.finished = True
                if not first:  # a continuation: the original request's counts stand
                    out.prompt_tokens = out.cached_tokens = None
                yield out
            return
        except Requeued as exc:  # handed back before its first output: place it again
            failure, requeued = exc, True
        except WORKER_FAILURES as exc:
            failure = exc
        finally:
            await aclose(stream)
        if requeued and requeues < MAX_REQUEUES:
            requeues += 1
            log.debug("request %s: handed back by worker %s; placing it again (%d)",
                      request.request_id, f"{attempt.worker:x}" if attempt.worker else "?",
                      requeues)
            current = msgspec.structs.replace(current,
                                              request_id=f"{request.request_id}-q{requeues}")
            attempt = attempt.after()
            continue
        if attempt.worker is not None:
            attempt.failed(attempt.worker)
        generated = any(c.tokens for c in choices)
        if generated and getattr(request.sampling, "structured_outputs", None) is not None:
            raise MigrationExhausted(
                f"request {request.request_id}: its worker failed mid-way through constrained "
                f"output, which cannot continue elsewhere; {type(failure).__name__}: {failure}"
            ) from failure
        if migrations >= limit:
            raise MigrationExhausted(
                f"request {request.request_id}: its worker failed {migrations + 1} times "
                f"(migration-limit {limit}); last: {type(failure).__name__}: {failure}"
            ) from failure
        migrations += 1
        if on_migrate is not None:
            on_migrate(attempt.worker, failure)
        log.warning("request %s: worker %s failed after %s tokens (%s: %s); continuing on "
                    "another worker (migration %d of %d)", request.request_id,
                    f"{attempt.worker:x}" if attempt.worker is not None else "?",
                    [len(c.tokens) for c in choices], type(failure).__name__, failure,
                    migrations, limit)
        first = False
        if before_retry is not None:
            await before_retry(attempt, failure)
        if n > 1:
            streams = [
                _reindexed(i, migrating(continuation(request, c.tokens, f"m{migrations}c{i}"),
                                        dispatch, limit=limit - migrations,
                                        on_migrate=on_migrate, earlier=attempt,
                                        before_retry=before_retry))
                for i, c in enumerate(choices) if not c.finished]
            merged = _merge(streams)
            try:
                async for out in merged:
                    yield out
            finally:
                await aclose(merged)
            return
        current = continuation(request, choices[0].tokens, f"m{migrations}")
        attempt = attempt.after()


def continuation(request: PreprocessedRequest, generated: list[int],
                 tag: str) -> PreprocessedRequest:
    """The request that goes on after ``generated``: a single choice, the same sampling."""
    sampling = request.sampling
    changes: dict[str, Any] = {
        "max_tokens": max(sampling.max_tokens - len(generated), 1),
        "min_tokens": max(sampling.min_tokens - len(generated), 0),
    }
    if hasattr(sampling, "n"):
        changes["n"] = 1
    return msgspec.structs.replace(
        request, request_id=f"{request.request_id}-{tag}",
        token_ids=[*request.token_ids, *generated],
        sampling=msgspec.structs.replace(sampling, **changes))


def _num_choices(request: PreprocessedRequest) -> int:
    return int(getattr(request.sampling, "n", 1) or 1)


async def _reindexed(index: int, stream: AsyncIterator[LLMEngineOutput]
                     ) -> AsyncIterator[LLMEngineOutput]:
    """A continuation of choice ``index``: re-tagged, without its own prompt counts."""
    try:
        async for out in stream:
            out.index = index
            out.prompt_tokens = out.cached_tokens = None
            yield out
    finally:
        await aclose(stream)


async def _merge(streams: list[AsyncIterator[LLMEngineOutput]]
                 ) -> AsyncIterator[LLMEngineOutput]:
    """Interleave several streams as their items arrive; the first failure ends them all."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue(maxsize=len(streams) * 4)

    async def pump(i: int, stream: AsyncIterator[LLMEngineOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((0, out))
            await queue.put((1, None))
        except Exception as exc:
            await queue.put((2, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        done = 0
        while done < len(tasks):
            kind, item = await queue.get()
            if kind == 0:
                yield item
            elif kind == 1:
                done += 1
            else:
                raise item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


__all__ = ["Attempt", "Dispatch", "MigrationExhausted", "continuation", "migrating"]
