"""Frontend-level migration: a stream whose Processor fails goes on through another one.

The Frontend calls Processors through :func:`resuming`. When the Processor's stream fails
with a failure of the *Processor* (its connection is lost, it froze and its heartbeats
stopped, or it could not be reached), the request is sent again, to another Processor,
with what the client already has (:class:`~dynagraph.llm.protocol.Resume`): the token ids
behind the text sent so far (each chunk carries them, ``TextChunk.token_ids``) and the
prompt's counts. The new Processor primes its detokenizer with those ids (so stop strings,
split characters and usage go on as if nothing happened) and asks a worker for the
continuation (prompt + those ids), as worker-level migration does
(:mod:`dynagraph.llm.migration`). The client sees one uninterrupted stream; under greedy
sampling, the same text. A failure before any chunk sends the request again as it was.

Only a plain request (one choice, no logprobs, tools or echo) can resume: its chunks carry
token ids. Any other, and any request past ``limit`` moves, ends with
:class:`~dynagraph.llm.migration.MigrationExhausted` (503), never a short answer. The
Processors that failed the request are avoided while another live one exists
(``Attempt``); the caller's ``open_stream`` records the one it used in ``attempt.worker``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import msgspec

from dynagraph.aio import aclose
from dynagraph.errors import InstanceUnavailable, StreamBroken
from dynagraph.llm.migration import Attempt, MigrationExhausted
from dynagraph.llm.protocol import OpenAIRequestEnvelope, Resume, TextChunk

log = logging.getLogger(__name__)

PROCESSOR_FAILURES: tuple[type[Exception], ...] = (StreamBroken, InstanceUnavailable)
"""Failures of the Processor, not of the request: the request may go on elsewhere."""

OpenStream = Callable[[OpenAIRequestEnvelope, Attempt], AsyncIterator[TextChunk]]
"""Sends an envelope to one of ``attempt.allowed(processors)`` and streams its chunks; sets
``attempt.worker`` to the Processor it chose."""


class Delivered:
    """What the client has of one request so far. Pure."""

    def __init__(self) -> None:
        self.chunks = 0
        self.token_ids: list[int] = []
        self.prompt_tokens = 0
        self.cached_tokens: int | None = None
        self.resumable = True
        """False once a chunk came without token ids (not a plain request)."""

    def add(self, chunk: TextChunk) -> None:
        self.chunks += 1
        if chunk.token_ids is None or chunk.index != 0:
            self.resumable = False
        else:
            self.token_ids.extend(chunk.token_ids)
        self.prompt_tokens = chunk.prompt_tokens
        if chunk.cached_tokens is not None:
            self.cached_tokens = chunk.cached_tokens

    def resume(self) -> Resume | None:
        """What the next Processor continues after (None: nothing was sent yet)."""
        if not self.chunks:
            return None
        return Resume(token_ids=list(self.token_ids), prompt_tokens=self.prompt_tokens,
                      cached_tokens=self.cached_tokens)


async def resuming(envelope: OpenAIRequestEnvelope, open_stream: OpenStream, *, limit: int,
                   on_migrate: Callable[[int | None, Exception], None] | None = None
                   ) -> AsyncGenerator[TextChunk, None]:
    """``open_stream(envelope)``'s chunks, continued on other Processors after Processor
    failures, at most ``limit`` times."""
    delivered = Delivered()
    attempt = Attempt()
    current = envelope
    migrations = 0
    while True:
        stream = open_stream(current, attempt)
        failure: Exception
        try:
            async for chunk in stream:
                delivered.add(chunk)
                yield chunk
            return
        except PROCESSOR_FAILURES as exc:
            failure = exc
        finally:
            await aclose(stream)
        processor = attempt.worker
        if processor is not None:
            attempt.failed(processor)
        rid = envelope.request_id
        if not delivered.resumable:
            raise MigrationExhausted(
                f"request {rid}: its Processor failed mid-stream, and only a plain request "
                f"(one choice; no logprobs, tools or echo) can go on elsewhere; "
                f"{type(failure).__name__}: {failure}") from failure
        if migrations >= limit:
            raise MigrationExhausted(
                f"request {rid}: its Processor failed {migrations + 1} times (migration-limit "
                f"{limit}); last: {type(failure).__name__}: {failure}") from failure
        migrations += 1
        if on_migrate is not None:
            on_migrate(processor, failure)
        log.warning("request %s: Processor %s failed after %d tokens (%s: %s); continuing "
                    "through another (migration %d of %d)", rid,
                    f"{processor:x}" if processor is not None else "?",
                    len(delivered.token_ids), type(failure).__name__, failure, migrations,
                    limit)
        current = msgspec.structs.replace(envelope, resume=delivered.resume())
        attempt = attempt.after()


__all__ = ["Delivered", "OpenStream", "resuming"]
