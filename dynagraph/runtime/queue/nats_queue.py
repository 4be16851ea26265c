"""The prefill queue on NATS JetStream.

One stream per namespace, ``PREFILL_<namespace>``, bound to subject
``dynagraph.<namespace>.prefill``: work-queue retention (a job is deleted when acked),
file storage (jobs survive a server restart), ``max_age`` (old jobs expire), and a
duplicate window keyed on the request id (an enqueue retried after a timeout is
stored once). One durable pull consumer, ``prefill_workers``, is shared by all prefill
workers: explicit ack, ``ack_wait`` and ``max_deliver``, so a job whose worker dies is
delivered again. Creation is idempotent; the last process to start with a different
``ack_wait`` / ``max_deliver`` / ``max_age`` updates the shared configuration.

The client reconnects forever after the first successful connect; while it is
disconnected ``pull`` returns None at its timeout and ``enqueue`` / ``depth`` raise
``PrefillQueueError`` after ``request_timeout``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Literal

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from dynagraph.runtime.queue.base import (
    CONSUMER_NAME,
    DEFAULT_ACK_WAIT,
    DEFAULT_DUPLICATE_WINDOW,
    DEFAULT_MAX_AGE,
    DEFAULT_MAX_DELIVER,
    PrefillQueueError,
    QueueStats,
    stream_name,
    subject_name,
)
from dynagraph.runtime.queue.job import RemotePrefillJob, decode_job, encode_job

log = logging.getLogger(__name__)

_MIN_FETCH = 0.01  # nats-py needs a positive fetch expiry
_SUBJECTS_OVERLAP = 10065  # "subjects overlap with an existing stream" (a racing create)
_CREATE_ATTEMPTS = 4
_STREAM_IN_USE = 10058  # "stream name already in use with a different configuration"
_NATS_ERRORS = (nats.errors.Error, OSError, asyncio.TimeoutError)


class NatsQueueItem:
    """A delivery from JetStream. ``ack`` waits for the server's confirmation."""

    def __init__(self, msg: Msg, job: RemotePrefillJob, timeout: float) -> None:
        self._msg = msg
        self._job = job
        self._timeout = timeout

    @property
    def job(self) -> RemotePrefillJob:
        return self._job

    @property
    def delivery_count(self) -> int:
        return int(self._msg.metadata.num_delivered)

    async def ack(self) -> None:
        try:
            await self._msg.ack_sync(timeout=self._timeout)
        except _NATS_ERRORS as e:
            raise PrefillQueueError(
                f"ack of prefill job {self._job.request_id} not confirmed ({e!r}); "
                "it may be delivered again"
            ) from e

    async def nak(self, delay: float | None = None) -> None:
        await self._settle(self._msg.nak(delay), "nak")

    async def term(self) -> None:
        await self._settle(self._msg.term(), "term")

    async def in_progress(self) -> None:
        await self._settle(self._msg.in_progress(), "in_progress")

    async def _settle(self, op: Any, what: str) -> None:
        try:
            await asyncio.wait_for(op, self._timeout)
        except _NATS_ERRORS as e:
            raise PrefillQueueError(f"{what} of prefill job {self._job.request_id} failed: {e!r}") from e


