"""The prefill-queue contract shared by the NATS and in-memory implementations.

Producers (decode workers) call ``enqueue`` and ``depth``; consumers (prefill
workers) call ``pull`` and then exactly one of ``ack`` / ``nak`` / ``term`` on the
item, with ``in_progress`` while a long prefill runs.

Delivery is at-least-once: a job that is pulled and not acked within ``ack_wait``
(the worker died, hung, or lost its connection) is delivered again, up to
``max_deliver`` deliveries in total; after that it is never delivered again.
Jobs older than ``max_age`` are removed whatever their state, and ``pull`` drops
(terminates) jobs whose own ``deadline`` has passed, so a prefill worker never
starts work the decode worker has given up on.

Queue depth: ``depth()`` is the number of jobs waiting for a first delivery, i.e.
enqueued and not yet handed to any prefill worker. Jobs a worker holds (delivered,
not acked, including ones waiting to be redelivered) are ``stats().in_flight``. The
disaggregation policy compares ``depth()`` with ``max-prefill-queue-size``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from dynagraph.errors import ConfigError, InfraError
from dynagraph.runtime.queue.job import RemotePrefillJob

DEFAULT_ACK_WAIT = 30.0
DEFAULT_MAX_DELIVER = 3
DEFAULT_MAX_AGE = 300.0
DEFAULT_DUPLICATE_WINDOW = 60.0

_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_-]+$")


class PrefillQueueError(InfraError):
    """The prefill queue could not be reached or refused an operation.

    A decode worker that gets this from ``enqueue`` or ``depth`` prefills locally.
    """


def check_namespace(namespace: str) -> str:
    """``namespace`` if it is usable in NATS stream and subject names, else ConfigError."""
    if not _NAMESPACE_RE.match(namespace):
        raise ConfigError(
            f"namespace {namespace!r} must match [A-Za-z0-9_-]+ to name a prefill queue",
            key="namespace",
        )
    return namespace


def stream_name(namespace: str) -> str:
    """JetStream stream of a namespace's prefill queue: ``PREFILL_<namespace>``."""
    return f"PREFILL_{check_namespace(namespace)}"


def subject_name(namespace: str) -> str:
    """The subject jobs are published to: ``dynagraph.<namespace>.prefill``."""
    return f"dynagraph.{check_namespace(namespace)}.prefill"


CONSUMER_NAME = "prefill_workers"
"""The one durable pull consumer shared by every prefill worker of a namespace."""


@dataclass(frozen=True)
class QueueStats:
    """A snapshot of the queue.

    ``waiting``: not yet delivered to any worker (this is ``depth()``).
    ``in_flight``: delivered and not yet acked/terminated (includes jobs waiting to
    be redelivered after a nak or an ack_wait timeout).
    """

    waiting: int
    in_flight: int


@runtime_checkable
class QueueItem(Protocol):
    """One delivery of a job to a prefill worker. Settle it exactly once."""

    @property
    def job(self) -> RemotePrefillJob: ...

    @property
    def delivery_count(self) -> int:
        """1 on the first delivery, 2 on the first redelivery, ..."""
        ...

    async def ack(self) -> None:
        """Done: remove the job for good. Raises PrefillQueueError if the ack may be lost
        (the job may then be delivered again)."""
        ...

    async def nak(self, delay: float | None = None) -> None:
        """Give the job back now (or after ``delay`` s) for another delivery."""
        ...

    async def term(self) -> None:
        """Never deliver this job again (poison job, or one past its deadline)."""
        ...

    async def in_progress(self) -> None:
        """Still working: restart this delivery's ack_wait timer."""
        ...


@runtime_checkable
class PrefillQueue(Protocol):
    """A namespace's prefill queue. ``connect`` before use, ``close`` at the end."""

    async def connect(self) -> None:
        """Connect and create the queue if needed (idempotent; safe from many workers at once)."""
        ...

    async def close(self) -> None:
        """Release connections. Unacked items go back to the queue after ack_wait."""
        ...

    async def enqueue(self, job: RemotePrefillJob) -> None:
        """Store ``job`` durably; returns once stored. Raises PrefillQueueError."""
        ...

    async def depth(self) -> int:
        """Jobs waiting for a first delivery (may be cached for a few ms). Raises PrefillQueueError."""
        ...

    async def stats(self) -> QueueStats:
        """Waiting and in-flight counts, read fresh. Raises PrefillQueueError."""
        ...

    async def pull(self, timeout: float) -> QueueItem | None:  # noqa: ASYNC109 - long-poll time, not a cancel
        """The next live job, or None if none arrived within ``timeout`` seconds."""
        ...
