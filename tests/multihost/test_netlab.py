"""The namespace lab the multi-host tests stand on: hosts reach each other (and the test
process reaches them) on 198.18.0.0/24 only, ``tc tbf`` limits a link, and nothing is
left behind, even by a run that was killed."""

from __future__ import annotations

import ipaddress
import subprocess
import sys
import time

import pytest

from tests.support.netns import IFACE, RANGE, NetLab, sweep_stale

pytestmark = pytest.mark.integration

SINK = ("import socket,sys\ns=socket.socket();s.bind((sys.argv[1],9000));s.listen()\n"
        "print('up',flush=True);c,_=s.accept();n=0\n"
        "while (d:=c.recv(1<<20)): n+=len(d)\nprint(n,flush=True)\n")
SEND = ("import socket,sys,time\ns=socket.create_connection((sys.argv[1],9000))\n"
        "b=b'x'*(1<<20);t=time.perf_counter()\nfor _ in range(int(sys.argv[2])): s.sendall(b)\n"
        "s.shutdown(socket.SHUT_WR);s.recv(1);print(time.perf_counter()-t)\n")


def send_mib(lab: NetLab, src: int, dst: int, mib: int) -> float:
    """Seconds to send ``mib`` MiB from host ``src`` to host ``dst`` over TCP."""
    a, b = lab.hosts[src], lab.hosts[dst]
    sink = subprocess.Popen(b.argv([sys.executable, "-c", SINK, b.addr]), text=True,
                            stdout=subprocess.PIPE)
    try:
        assert sink.stdout is not None and sink.stdout.readline().strip() == "up"
        out = subprocess.run(a.argv([sys.executable, "-c", SEND, b.addr, str(mib)]),
                             capture_output=True, text=True, timeout=120, check=True)
        assert sink.stdout.readline().strip() == str(mib << 20)
        return float(out.stdout)
    finally:
        sink.kill()
        sink.wait(timeout=10)


def names(tag: str) -> tuple[list[str], list[str]]:
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return ([n for n in ns.split() if n.startswith(tag)],
            [w for w in links.split() if w.startswith(tag)])


def test_hosts_reach_each_other_a_limit_holds_and_nothing_is_left() -> None:
    with NetLab(2) as lab:
        tag = lab.tag
        assert lab.subnet is not None and lab.subnet.subnet_of(RANGE)
        for h in lab.hosts:
            assert ipaddress.ip_address(h.addr) in lab.subnet
            addrs = subprocess.run(h.argv(["ip", "-4", "-o", "addr"]), capture_output=True,
                                   text=True, check=True).stdout
            assert f" {IFACE} " in addrs and h.addr in addrs
        assert send_mib(lab, 0, 1, 4) > 0
        lab.limit(lab.hosts[1], gbit=0.2)
        secs = send_mib(lab, 0, 1, 10)
        gbit = 10 * 8 * 1.048576 / 1000 / secs
        assert gbit < 0.2 * 1.15, gbit
        lab.unlimit(lab.hosts[1])
        sleeper = subprocess.Popen(lab.hosts[0].argv(["sleep", "600"]))
        assert names(tag) != ([], [])
    assert names(tag) == ([], [])
    assert sleeper.wait(timeout=10) != 0  # what ran inside was killed with the lab


def test_a_failure_inside_the_block_still_removes_everything() -> None:
    with pytest.raises(RuntimeError, match="boom"), NetLab(1) as lab:
        tag = lab.tag
        raise RuntimeError("boom")
    assert names(tag) == ([], [])


def test_what_a_killed_run_left_is_swept() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    time.sleep(0.01)
    tag = f"dgl{dead.pid}x0"
    subprocess.run(["ip", "netns", "add", f"{tag}h0"], check=True)
    subprocess.run(["ip", "link", "add", f"{tag}br", "type", "bridge"], check=True)
    try:
        assert f"{tag}h0" in sweep_stale() and names(tag) == ([], [])
    finally:
        subprocess.run(["ip", "netns", "delete", f"{tag}h0"], capture_output=True)
        subprocess.run(["ip", "link", "delete", f"{tag}br"], capture_output=True)
