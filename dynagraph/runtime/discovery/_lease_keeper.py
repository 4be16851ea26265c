"""Keeps an etcd lease alive from a thread of its own, through etcd's JSON gateway.

Why a thread: the process's event loop also serves its streams, and under load (a
Frontend writing thousands of SSE chunks a second on a 2-core host) a keepalive sent
through ``aetcd``'s gRPC client on that loop took more than the 3 s TTL to come back
("Deadline Exceeded"), so etcd dropped the lease and every registration under it
vanished until it was granted again. A thread that needs the GIL gets it
within the interpreter's switch interval (5 ms) however busy the loop is, and a plain
HTTP/1.1 request to etcd's gateway (``POST /v3/lease/keepalive``, on by default on
etcd's client URL since 3.4) needs nothing of the loop.

One keeper per process and etcd (``join_keeper``): every lease of the process is
refreshed in one request per interval (the gateway's keepalive is a stream: a body of
several JSON requests gets one reply line each): a process of 64 mocker engines holds 64
leases, and a request per lease per interval would keep etcd busy at idle.

The keeper only refreshes. What a refresh learns goes back to the loop through
callbacks the owner makes thread-safe: ``on_lost(lease)`` when etcd answers that a
lease no longer exists (it re-grants there: registrations are async work), and
``on_unsupported(reason)`` when the endpoint has no gateway (the owner falls back to
refreshing on the loop). Connection errors (etcd restarting) are retried with backoff,
across the endpoints, and logged once per outage.
"""

from __future__ import annotations

import contextlib
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