class NatsPrefillQueue:
    """A ``PrefillQueue`` on NATS JetStream. See the module docstring."""

    def __init__(
        self,
        nats_url: str,
        namespace: str,
        *,
        ack_wait: float = DEFAULT_ACK_WAIT,
        max_deliver: int = DEFAULT_MAX_DELIVER,
        max_age: float = DEFAULT_MAX_AGE,
        duplicate_window: float = DEFAULT_DUPLICATE_WINDOW,
        storage: Literal["file", "memory"] = "file",
        request_timeout: float = 2.0,
        connect_timeout: float = 10.0,
        depth_cache_ttl: float = 0.05,
        reconnect_wait: float = 0.25,
    ) -> None:
        if ack_wait <= 0 or max_age <= 0 or max_deliver < 1:
            raise ValueError("ack_wait and max_age must be > 0 and max_deliver >= 1")
        self.url = nats_url
        self.namespace = namespace
        self.stream = stream_name(namespace)
        self.subject = subject_name(namespace)
        self.ack_wait = ack_wait
        self.max_deliver = max_deliver
        self.max_age = max_age
        self.duplicate_window = min(duplicate_window, max_age)
        self.storage = StorageType.FILE if storage == "file" else StorageType.MEMORY
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        self.depth_cache_ttl = depth_cache_ttl
        self.reconnect_wait = reconnect_wait
        self.dropped_past_deadline = 0
        self._nc: NatsClient | None = None
        self._js: JetStreamContext | None = None
        self._sub: JetStreamContext.PullSubscription | None = None
        self._depth: tuple[float, int] | None = None  # (monotonic time, value)
        self._depth_lock = asyncio.Lock()

    # -- lifecycle -----------------------------------------------------------------

    async def connect(self) -> None:
        """Connect (retrying until ``connect_timeout``) and ensure the stream and consumer."""
        if self._nc is not None and not self._nc.is_closed:
            return
        end = time.monotonic() + self.connect_timeout
        while True:
            nc = NatsClient()
            try:
                await nc.connect(
                    servers=[self.url],
                    name=f"dynagraph-prefill-queue-{self.namespace}",
                    connect_timeout=2,
                    # Fail fast on the first connect (nats-py would otherwise retry for
                    # max_reconnect_attempts x reconnect_time_wait); see below.
                    allow_reconnect=False,
                    max_reconnect_attempts=1,
                    reconnect_time_wait=0,  # the loop below paces retries
                    error_cb=self._on_error,
                    disconnected_cb=self._on_disconnected,
                    reconnected_cb=self._on_reconnected,
                )
                break
            except _NATS_ERRORS as e:
                if time.monotonic() >= end:
                    raise PrefillQueueError(
                        f"cannot connect to NATS at {self.url} within {self.connect_timeout:.0f}s "
                        f"({e!r}); is nats-server running with JetStream (-js)?"
                    ) from e
                await asyncio.sleep(min(self.reconnect_wait, max(end - time.monotonic(), 0.0)))
        # Once connected, reconnect forever (nats-py reads these options at run time).
        nc.options["allow_reconnect"] = True
        nc.options["max_reconnect_attempts"] = -1
        nc.options["reconnect_time_wait"] = self.reconnect_wait
        self._nc = nc
        self._js = nc.jetstream(timeout=self.request_timeout)
        try:
            await self._ensure()
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Close the connection. Jobs pulled and not acked come back after ack_wait."""
        nc, self._nc, self._js, self._sub = self._nc, None, None, None
        if nc is not None and not nc.is_closed:
            try:
                await asyncio.wait_for(nc.close(), self.request_timeout)
            except _NATS_ERRORS as e:
                log.warning("closing NATS connection to %s failed: %r", self.url, e)

    async def destroy(self) -> None:
        """Delete the stream, its jobs and the consumer (admin/test use)."""
        try:
            await self._jsm().delete_stream(self.stream)
        except nats.js.errors.NotFoundError:
            pass
        except _NATS_ERRORS as e:
            raise PrefillQueueError(f"cannot delete stream {self.stream}: {e!r}") from e

    async def _ensure_stream(self, js: JetStreamContext, cfg: StreamConfig) -> None:
        """Create the stream, or update it if it exists with another configuration.

        Two processes creating it at the same moment (a decode and a prefill worker
        starting together) can get "subjects overlap with an existing stream" from the
        server for the same stream; a retry then finds it and is a no-op or an update.
        """
        for attempt in range(_CREATE_ATTEMPTS):
            try:
                await js.add_stream(cfg)
                return
            except nats.js.errors.BadRequestError as e:
                if e.err_code == _STREAM_IN_USE:
                    log.info("stream %s exists with another configuration; updating it",
                             self.stream)
                    await js.update_stream(cfg)
                    return
                if e.err_code != _SUBJECTS_OVERLAP or attempt == _CREATE_ATTEMPTS - 1:
                    raise
                await asyncio.sleep(0.05 * (attempt + 1))

    def _jsm(self) -> JetStreamContext:
        if self._js is None:
            raise PrefillQueueError("prefill queue is not connected; call connect() first")
        return self._js

    async def _ensure(self) -> None:
        """Create or update the stream and the shared durable consumer (idempotent)."""
        js = self._jsm()
        cfg = StreamConfig(
            name=self.stream,
            subjects=[self.subject],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=self.storage,
            max_age=self.max_age,
            duplicate_window=self.duplicate_window,
            discard=DiscardPolicy.OLD,
        )
        try:
            await self._ensure_stream(js, cfg)
            await js.add_consumer(
                self.stream,
                ConsumerConfig(
                    durable_name=CONSUMER_NAME,
                    ack_policy=AckPolicy.EXPLICIT,
                    ack_wait=self.ack_wait,
                    max_deliver=self.max_deliver,
                ),
            )
        except _NATS_ERRORS as e:
            raise PrefillQueueError(
                f"cannot create prefill queue stream {self.stream} / consumer {CONSUMER_NAME} "
                f"on {self.url}: {e!r}"
            ) from e

    # -- producer side -------------------------------------------------------------

    async def enqueue(self, job: RemotePrefillJob) -> None:
        """Publish ``job`` and wait for JetStream to store it; one retry after a timeout."""
        js = self._jsm()
        data = encode_job(job)
        headers = {"Nats-Msg-Id": job.request_id}
        last: BaseException | None = None
        for attempt in range(2):
            try:
                ack = await js.publish(self.subject, data, timeout=self.request_timeout, headers=headers)
                if ack.duplicate:
                    log.debug("prefill job %s was already stored", job.request_id)
                self._depth = None
                return
            except nats.js.errors.NoStreamResponseError as e:
                last = e
                log.warning("no stream for %s; recreating it", self.subject)
                await self._ensure()
            except (nats.errors.TimeoutError, nats.errors.ConnectionReconnectingError) as e:
                last = e
                log.warning("enqueue of %s timed out (attempt %d): %r", job.request_id, attempt + 1, e)
            except _NATS_ERRORS as e:
                last = e
                break
        raise PrefillQueueError(f"cannot enqueue prefill job {job.request_id}: {last!r}") from last

    async def depth(self) -> int:
        """Jobs not yet delivered (JetStream ``num_pending``); cached ``depth_cache_ttl`` s."""
        async with self._depth_lock:
            cached = self._depth
            if cached is not None and time.monotonic() - cached[0] < self.depth_cache_ttl:
                return cached[1]
            stats = await self.stats()
            return stats.waiting

    async def stats(self) -> QueueStats:
        """Fresh ``num_pending`` / ``num_ack_pending`` of the shared consumer."""
        js = self._jsm()
        try:
            try:
                info = await js.consumer_info(self.stream, CONSUMER_NAME, timeout=self.request_timeout)
            except nats.js.errors.NotFoundError:
                log.warning("prefill queue %s missing (server lost its state?); recreating", self.stream)
                await self._ensure()
                info = await js.consumer_info(self.stream, CONSUMER_NAME, timeout=self.request_timeout)
        except _NATS_ERRORS as e:
            raise PrefillQueueError(f"cannot read prefill queue depth of {self.stream}: {e!r}") from e
        stats = QueueStats(waiting=int(info.num_pending or 0), in_flight=int(info.num_ack_pending or 0))
        self._depth = (time.monotonic(), stats.waiting)
        return stats

    # -- consumer side -------------------------------------------------------------

    async def pull(self, timeout: float) -> NatsQueueItem | None:  # noqa: ASYNC109 - long-poll time, not a cancel
        """Fetch one job for this worker, or None after ``timeout`` s.

        Jobs past their deadline and undecodable jobs are terminated and skipped.
        """
        end = time.monotonic() + max(timeout, 0.0)
        first = True
        while True:
            remaining = end - time.monotonic()
            if remaining <= 0 and not first:
                return None
            first = False
            msg = await self._fetch_one(max(remaining, _MIN_FETCH))
            if msg is None:
                continue
            try:
                job = decode_job(msg.data)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                log.error("undecodable prefill job on %s terminated: %s", self.stream, e)
                try:
                    await asyncio.wait_for(msg.term(), self.request_timeout)
                except _NATS_ERRORS as err:
                    log.warning("term of an undecodable job failed: %r", err)
                continue
            item = NatsQueueItem(msg, job, self.request_timeout)
            if job.expired():
                log.info("prefill job %s is past its deadline; dropped", job.request_id)
                self.dropped_past_deadline += 1
                await item.term()
                continue
            return item

    async def _fetch_one(self, wait: float) -> Msg | None:
        """One fetch; None on timeout or a transient error (after a short pause)."""
        try:
            sub = await self._subscription()
            msgs = await sub.fetch(1, timeout=wait)
            return msgs[0]
        except nats.errors.TimeoutError:
            return None
        except (nats.js.errors.NotFoundError, nats.js.errors.ServiceUnavailableError) as e:
            log.warning("prefill consumer on %s unavailable (%r); recreating", self.stream, e)
            await self._pause(wait)
            try:
                await self._ensure()
            except PrefillQueueError as err:
                log.warning("%s", err)
            return None
        except _NATS_ERRORS as e:
            log.warning("fetch from %s failed: %r", self.stream, e)
            await self._pause(wait)
            return None

    async def _pause(self, wait: float) -> None:
        await asyncio.sleep(min(self.reconnect_wait, wait))

    async def _subscription(self) -> JetStreamContext.PullSubscription:
        if self._sub is None:
            self._sub = await self._jsm().pull_subscribe_bind(durable=CONSUMER_NAME, stream=self.stream)
        return self._sub

    # -- connection callbacks ------------------------------------------------------

    async def _on_error(self, e: Exception) -> None:
        log.debug("NATS %s: %r", self.url, e)

    async def _on_disconnected(self) -> None:
        if self._nc is not None and not self._nc.is_closed:  # not our own close()
            log.warning("prefill queue disconnected from NATS %s; reconnecting", self.url)

    async def _on_reconnected(self) -> None:
        log.info("prefill queue reconnected to NATS %s", self.url)
        self._depth = None

