"""Local etcd and nats-server processes for the single-machine default.

`dynamo serve` uses these when ``ETCD_ENDPOINTS`` / ``NATS_SERVER`` are not set; the
test fixtures use them too. Each service binds 127.0.0.1 on free ports, keeps its data
in a temporary directory, is polled for readiness (never a bare sleep), and is stopped
by its own PID, its directory removed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dynagraph.errors import InfraError

log = logging.getLogger(__name__)

DEBIAN_PACKAGE = {
    "etcd": "etcd-server",
    "nats-server": "nats-server",
    "prometheus": "prometheus",
    "promtool": "prometheus",
}


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None,
              attempts: int = 64) -> int:
    """A TCP port free on ``host`` now and outside the kernel's ephemeral range, for
    binaries that cannot bind port 0 and bind it themselves a little later.

    Why not ``bind(0)``: an ephemeral port can become the local end of an outgoing
    connection before its owner binds it (vLLM binds its NIXL side channel only after
    loading the model, seconds later); ports below that range are only taken by ``bind``.
    """
    lo, hi = _non_ephemeral_range()
    rng = rng or random.Random()
    for _ in range(attempts):
        port = rng.randint(lo, hi)
        if _bindable(host, port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # crowded: any free port
        s.bind((host, 0))
        return int(s.getsockname()[1])


PORT_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _non_ephemeral_range(path: Path = PORT_RANGE_FILE) -> tuple[int, int]:
    try:
        ephemeral_lo = int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_lo = 32768  # Linux's default
    lo = 10000
    return (lo, ephemeral_lo - 1) if ephemeral_lo - 1 > lo + 1000 else (1024, 9999)


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def find_binary(name: str) -> str:
    """Path of ``name`` on PATH (or in /usr/sbin), or an InfraError naming its package."""
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/usr/local/bin")
    if path is None:
        pkg = DEBIAN_PACKAGE.get(name, name)
        raise InfraError(
            f"{name} not found on PATH; install the Debian package '{pkg}' "
            f"(apt-get install -y {pkg}) or run scripts/install.sh"
        )
    return path


@dataclass
class LocalService:
    """One child process with a data dir; ``url`` is what clients connect to."""

    name: str
    url: str
    proc: subprocess.Popen[bytes]
    data_dir: str
    health_url: str
    log_path: str
    extra: dict[str, str] = field(default_factory=dict)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout``; remove the data dir."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout)
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def restart(self, timeout: float = 10.0) -> None:
        """Stop the process (keeping its data) and start it again with the same arguments."""
        args = self.proc.args
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=timeout)
        self.proc = _spawn(args, self.log_path)  # type: ignore[arg-type]
        wait_http_ok(self.health_url, timeout, what=self.name, proc=self.proc, log_path=self.log_path)


def _spawn(args: list[str], log_path: str) -> subprocess.Popen[bytes]:
    logf = open(log_path, "ab")  # noqa: SIM115 - handed to the child
    try:
        return subprocess.Popen(
            args, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    finally:
        logf.close()


def wait_http_ok(
    url: str,
    timeout: float,
    *,
    what: str,
    proc: subprocess.Popen[bytes] | None = None,
    log_path: str | None = None,
) -> None:
    """Poll ``url`` until it answers 2xx; fail early if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    while True:
        if proc is not None and proc.poll() is not None:
            raise InfraError(f"{what} exited with code {proc.returncode} while starting; {_tail(log_path)}")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:  # noqa: S310 - loopback only
                if 200 <= resp.status < 300:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise InfraError(f"{what} not ready at {url} after {timeout:.0f}s; {_tail(log_path)}")
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


def _tail(log_path: str | None, n: int = 10) -> str:
    if not log_path or not os.path.exists(log_path):
        return "no log"
    with open(log_path, "rb") as f:
        lines = f.read().decode(errors="replace").splitlines()[-n:]
    return "last log lines:\n  " + "\n  ".join(lines)


def start_etcd(timeout: float = 15.0) -> LocalService:
    """Start etcd on free loopback ports; return when /health answers."""
    binary = find_binary("etcd")
    data_dir = tempfile.mkdtemp(prefix="dynagraph-etcd-")
    client, peer = free_port(), free_port()
    url = f"http://127.0.0.1:{client}"
    log_path = os.path.join(data_dir, "etcd.log")
    args = [
        binary,
        "--name", "dynagraph",
        "--data-dir", os.path.join(data_dir, "data"),
        "--listen-client-urls", url,
        "--advertise-client-urls", url,
        "--listen-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-cluster", f"dynagraph=http://127.0.0.1:{peer}",
        "--log-level", "warn",
    ]
    proc = _spawn(args, log_path)
    svc = LocalService("etcd", url, proc, data_dir, f"{url}/health", log_path)
    try:
        wait_http_ok(svc.health_url, timeout, what="etcd", proc=proc, log_path=log_path)
    except BaseException:
        svc.stop()
        raise
    log.info("started etcd pid=%d at %s", proc.pid, url)
    return svc


def start_nats(timeout: float = 15.0) -> LocalService:
    """Start nats-server with JetStream on free loopback ports; return when healthy."""
    binary = find_binary("nats-server")
    data_dir = tempfile.mkdtemp(prefix="dynagraph-nats-")
    port, monitor = free_port(), free_port()
    log_path = os.path.join(data_dir, "nats.log")
    args = [
        binary, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", os.path.join(data_dir, "js"),
        "-m", str(monitor),
    ]
    proc = _spawn(args, log_path)
    url = f"nats://127.0.0.1:{port}"
    health = f"http://127.0.0.1:{monitor}/healthz?js-enabled-only=true"
    svc = LocalService("nats-server", url, proc, data_dir, health, log_path,
                       extra={"monitor_url": f"http://127.0.0.1:{monitor}"})
    try:
        wait_http_ok(health, timeout, what="nats-server", proc=proc, log_path=log_path)
    except BaseException:
        svc.stop()
        raise
    log.info("started nats-server pid=%d at %s", proc.pid, url)
    return svc


@contextlib.contextmanager
def local_infra(*, etcd: bool = True, nats: bool = True) -> Iterator[dict[str, LocalService]]:
    """Start the requested services; stop all of them on exit, whatever happened."""
    started: dict[str, LocalService] = {}
    try:
        if etcd:
            started["etcd"] = start_etcd()
        if nats:
            started["nats"] = start_nats()
        yield started
    finally:
        for svc in reversed(list(started.values())):
            svc.stop()