def refresh_leases(conn: http.client.HTTPConnection, leases: Sequence[int]) -> dict[int, int]:
    """One keepalive of each of ``leases`` over ``conn``, in one request: the TTL etcd
    gives each lease it answered for (0: it no longer exists). The gateway may end its
    reply early (it stops when the request stream ends: 64 leases got only 17 replies in
    13 of 100 tries on etcd 3.4), so leases can be missing: ask again for those. Raises
    ``OSError``/``http.client.HTTPException`` for a failed exchange (no reply at all
    included), ``GatewayMissing`` when the endpoint has no gateway."""
    body = "\n".join(json.dumps({"ID": str(lease)}) for lease in leases)
    conn.request("POST", "/v3/lease/keepalive", body=body,
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    raw = resp.read()
    if resp.status in _NO_GATEWAY:
        raise GatewayMissing(f"HTTP {resp.status} for POST /v3/lease/keepalive")
    if resp.status != 200:
        raise http.client.HTTPException(f"HTTP {resp.status}: {raw[:200]!r}")
    ttls: dict[int, int] = {}
    lines = [line for line in raw.splitlines() if line.strip()]
    if not lines:
        raise http.client.HTTPException("an empty keepalive reply")
    for line in lines:
        try:
            reply = json.loads(line)
        except ValueError as e:
            raise GatewayMissing(f"not an etcd keepalive reply: {raw[:200]!r}") from e
        if isinstance(reply, dict) and "error" in reply:  # a stream's error: etcd is there
            raise http.client.HTTPException(f"etcd: {reply['error']}")
        result = reply.get("result") if isinstance(reply, dict) else None
        if not isinstance(result, dict) or "ID" not in result:
            raise GatewayMissing(f"not an etcd keepalive reply: {raw[:200]!r}")
        # TTL absent (protobuf's zero): the lease is gone
        ttls[int(result["ID"])] = int(result.get("TTL", 0))
    return ttls


class _Member:
    """One lease holder: ``lease()`` is read before each refresh (None: skip it)."""

    __slots__ = ("lease", "on_lost", "on_unsupported", "reported")

    def __init__(self, lease: Callable[[], int | None], on_lost: Callable[[int], None],
                 on_unsupported: Callable[[str], None]) -> None:
        self.lease = lease
        self.on_lost = on_lost
        self.on_unsupported = on_unsupported
        self.reported: int | None = None  # the lost lease last reported


class LeaseKeeper:
    """Refreshes its members' leases every ``interval`` seconds from a daemon thread.

    ``on_lost`` is called once per lost lease id (the member replaces the lease; its
    ``lease()`` then names the new one). Members join and leave at any time.
    """

    def __init__(self, endpoints: Sequence[tuple[str, int]], *, interval: float,
                 timeout: float) -> None:
        self._endpoints = list(endpoints)
        self._interval = interval
        self._timeout = timeout
        self._members: list[_Member] = []
        self._lock = threading.Lock()
        self._unsupported: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="etcd-lease-keeper", daemon=True)
        self.refreshes = 0

    def add(self, lease: Callable[[], int | None], *, on_lost: Callable[[int], None],
            on_unsupported: Callable[[str], None]) -> _Member:
        member = _Member(lease, on_lost, on_unsupported)
        with self._lock:
            self._members.append(member)
            unsupported = self._unsupported
        if unsupported is not None:  # the thread has stopped: the member refreshes itself
            on_unsupported(unsupported)
        return member

    def remove(self, member: _Member) -> int:
        """Stop refreshing ``member``'s lease; the members left."""
        with self._lock:
            with contextlib.suppress(ValueError):
                self._members.remove(member)
            return len(self._members)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop refreshing; waits up to ``timeout`` for a refresh in flight."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _due(self) -> dict[int, list[_Member]]:
        with self._lock:
            members = list(self._members)
        due: dict[int, list[_Member]] = {}
        for m in members:
            lease = m.lease()
            if lease is not None:
                due.setdefault(lease, []).append(m)
        return due

    def _run(self) -> None:
        at = 0  # the endpoint in use
        conn: http.client.HTTPConnection | None = None
        delay, backoff = self._interval, BACKOFF_START
        failing_since: float | None = None
        woke = time.monotonic()
        try:
            while not self._stop.wait(delay):
                late = time.monotonic() - woke - delay
                if late > self._interval:
                    log.warning("lease keepalive woke %.2fs late (its process was busy, "
                                "or etcd slow to answer the last refresh)", late)
                woke = time.monotonic()
                due = self._due()
                if not due:
                    continue
                if conn is None:
                    host, port = self._endpoints[at]
                    conn = http.client.HTTPConnection(host.strip("[]"), port,
                                                      timeout=self._timeout)
                try:
                    ttls: dict[int, int] = {}
                    while missing := [lease for lease in due if lease not in ttls]:
                        got = refresh_leases(conn, missing)
                        if not got.keys() & set(missing):
                            raise http.client.HTTPException(f"no reply for leases {missing}")
                        ttls.update(got)
                except GatewayMissing as e:
                    reason = f"{conn.host}:{conn.port}: {e}"
                    with self._lock:
                        self._unsupported = reason
                        members = list(self._members)
                    for m in members:
                        m.on_unsupported(reason)
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
                for lease, members in due.items():
                    if ttls[lease] > 0:
                        continue
                    for m in members:
                        if m.reported != lease:
                            m.reported = lease
                            m.on_lost(lease)
                        else:
                            delay = BACKOFF_START  # being granted anew: look again soon
        finally:
            if conn is not None:
                conn.close()


_shared: dict[tuple[tuple[tuple[str, int], ...], float, float], LeaseKeeper] = {}
_shared_lock = threading.Lock()


def join_keeper(endpoints: Sequence[tuple[str, int]], *, interval: float, timeout: float,
                lease: Callable[[], int | None], on_lost: Callable[[int], None],
                on_unsupported: Callable[[str], None]) -> Callable[[float | None], None]:
    """Have this process's keeper for ``endpoints`` (started on first use) refresh
    ``lease()`` every ``interval`` s; returns ``leave(timeout)``, which stops that (and
    the keeper's thread with the last member, waiting up to ``timeout`` for it)."""
    key = (tuple(endpoints), interval, timeout)
    with _shared_lock:
        keeper = _shared.get(key)
        if keeper is None:
            keeper = _shared[key] = LeaseKeeper(endpoints, interval=interval, timeout=timeout)
            keeper.start()
        member = keeper.add(lease, on_lost=on_lost, on_unsupported=on_unsupported)

    def leave(wait: float | None = None) -> None:
        with _shared_lock:
            if keeper.remove(member) or _shared.get(key) is not keeper:
                return
            del _shared[key]
        keeper.stop(wait)

    return leave
