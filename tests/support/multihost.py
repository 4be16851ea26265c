"""The disagg_router graph over three "hosts" (network namespaces, ``tests.support.netns``),
as the README's "Several hosts" section runs it:

    host 0   etcd, nats-server (JetStream), dynamo serve --service-name Frontend/Processor/Router
    host 1   dynamo serve --service-name VllmWorker        (the decode workers)
    host 2   dynamo serve --service-name PrefillWorker

Every ``dynamo serve`` gets ``--host`` = its namespace's address, the same graph, config
file and overrides, ``ETCD_ENDPOINTS`` / ``NATS_SERVER`` on host 0, and ``UCX_TLS=tcp``:
the namespaces share one kernel and its IPC, so UCX would otherwise move the KV through
shared memory and bypass the veths this is about. Every prefill is remote
(``conditional-disagg: false``).

    with three_host_graph(model_dir) as g:    # ready, /health green
        g.url, g.hosts, g.serves["decode"], g.etcd_url, ...

Leaving the block stops the serves, etcd and NATS, then removes the namespaces (killing
anything left in them), whatever happened.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from dynagraph.runtime.infra import LocalService, find_binary, wait_http_ok
from tests.support.netns import Host, NetLab
from tests.support.paths import REPO
from tests.support.process import OutputProcess
from tests.support.serve import ServeProcess, keep_graph_log

GRAPH = "graphs.disagg_router:Frontend"
CONFIG = "configs/disagg_router.yaml"
FRONTEND_PORT = 8000
ETCD_PORT, ETCD_PEER_PORT = 2379, 2380
NATS_PORT, NATS_MONITOR_PORT = 4222, 8222
"""Fixed ports: each host is a fresh namespace, so nothing else holds them."""
PARTS = {
    "front": ("Frontend", "Processor", "Router"),
    "decode": ("VllmWorker",),
    "prefill": ("PrefillWorker",),
}
"""Which components each host (0, 1, 2) serves."""


class NsServeProcess(ServeProcess):
    """``dynamo serve ARGS`` inside ``host``'s network namespace."""

    def __init__(self, host: Host, args: list[str], env: dict[str, str]) -> None:
        OutputProcess.__init__(
            self, host.argv([sys.executable, "-m", "dynagraph.cli.main", "serve", *args]), env)
        self.host = host


@dataclass
class ThreeHostGraph:
    lab: NetLab
    etcd_url: str
    nats_url: str
    url: str
    serves: dict[str, NsServeProcess] = field(default_factory=dict)

    @property
    def front(self) -> Host:
        return self.lab.hosts[0]

    @property
    def decode(self) -> Host:
        return self.lab.hosts[1]

    @property
    def prefill(self) -> Host:
        return self.lab.hosts[2]

    def etcdctl(self, *args: str) -> str:
        out = subprocess.run(["etcdctl", f"--endpoints={self.etcd_url}", *args],
                             env={**os.environ, "ETCDCTL_API": "3"}, capture_output=True,
                             text=True, timeout=10, check=True)
        return out.stdout

    def link_bytes(self, host: Host) -> tuple[int, int]:
        """Bytes (sent, received) by ``host`` over its link so far (its veth's counters,
        read on the bridge side)."""
        stats = Path("/sys/class/net") / host.outer / "statistics"
        return (int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text()))

    def output(self) -> str:
        return "\n\n".join(f"==== {name} ({sp.host.addr})\n" + "\n".join(sp.lines[-150:])
                           for name, sp in self.serves.items())


def start_infra(host: Host, stack: contextlib.ExitStack) -> tuple[str, str]:
    """etcd and nats-server (JetStream) in ``host``'s namespace on its address."""
    a = host.addr
    etcd_dir = tempfile.mkdtemp(prefix="dynagraph-mh-etcd-")
    stack.callback(shutil.rmtree, etcd_dir, True)
    etcd_url = f"http://{a}:{ETCD_PORT}"
    etcd = _service("etcd", host, [
        find_binary("etcd"), "--name", "mh", "--data-dir", os.path.join(etcd_dir, "data"),
        "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
        "--listen-peer-urls", f"http://{a}:{ETCD_PEER_PORT}",
        "--initial-advertise-peer-urls", f"http://{a}:{ETCD_PEER_PORT}",
        "--initial-cluster", f"mh=http://{a}:{ETCD_PEER_PORT}", "--log-level", "warn",
    ], etcd_dir, etcd_url, f"{etcd_url}/health")
    stack.callback(etcd.stop)
    nats_dir = tempfile.mkdtemp(prefix="dynagraph-mh-nats-")
    stack.callback(shutil.rmtree, nats_dir, True)
    nats_url = f"nats://{a}:{NATS_PORT}"
    nats = _service("nats-server", host, [
        find_binary("nats-server"), "-a", a, "-p", str(NATS_PORT), "-js",
        "-sd", os.path.join(nats_dir, "js"), "-m", str(NATS_MONITOR_PORT),
    ], nats_dir, nats_url, f"http://{a}:{NATS_MONITOR_PORT}/healthz?js-enabled-only=true")
    stack.callback(nats.stop)
    return etcd_url, nats_url


