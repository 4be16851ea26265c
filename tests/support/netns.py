"""Several "hosts" on one machine: network namespaces on a bridge (root only).

    with NetLab(3) as lab:                  # hosts lab.hosts[0..2], each its own netns
        lab.hosts[1].argv(["dynamo", "serve", ...])   # -> ip netns exec NS dynamo serve ...
        lab.limit(lab.hosts[2], gbit=10)    # tc tbf on that host's link, both directions

Addresses come from the benchmarking range, one free /28 of 198.18.0.0/24 per lab: the
hosts get .1, .2, ... of it and the bridge (in the root namespace, so the test process
reaches every host) the last usable one. Nothing else is bound or routed. Names carry
the creating process id (``dgl<pid>...``) so concurrent labs never collide and a later
lab removes what a killed run left behind (:func:`sweep_stale`).

``close()`` (and leaving the ``with`` block, whatever happened) kills what still runs
inside the namespaces, then removes namespaces, veths and the bridge.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass

from dynagraph.runtime.procfs import pid_alive

log = logging.getLogger(__name__)

RANGE = ipaddress.IPv4Network("198.18.0.0/24")
SUBNET_PREFIX = 28
PREFIX = "dgl"
"""Every name starts with it: ``dgl<pid>x<n>`` (netns ``dgl<pid>x<n>h<i>``, veth ends
``...o<i>`` / ``...i<i>``, bridge ``...br``)."""
IFACE = "dg0"
"""The link's name inside each host namespace."""
_NAME = re.compile(rf"^{PREFIX}(\d+)x(\d)")
_labs = 0


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be used here (not root, no ``ip``, no kernel support)."""


def unavailable_reason() -> str | None:
    """Why a lab cannot be built here, or None if it can (tries a throwaway namespace)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veths, a bridge)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "needs `ip` and `tc` (Debian package iproute2)"
    probe = f"{PREFIX}{os.getpid()}probe"
    try:
        _ip("netns", "add", probe)
    except NetnsUnavailable as exc:
        return f"cannot create a network namespace: {exc}"
    with contextlib.suppress(NetnsUnavailable):
        _ip("netns", "delete", probe)
    return None


