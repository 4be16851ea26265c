"""LeaseKeeper against a stand-in for etcd's JSON gateway (a local HTTP server): what
it reports back, retries, and the fallback when there is no gateway. The real etcd is
in tests/integration/discovery."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dynagraph.runtime.discovery import _lease_keeper
from dynagraph.runtime.discovery._lease_keeper import LeaseKeeper, join_keeper
from tests.support.poll import wait_until


class Gateway(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.ttl = 3
        self.status = 200
        self.error_replies = 0  # replies that are a stream error, as etcd sends when busy
        self.seen: list[str] = []
        self.gone: set[str] = set()  # lease ids answered as no longer existing
        self.requests = 0
        self.cut_after: int | None = None  # reply lines sent at most (etcd's early end)

    @property
    def endpoint(self) -> tuple[str, int]:
        return "127.0.0.1", self.server_address[1]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Gateway

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        # the keepalive stream: one JSON request per line, one reply line each
        raw = b""
        self.server.requests += 1
        lines = self.rfile.read(int(self.headers["Content-Length"])).splitlines()
        for line in lines[:self.server.cut_after]:
            body = json.loads(line)
            self.server.seen.append(f"{self.path} {body['ID']}")
            result: dict[str, str] = {"ID": body["ID"]}
            if self.server.ttl and body["ID"] not in self.server.gone:
                result["TTL"] = str(self.server.ttl)
            reply: dict[str, object] = {"result": result}
            if self.server.error_replies:
                self.server.error_replies -= 1
                reply = {"error": {"grpc_code": 14, "message": "etcdserver: request timed out"}}
            raw += json.dumps(reply).encode() + b"\n"
        self.send_response(self.server.status)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def gateway() -> Iterator[Gateway]:
    server = Gateway()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(5)


def keeper(endpoints: list[tuple[str, int]], events: list[object]) -> LeaseKeeper:
    k = LeaseKeeper(endpoints, interval=0.02, timeout=1.0)
    k.add(lambda: 42, on_lost=events.append, on_unsupported=events.append)
    return k


def refreshed(endpoints: list[tuple[str, int]], times: int) -> list[object]:
    """Run a keeper until it has refreshed ``times`` times; what it reported."""
    events: list[object] = []
    k = keeper(endpoints, events)
    k.start()
    try:
        wait_until(lambda: k.refreshes >= times, 5, f"{times} refreshes", 0.01)
    finally:
        k.stop(2)
    return events


def test_refreshes_the_lease_it_is_given(gateway: Gateway) -> None:
    assert refreshed([gateway.endpoint], 3) == []
    assert set(gateway.seen) == {"/v3/lease/keepalive 42"}


def test_a_lost_lease_is_reported_once(gateway: Gateway) -> None:
    gateway.ttl = 0  # etcd leaves TTL out of the reply when the lease is gone
    assert refreshed([gateway.endpoint], 4) == [42]


def test_an_endpoint_without_the_gateway_is_reported(gateway: Gateway) -> None:
    gateway.status = 404
    events: list[object] = []
    k = keeper([gateway.endpoint], events)
    k.start()
    wait_until(lambda: bool(events), 5, "the report", 0.01)
    late: list[object] = []  # a member joining after that is told at once
    k.add(lambda: 7, on_lost=late.append, on_unsupported=late.append)
    k.stop(2)
    assert len(events) == 1 and "HTTP 404" in str(events[0])
    assert len(late) == 1 and "HTTP 404" in str(late[0])


def test_an_endpoint_that_is_down_is_retried_then_the_next_one_used(gateway: Gateway) -> None:
    down = Gateway()  # bound, then closed: its port refuses connections
    down.server_close()
    assert refreshed([down.endpoint, gateway.endpoint], 2) == []


def test_an_error_reply_is_retried_not_taken_for_a_missing_gateway(gateway: Gateway) -> None:
    gateway.error_replies = 2
    assert refreshed([gateway.endpoint], 2) == []
    assert gateway.error_replies == 0


def test_every_lease_of_the_process_is_refreshed_in_one_request(gateway: Gateway) -> None:
    lost: dict[int, list[int]] = {1: [], 2: [], 3: []}
    leave = [join_keeper([gateway.endpoint], interval=0.02, timeout=1.0, lease=lambda i=i: i,
                         on_lost=lost[i].append, on_unsupported=lost[i].append)
             for i in lost]
    try:
        assert len(_lease_keeper._shared) == 1  # one thread for all three
        gateway.gone = {"2"}
        wait_until(lambda: gateway.requests >= 4, 5, "4 refreshes", 0.01)
        assert {s.split()[1] for s in gateway.seen} == {"1", "2", "3"}
        assert len(gateway.seen) >= 3 * (gateway.requests - 1)  # all leases, every time
        assert lost == {1: [], 2: [2], 3: []}  # only its holder hears, once
    finally:
        for f in leave:
            f(2)
    assert not _lease_keeper._shared  # the last one out stopped the thread


def test_leases_a_cut_short_reply_left_out_are_asked_for_again(gateway: Gateway) -> None:
    gateway.cut_after = 2  # etcd's gateway ends its reply when the request stream ends
    events: list[object] = []
    k = LeaseKeeper([gateway.endpoint], interval=0.02, timeout=1.0)
    for i in range(5):
        k.add(lambda i=i: i, on_lost=events.append, on_unsupported=events.append)
    k.start()
    try:
        wait_until(lambda: k.refreshes >= 2, 5, "2 refreshes", 0.01)
    finally:
        k.stop(2)
    assert events == []
    assert {s.split()[1] for s in gateway.seen} == {"0", "1", "2", "3", "4"}


def test_a_keeper_that_ran_late_says_so(gateway: Gateway,
                                        caplog: pytest.LogCaptureFixture) -> None:
    """A process too busy to run the keeper for a while (here: one lease lookup that takes
    ten intervals) is named in the log before etcd expires its leases."""
    calls = 0
    stalled = threading.Event()

    def lease() -> int:
        nonlocal calls
        calls += 1
        if calls == 2:
            stalled.wait(0.2)  # nothing sets it: the stall itself
        return 42

    k = LeaseKeeper([gateway.endpoint], interval=0.02, timeout=1.0)
    k.add(lease, on_lost=lambda _: None, on_unsupported=lambda _: None)
    with caplog.at_level("WARNING", logger=_lease_keeper.__name__):
        k.start()
        try:
            wait_until(lambda: k.refreshes >= 3, 5, "3 refreshes", 0.01)
        finally:
            k.stop(2)
    assert any("woke" in r.message and "late" in r.message for r in caplog.records)