def _service(name: str, host: Host, argv: list[str], data_dir: str, url: str,
             health: str) -> LocalService:
    log_path = os.path.join(data_dir, f"{name}.log")
    with open(log_path, "ab") as logf:
        proc = subprocess.Popen(host.argv(argv), stdout=logf, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    svc = LocalService(name, url, proc, data_dir, health, log_path)
    try:
        wait_http_ok(health, 20, what=name, proc=proc, log_path=log_path)
    except BaseException:
        svc.stop()
        raise
    return svc


def serve_env(etcd_url: str, nats_url: str, extra: dict[str, str] | None = None
              ) -> dict[str, str]:
    env = {**os.environ, "ETCD_ENDPOINTS": etcd_url, "NATS_SERVER": nats_url,
           "PYTHONUNBUFFERED": "1", "UCX_TLS": "tcp", **(extra or {})}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # as served in production
    env.pop("DYNAMO_HOST", None)
    return env


@contextlib.contextmanager
def three_host_graph(model_dir: Path, overrides: Sequence[str] = (), *,
                     env: dict[str, str] | None = None, ready_timeout: float = 420.0,
                     lab: NetLab | None = None) -> Iterator[ThreeHostGraph]:
    """The graph on three namespaces, ready (every serve's banner, ``/health`` 200)."""
    with contextlib.ExitStack() as stack:
        if lab is None:
            lab = stack.enter_context(NetLab(3))
        front = lab.hosts[0]
        etcd_url, nats_url = start_infra(front, stack)
        args = [GRAPH, "-f", CONFIG, f"--Common.model={model_dir}",
                f"--Frontend.host={front.addr}", f"--Frontend.port={FRONTEND_PORT}",
                "--VllmWorker.conditional-disagg=false",
                # namespaces of one machine share its boot id and memory: kv-transport auto
                # would copy the KV; these tests are about NIXL between hosts
                "--VllmWorker.kv-transport=nixl", "--PrefillWorker.kv-transport=nixl",
                *overrides]
        g = ThreeHostGraph(lab, etcd_url, nats_url, f"http://{front.addr}:{FRONTEND_PORT}")
        # The serves' temp files (vLLM's engine IPC sockets and vllm_dist_* files, which
        # it leaves in /tmp) go here; removed after the serves stopped (callbacks unwind
        # in reverse)
        tmp_dir = tempfile.mkdtemp(prefix="dynagraph-mh-tmp-")
        stack.callback(shutil.rmtree, tmp_dir, True)
        env = {"TMPDIR": tmp_dir, **(env or {})}
        stack.callback(_keep_output, g)
        for (name, components), host in zip(PARTS.items(), lab.hosts, strict=True):
            names = [a for c in components for a in ("--service-name", c)]
            sp = NsServeProcess(host, [*args, "--host", host.addr, *names],
                                serve_env(etcd_url, nats_url, env))
            stack.callback(_stop, sp)
            g.serves[name] = sp
        deadline = time.monotonic() + ready_timeout
        for sp in g.serves.values():
            try:
                sp.wait_ready(max(deadline - time.monotonic(), 1.0))
            except AssertionError as exc:
                raise AssertionError(f"{exc}\n{g.output()}") from None
        _wait_health(g.url, deadline)
        yield g


def _keep_output(g: ThreeHostGraph) -> None:
    """Every serve's whole output into ``$DYNAGRAPH_TEST_GRAPH_LOG`` when that is set
    (runs after the serves stopped: callbacks unwind in reverse)."""
    keep_graph_log("three-hosts", "\n\n".join(f"==== {name} ({sp.host.addr})\n" + sp.output()
                                             for name, sp in g.serves.items()))


def _stop(sp: OutputProcess) -> None:
    sp.stop(timeout=30)


def _wait_health(url: str, deadline: float) -> None:
    while True:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"{url}/health not 200 before the deadline")
        time.sleep(0.2)


__all__ = ["CONFIG", "GRAPH", "REPO", "NsServeProcess", "ThreeHostGraph", "three_host_graph"]
