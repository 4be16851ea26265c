"""The engine-side connector: routing, expert-group sums, failover, giving up clearly."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dynagraph.llm.afd.connector import AfdConnector
from dynagraph.llm.afd.errors import AfdUnavailable
from dynagraph.llm.afd.server import FfnServer
from dynagraph.llm.afd.settings import (
    AfdEngineConfig,
    PeerInfo,
    read_failure,
    write_engine_config,
)
from dynagraph.runtime.addresses import host_id

from .fakes import DTYPE, HIDDEN, ScaleFfn, rows


class Fleet:
    """Real FfnServers with fake computes, and the AFD file listing them."""

    def __init__(self, path: Path, **options: object) -> None:
        self.path = path
        self.options = options
        self.servers: dict[str, FfnServer] = {}

    def add(self, name: str, layers: list[int], experts: list[int] | None = None,
            gate: threading.Event | None = None) -> FfnServer:
        s = FfnServer(ScaleFfn(layers, experts, gate), instance=name, io_timeout_s=5)
        s.start()
        self.servers[name] = s
        self.write()
        return s

    def kill(self, name: str, *, unlist: bool = False) -> None:
        self.servers[name].stop(timeout=0.5)
        if unlist:
            del self.servers[name]
            self.write()

    def write(self) -> None:
        peers = [PeerInfo(instance=n, model="fake", tcp=s.tcp_address, uds=s.uds_address,
                          host=host_id(), layers=s.compute.layers, experts=s.compute.experts)
                 for n, s in self.servers.items()]
        config = AfdEngineConfig(model="fake", peers=peers,
                                 error_file=str(self.path.parent / "error.txt"),
                                 **self.options)  # type: ignore[arg-type]
        write_engine_config(self.path, config)
        # the connector notices changes by modification time; make each write distinct
        stamp = time.time_ns() + len(self.servers)
        os.utime(self.path, ns=(stamp, stamp))

    def close(self) -> None:
        for s in self.servers.values():
            s.stop()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = Fleet(tmp_path / "afd.json", failover_timeout_s=1.0, call_timeout_s=2.0)
    yield f
    f.close()


def connector(fleet: Fleet, num_experts: int = 0, prefer: int = 0) -> AfdConnector:
    return AfdConnector(fleet.path, num_layers=4, num_experts=num_experts, hidden_size=HIDDEN,
                        dtype=DTYPE, max_rows=32, prefer=prefer)


def test_layers_go_to_their_holders(fleet: Fleet) -> None:
    low, high = fleet.add("low", [0, 1]), fleet.add("high", [2, 3])
    conn = connector(fleet)
    x = rows(6)
    for layer in range(4):
        assert torch.equal(conn.collect(conn.submit(layer, x)), x * (layer + 2))
    assert (low.stats.calls, high.stats.calls) == (2, 2)
    conn.close()


def test_expert_groups_are_summed_in_float32(fleet: Fleet) -> None:
    fleet.add("e0", [0, 1, 2, 3], [0])
    fleet.add("e123", [0, 1, 2, 3], [1, 2, 3])
    conn = connector(fleet, num_experts=4)
    x = rows(5)
    out = conn.collect(conn.submit(1, x))
    assert out.dtype == DTYPE
    assert torch.equal(out, (x.float() * 1 + (x * 3).float()).to(DTYPE))
    assert conn.stats.parts == 2
    conn.close()


def test_ping_pong_calls_interleave(fleet: Fleet) -> None:
    fleet.add("all", [0, 1, 2, 3])
    conn = connector(fleet)
    a, b = rows(3, 1), rows(4, 2)
    ca, cb = conn.submit(0, a), conn.submit(0, b)
    ca2 = conn.submit(1, conn.collect(ca))
    cb2 = conn.submit(1, conn.collect(cb))
    assert torch.equal(conn.collect(ca2), a * 2 * 3)
    assert torch.equal(conn.collect(cb2), b * 2 * 3)
    conn.close()


def test_a_killed_worker_fails_over_to_a_replica_mid_flight(fleet: Fleet) -> None:
    stuck = threading.Event()  # the first replica never finishes a call
    conn = None
    try:
        fleet.add("r1", [0, 1, 2, 3], gate=stuck)
        fleet.add("r2", [0, 1, 2, 3])
        conn = connector(fleet)
        conn.prefer = next(p for p in range(8)
                           if (conn.table.route(0, prefer=p) or [])[0].peer.instance == "r1")
        x = rows(4)
        call_a = conn.submit(0, x)      # on the worker about to die
        call_b = conn.submit(1, x)      # in flight too (on either replica)
        fleet.kill("r1")                # still listed (its lease has not expired yet)
        assert torch.equal(conn.collect(call_a), x * 2)
        assert torch.equal(conn.collect(call_b), x * 3)
        assert conn.stats.failovers >= 1 and "r1" in conn._dead
        assert torch.equal(conn.collect(conn.submit(2, x)), x * 4)
        assert fleet.servers["r2"].stats.calls == 3
    finally:
        stuck.set()
        if conn is not None:
            conn.close()


def test_waits_for_a_replacement_listed_in_the_file(fleet: Fleet) -> None:
    fleet.options["failover_timeout_s"] = 10.0
    fleet.add("only", [0, 1, 2, 3])
    conn = connector(fleet)
    x = rows(2)
    assert torch.equal(conn.collect(conn.submit(0, x)), x * 2)
    fleet.kill("only", unlist=True)

    def replace() -> None:
        time.sleep(0.5)
        fleet.add("restarted", [0, 1, 2, 3])

    t = threading.Thread(target=replace)
    t.start()
    began = time.monotonic()
    assert torch.equal(conn.collect(conn.submit(3, x)), x * 5)
    t.join()
    assert 0.3 < time.monotonic() - began < 5
    conn.close()


def test_gives_up_with_a_clear_error_and_reports_it(fleet: Fleet) -> None:
    stuck = threading.Event()  # the call is still computing when the worker dies
    try:
        fleet.add("only", [0, 1, 2, 3], gate=stuck)
        conn = connector(fleet)
        call = conn.submit(0, rows(2))
        fleet.kill("only")
        began = time.monotonic()
        with pytest.raises(AfdUnavailable, match="no FfnWorker can compute layer 0 of fake"):
            conn.collect(call)
        assert time.monotonic() - began < 3  # failover_timeout_s is 1 s: nothing hangs
        failure = read_failure(fleet.path.parent / "error.txt")
        assert failure is not None and failure.failed == ["only"]
        assert "layer 0" in failure.reason and "only" in failure.reason
        conn.close()
    finally:
        stuck.set()


def test_a_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(AfdUnavailable, match="cannot read the AFD file"):
        AfdConnector(tmp_path / "nope.json", num_layers=1, num_experts=0, hidden_size=HIDDEN,
                     dtype=DTYPE, max_rows=4)
