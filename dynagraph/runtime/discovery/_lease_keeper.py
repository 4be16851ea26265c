"""Keeps an etcd lease alive from a thread of its own, through etcd's JSON gateway.

Why a thread: the process's event loop also serves its streams, and under load (a
Frontend writing thousands of SSE chunks a second on a 2-core host) a keepalive sent
through ``aetcd``'s gRPC client on that loop took more than the 3 s TTL to come back
("Deadline Exceeded"), so etcd dropped the lease and every registration under it
vanished until it was granted again (measured: ``vllm bench serve`` at 64 streams with
the engine at niceness 0, several lapses a minute). A thread that needs the GIL gets it
within the interpreter's switch interval (5 ms) however busy the loop is, and a plain
HTTP/1.1 request to etcd's gateway (``POST /v3/lease/keepalive``, on by default on
etcd's client URL since 3.4) needs nothing of the loop.

The keeper only refreshes. What a refresh learns goes back to the loop through
callbacks the owner makes thread-safe: ``on_lost(lease)`` when etcd answers that the
lease no longer exists (it re-grants there: registrations are async work), and
``on_unsupported(reason)`` when the endpoint has no gateway (the owner falls back to
refreshing on the loop). Connection errors (etcd restarting) are retried with backoff,
across the endpoints, and logged once per outage.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence

from dynagraph.runtime.discovery._etcd_mirror import BACKOFF_MAX, BACKOFF_START

log = logging.getLogger(__name__)

_NO_GATEWAY = (404, 405, 501)
"""Statuses of an endpoint that does not serve etcd's JSON gateway."""


class GatewayMissing(Exception):
    """The endpoint answered, but not as etcd's JSON gateway does."""


def refresh_lease(conn: http.client.HTTPConnection, lease: int) -> int:
    """One keepalive of ``lease`` over ``conn``: the TTL etcd gives it (0: it no longer
    exists). Raises ``OSError``/``http.client.HTTPException`` for a failed exchange,
    ``GatewayMissing`` when the endpoint has no gateway."""
    body = json.dumps({"ID": str(lease)})
    conn.request("POST", "/v3/lease/keepalive", body=body,
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read()
    if resp.status in _NO_GATEWAY:
        raise GatewayMissing(f"HTTP {resp.status} for POST /v3/lease/keepalive")
    if resp.status != 200:
        raise http.client.HTTPException(f"HTTP {resp.status}: {raw[:200]!r}")
    try:
        reply = json.loads(raw.splitlines()[0])
    except (ValueError, IndexError) as e:
        raise GatewayMissing(f"not an etcd keepalive reply: {raw[:200]!r}") from e
    if isinstance(reply, dict) and "error" in reply:  # a stream's error: etcd is there
        raise http.client.HTTPException(f"etcd: {reply['error']}")
    if not isinstance(reply, dict) or not isinstance(reply.get("result"), dict):
        raise GatewayMissing(f"not an etcd keepalive reply: {raw[:200]!r}")
    return int(reply["result"].get("TTL", 0))  # absent (protobuf's zero): the lease is gone


class LeaseKeeper:
    """Refreshes ``lease()`` every ``interval`` seconds from a daemon thread.

    ``lease()`` is read before each refresh (the owner replaces the lease after a loss);
    None skips a turn. ``on_lost`` is called once per lost lease id.
    """

    def __init__(self, endpoints: Sequence[tuple[str, int]], *, interval: float,
                 timeout: float, lease: Callable[[], int | None],
                 on_lost: Callable[[int], None],
                 on_unsupported: Callable[[str], None]) -> None:
        self._endpoints = list(endpoints)
        self._interval = interval
        self._timeout = timeout
        self._lease = lease
        self._on_lost = on_lost
        self._on_unsupported = on_unsupported
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="etcd-lease-keeper", daemon=True)
        self.refreshes = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop refreshing; waits up to ``timeout`` for a refresh in flight."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        at = 0  # the endpoint in use
        conn: http.client.HTTPConnection | None = None
        delay, backoff = self._interval, BACKOFF_START
        failing_since: float | None = None
        reported: int | None = None  # the lost lease last reported
        try:
            while not self._stop.wait(delay):
                lease = self._lease()
                if lease is None:
                    continue
                if conn is None:
                    host, port = self._endpoints[at]
                    conn = http.client.HTTPConnection(host.strip("[]"), port,
                                                      timeout=self._timeout)
                try:
                    ttl = refresh_lease(conn, lease)
                except GatewayMissing as e:
                    self._on_unsupported(f"{conn.host}:{conn.port}: {e}")
                    return
                except (OSError, http.client.HTTPException) as e:
                    conn.close()
                    conn = None
                    at = (at + 1) % len(self._endpoints)
                    if failing_since is None:
                        failing_since = time.monotonic()
                        log.warning("lease keepalive failed (%r); retrying with backoff", e)
                    delay, backoff = backoff, min(backoff * 2, BACKOFF_MAX)
                    continue
                self.refreshes += 1
                if failing_since is not None:
                    log.warning("lease keepalive recovered after %.2fs",
                                time.monotonic() - failing_since)
                    failing_since = None
                delay, backoff = self._interval, BACKOFF_START
                if ttl <= 0 and reported != lease:
                    reported = lease
                    self._on_lost(lease)
                elif ttl <= 0:
                    delay = BACKOFF_START  # the owner is granting a new one: look again soon
        finally:
            if conn is not None:
                conn.close()
