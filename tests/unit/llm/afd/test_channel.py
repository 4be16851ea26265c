"""Engine <-> FfnWorker exchange over both transports, against a real FfnServer."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from dynagraph.llm.afd.channel import Endpoint, FfnChannel
from dynagraph.llm.afd.errors import AfdError, ChannelError
from dynagraph.llm.afd.server import FfnServer

from .fakes import DTYPE, HIDDEN, ScaleFfn, rows


@pytest.fixture
def server() -> Iterator[FfnServer]:
    s = FfnServer(ScaleFfn([0, 1]), instance="s1", io_timeout_s=5)
    s.start()
    yield s
    s.stop()


def channel(s: FfnServer, transport: str, *, max_rows: int = 16, model: str = "fake",
            timeout_s: float = 5.0) -> FfnChannel:
    return FfnChannel(Endpoint("s1", s.tcp_address, s.uds_address), transport,  # type: ignore[arg-type]
                      model=model, hidden_size=HIDDEN, dtype=DTYPE, client="test",
                      max_rows=max_rows, timeout_s=timeout_s)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_round_trip_and_ping_pong(server: FfnServer, transport: str) -> None:
    ch = channel(server, transport)
    welcome = ch.connect()
    assert welcome.ok and welcome.layers == [0, 1] and welcome.experts is None
    a, b = rows(3, 1), rows(5, 2)
    sa = ch.submit(0, a)
    sb = ch.submit(1, b)               # two in flight: micro-batch ping-pong
    assert ch.in_flight == 2
    out_b, _ = ch.collect(sb)          # out of order: a's result is kept for later
    out_a, us = ch.collect(sa)
    assert torch.equal(out_a, a * 2) and torch.equal(out_b, b * 3) and us >= 0
    big = rows(40, 3)                  # more rows than a shared-memory area: inline
    assert torch.equal(ch.collect(ch.submit(1, big))[0], big * 3)
    assert server.stats.calls == 3 and server.stats.rows == 48
    ch.close()


def test_shared_memory_results_are_copies(server: FfnServer) -> None:
    ch = channel(server, "shm")
    ch.connect()
    first, _ = ch.collect(ch.submit(0, rows(4, 1)))
    kept = first.clone()
    ch.collect(ch.submit(0, rows(4, 2)))  # same area reused
    assert torch.equal(first, kept)
    ch.close()


def test_a_failed_call_is_reported_and_the_channel_stays_usable(server: FfnServer) -> None:
    ch = channel(server, "tcp")
    ch.connect()
    with pytest.raises(AfdError, match="layer 7 is not served") as err:
        ch.collect(ch.submit(7, rows(2)))
    assert not isinstance(err.value, ChannelError)
    assert torch.equal(ch.collect(ch.submit(1, rows(2)))[0], rows(2) * 3)
    assert server.stats.errors == 1
    ch.close()


def test_a_mismatched_engine_is_refused(server: FfnServer) -> None:
    with pytest.raises(AfdError, match="model 'other'"):
        channel(server, "tcp", model="other").connect()


def test_a_dead_server_raises_channel_error() -> None:
    stuck = threading.Event()  # the call is still computing when the server goes
    server = FfnServer(ScaleFfn([0], gate=stuck), io_timeout_s=5)
    server.start()
    try:
        ch = channel(server, "shm")
        ch.connect()
        seq = ch.submit(0, rows(2))
        server.stop(timeout=0.5)
        with pytest.raises(ChannelError):
            ch.collect(seq)
        assert not ch.connected
        with pytest.raises(ChannelError):
            ch.submit(0, rows(2))
    finally:
        stuck.set()
        server.stop()


def test_unreachable_worker() -> None:
    ch = FfnChannel(Endpoint("gone", "127.0.0.1:1", "@dynagraph-afd-nobody"), "shm",
                    model="fake", hidden_size=HIDDEN, dtype=DTYPE, client="t", max_rows=4)
    with pytest.raises(ChannelError, match="cannot reach"):
        ch.connect()


def test_a_hung_worker_times_out() -> None:
    gate = threading.Event()
    s = FfnServer(ScaleFfn([0], gate=gate), io_timeout_s=5)
    s.start()
    try:
        ch = channel(s, "tcp", timeout_s=0.3)
        ch.connect()
        seq = ch.submit(0, rows(1))
        with pytest.raises(ChannelError, match="timed out"):
            ch.collect(seq)
    finally:
        gate.set()
        s.stop()


def test_many_engines_share_one_worker(server: FfnServer) -> None:
    errors: list[BaseException] = []

    def engine(seed: int) -> None:
        try:
            ch = channel(server, "shm" if seed % 2 else "tcp")
            ch.connect()
            for i in range(50):
                x = rows(1 + i % 7, seed * 100 + i)
                assert torch.equal(ch.collect(ch.submit(i % 2, x))[0], x * (i % 2 + 2))
            ch.close()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=engine, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == [] and server.stats.calls == 200
