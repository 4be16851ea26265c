"""Ports for binaries that bind later: free now and outside the ephemeral range."""

from __future__ import annotations

import random
import socket
from pathlib import Path

from dynagraph.runtime.infra import _non_ephemeral_range, free_port


def test_ports_avoid_the_ephemeral_range(tmp_path: Path) -> None:
    lo, hi = _non_ephemeral_range()
    ephemeral_lo = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert hi < ephemeral_lo
    ports = {free_port("127.0.0.1", random.Random(seed)) for seed in range(5)}
    assert all(lo <= p <= hi for p in ports)
    with socket.socket() as s:  # and they are free
        s.bind(("127.0.0.1", ports.pop()))
    (tmp_path / "range").write_text("1500 2000\n")  # no room below: fall back to 1024-9999
    assert _non_ephemeral_range(tmp_path / "range") == (1024, 9999)
    (tmp_path / "range").write_text("garbage")
    assert _non_ephemeral_range(tmp_path / "range") == (10000, 32767)
