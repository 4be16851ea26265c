"""LeaseKeeper against a stand-in for etcd's JSON gateway (a local HTTP server): what
it reports back, retries, and the fallback when there is no gateway. The real etcd is
in tests/integration/discovery."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dynagraph.runtime.discovery._lease_keeper import LeaseKeeper
from tests.support.poll import wait_until


class Gateway(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.ttl = 3
        self.status = 200
        self.error_replies = 0  # replies that are a stream error, as etcd sends when busy
        self.seen: list[str] = []

    @property
    def endpoint(self) -> tuple[str, int]:
        return "127.0.0.1", self.server_address[1]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Gateway

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append(f"{self.path} {body['ID']}")
        result: dict[str, str] = {"ID": body["ID"]}
        if self.server.ttl:
            result["TTL"] = str(self.server.ttl)
        reply: dict[str, object] = {"result": result}
        if self.server.error_replies:
            self.server.error_replies -= 1
            reply = {"error": {"grpc_code": 14, "message": "etcdserver: request timed out"}}
        raw = json.dumps(reply).encode() + b"\n"
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
    return LeaseKeeper(endpoints, interval=0.02, timeout=1.0, lease=lambda: 42,
                       on_lost=events.append, on_unsupported=events.append)


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
    k.stop(2)
    assert len(events) == 1 and "HTTP 404" in str(events[0])


def test_an_endpoint_that_is_down_is_retried_then_the_next_one_used(gateway: Gateway) -> None:
    down = Gateway()  # bound, then closed: its port refuses connections
    down.server_close()
    assert refreshed([down.endpoint, gateway.endpoint], 2) == []


def test_an_error_reply_is_retried_not_taken_for_a_missing_gateway(gateway: Gateway) -> None:
    gateway.error_replies = 2
    assert refreshed([gateway.endpoint], 2) == []
    assert gateway.error_replies == 0