def _run(argv: Sequence[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NetnsUnavailable(f"{' '.join(argv)}: {proc.stderr.strip() or proc.returncode}")
    return proc


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _run(["ip", *args], check=check)


@dataclass(frozen=True)
class Host:
    """One namespace: ``name`` (the netns), ``addr`` (its address), ``outer`` (its veth's
    end on the bridge, in the root namespace); inside, the link is ``dg0``."""

    name: str
    addr: str
    outer: str

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.name, *argv]


class NetLab:
    """``n`` namespaces on one bridge (see the module doc). Use as a context manager."""

    def __init__(self, n: int) -> None:
        if not 1 <= n <= 2 ** (32 - SUBNET_PREFIX) - 3:
            raise ValueError(f"a lab has 1..13 hosts, not {n}")
        self.n = n
        global _labs
        _labs += 1
        # interface names have at most 15 characters: dgl + pid (<= 7) + x + 1 digit + o12
        self.tag = f"{PREFIX}{os.getpid()}x{_labs % 10}"
        self.bridge = f"{self.tag}br"
        self.hosts: list[Host] = []
        self.bridge_addr = ""
        self.subnet: ipaddress.IPv4Network | None = None
        self._made: list[tuple[str, ...]] = []

    def __enter__(self) -> NetLab:
        try:
            self.create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create(self) -> None:
        reason = unavailable_reason()
        if reason is not None:
            raise NetnsUnavailable(reason)
        sweep_stale()
        self.subnet = _free_subnet()
        addrs = list(self.subnet.hosts())
        self.bridge_addr = str(addrs[-1])
        _ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _ip("addr", "add", f"{self.bridge_addr}/{SUBNET_PREFIX}", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for i in range(self.n):
            ns, outer, inner = f"{self.tag}h{i}", f"{self.tag}o{i}", f"{self.tag}i{i}"
            _ip("netns", "add", ns)
            self._made.append(("netns", ns))
            _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
            self._made.append(("link", outer))
            _ip("link", "set", inner, "netns", ns)
            _ip("link", "set", outer, "master", self.bridge)
            _ip("link", "set", outer, "up")
            _ip("-n", ns, "link", "set", inner, "name", IFACE)
            _ip("-n", ns, "addr", "add", f"{addrs[i]}/{SUBNET_PREFIX}", "dev", IFACE)
            _ip("-n", ns, "link", "set", IFACE, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            self.hosts.append(Host(ns, str(addrs[i]), outer))
        log.info("net lab %s: %s, bridge %s at %s", self.tag,
                 ", ".join(f"{h.name}={h.addr}" for h in self.hosts), self.bridge,
                 self.bridge_addr)

    def limit(self, host: Host, *, gbit: float, burst_bytes: int | None = None,
              latency_ms: float = 50.0) -> None:
        """Limit ``host``'s link to ``gbit`` Gbit/s each way (``tc qdisc ... tbf`` on both
        ends of its veth: its egress inside, the bridge's egress towards it outside)."""
        rate = f"{int(gbit * 1000)}mbit"
        # A bucket of ~1 ms at the rate (at least 64 KiB) keeps TCP smooth at 1-25 Gbit/s.
        burst = burst_bytes or max(int(gbit * 1e9 / 8 / 1000), 64 * 1024)
        spec = ["root", "tbf", "rate", rate, "burst", str(burst), "latency", f"{latency_ms}ms"]
        _run(["tc", "-n", host.name, "qdisc", "replace", "dev", IFACE, *spec])
        _run(["tc", "qdisc", "replace", "dev", host.outer, *spec])

    def unlimit(self, host: Host) -> None:
        _run(["tc", "-n", host.name, "qdisc", "del", "dev", IFACE, "root"], check=False)
        _run(["tc", "qdisc", "del", "dev", host.outer, "root"], check=False)

    def close(self) -> None:
        """Kill what runs in the namespaces, remove them, the veths and the bridge."""
        for kind, name in reversed(self._made):
            if kind == "netns":
                _kill_inside(name)
                _ip("netns", "delete", name, check=False)
            else:
                _ip("link", "delete", name, check=False)
        self._made.clear()


def _kill_inside(ns: str, timeout: float = 5.0) -> None:
    """SIGKILL every process still in namespace ``ns`` (ours: the namespace is ours)."""
    deadline = time.monotonic() + timeout
    while True:
        pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()
                if p.isdigit()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            log.warning("processes still in %s after SIGKILL: %s", ns, pids)
            return
        time.sleep(0.05)


def _free_subnet() -> ipaddress.IPv4Network:
    """A /28 of 198.18.0.0/24 that no address or route of the root namespace touches."""
    used = []
    for line in _ip("-4", "-o", "addr", "show").stdout.splitlines():
        m = re.search(r"inet (\S+)", line)
        if m:
            used.append(ipaddress.ip_interface(m.group(1)).network)
    for line in _ip("-4", "route", "show").stdout.splitlines():
        first = line.split()[0] if line.split() else ""
        with contextlib.suppress(ValueError):
            used.append(ipaddress.ip_network(first, strict=False))
    for subnet in RANGE.subnets(new_prefix=SUBNET_PREFIX):
        if not any(subnet.overlaps(u) for u in used if u.prefixlen > 0):
            return subnet
    raise NetnsUnavailable(f"no free /{SUBNET_PREFIX} left in {RANGE} (other labs running?)")


def sweep_stale() -> list[str]:
    """Remove namespaces and links left by labs whose process is gone (a killed run)."""
    removed: list[str] = []
    for ns in _ip("netns", "list", check=False).stdout.split("\n"):
        name = ns.split(" ")[0]
        m = _NAME.match(name)
        if m and not pid_alive(int(m.group(1))):
            _kill_inside(name)
            _ip("netns", "delete", name, check=False)
            removed.append(name)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(": ")
        if len(parts) < 2:
            continue
        name = parts[1].split("@")[0]
        m = _NAME.match(name)
        if m and not pid_alive(int(m.group(1))):
            _ip("link", "delete", name, check=False)
            removed.append(name)
    if removed:
        log.warning("removed what an earlier lab left behind: %s", ", ".join(removed))
    return removed
