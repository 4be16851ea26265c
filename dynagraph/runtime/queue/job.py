"""The remote-prefill job: what a decode worker puts on the prefill queue.

A job is a typed msgspec struct carried as msgpack (never pickle). It is engine
neutral: engine-specific data (e.g. vLLM's ``kv_transfer_params``) travels in
``engine_params``. Times are wall-clock UNIX seconds (``time.time()``) because the
producer and the consumer are different processes.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec


class PrefillSampling(msgspec.Struct, frozen=True, kw_only=True):
    """The sampling basics a prefill needs (the prefill itself emits at most one token)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    max_tokens: int = 1
    cache_salt: str | None = None
    """The request's prefix-cache salt: the prefill computes (and hashes) the blocks the
    decode engine will look up under it."""


class ReplyTarget(msgspec.Struct, frozen=True, kw_only=True):
    """Where the prefill worker hands the result back: one decode worker's endpoint.

    The prefill worker calls ``component.endpoint`` on instance ``instance_id``
    (same namespace as the queue) through the request plane.
    """

    component: str
    endpoint: str
    instance_id: int


class RemotePrefillJob(msgspec.Struct, frozen=True, kw_only=True):
    """One remote-prefill request.

    ``deadline``: after this moment the decode worker no longer waits for the result
    (it prefilled locally), so a prefill worker must not start the job; queues drop
    such jobs on ``pull``.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: PrefillSampling
    reply_to: ReplyTarget
    enqueued_at: float
    deadline: float
    engine_params: dict[str, Any] = msgspec.field(default_factory=dict)

    @classmethod
    def create(
        cls,
        *,
        request_id: str,
        prompt_token_ids: list[int],
        reply_to: ReplyTarget,
        timeout: float,
        sampling: PrefillSampling | None = None,
        engine_params: dict[str, Any] | None = None,
        now: float | None = None,
    ) -> RemotePrefillJob:
        """A job stamped ``now`` (default ``time.time()``) that expires ``timeout`` s later."""
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0, got {timeout}")
        t = time.time() if now is None else now
        return cls(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling=sampling or PrefillSampling(),
            reply_to=reply_to,
            enqueued_at=t,
            deadline=t + timeout,
            engine_params=dict(engine_params or {}),
        )

    def expired(self, now: float | None = None) -> bool:
        """True once the decode worker has stopped waiting for this job."""
        return (time.time() if now is None else now) >= self.deadline


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(RemotePrefillJob)


def encode_job(job: RemotePrefillJob) -> bytes:
    """msgpack bytes of ``job``."""
    return _ENCODER.encode(job)


def decode_job(data: bytes) -> RemotePrefillJob:
    """Parse and validate a job; raises ``msgspec.ValidationError`` / ``DecodeError`` if bad."""
    return _DECODER.decode(data)
