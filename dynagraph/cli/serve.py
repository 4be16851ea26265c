"""``dynamo serve MODULE:Component -f CONFIG``: run a graph as OS processes.

One process per component worker (``python -m dynagraph.cli.child``). Each line a child
prints is echoed with a ``[Component:index]`` prefix. ``serve`` returns once the graph
is stopped:

- **Ready**: every component it started has ``workers`` x ``instances-per-process`` (see
  ``dynagraph.sdk._process``) instance records in etcd (its own: records carry this
  serve's ``serve_id``), else after ``--ready-timeout`` it names the missing ones, stops
  everything and exits 1.
- **Part of a graph** (``--service-name``, see ``serve_part``): only those components
  start (and follow scale keys); the rest run on other hosts. ``--host`` is where the
  children bind and what they publish (``DYNAMO_HOST``).
- **Stop**: on SIGINT/SIGTERM every child gets SIGTERM, then SIGKILL after
  ``--stop-timeout`` (default 8 s), and whatever is left in each child's process group
  (e.g. a vLLM engine core) is killed; the local etcd/NATS it started go last. Children
  also get SIGTERM from the kernel if the supervisor itself dies (they set PDEATHSIG
  themselves: no ``preexec_fn``, because forking a process that runs gRPC threads
  (the etcd client) crashes the child).
- **A child that exits by itself** is never restarted silently. With
  ``--restart on-failure`` (the default) it is restarted after a logged backoff of 1, 2,
  4 ... 30 s; more than ``--max-restarts`` restarts within 60 s stops the graph. With
  ``--restart never`` the graph stops at once. Either way, a graph stopped because of
  a child exits with that child's exit code (128 + signal number if it was killed).
- **Scaling at run time**: once ready, ``serve`` follows ``/{namespace}/scale/{Component}``
  in etcd (``dynagraph.planner.connector``: the Planner writes them, or a person with
  ``etcdctl``) and starts or retires worker processes of that component to match
  (``dynagraph.cli.scaling.reconcile``). A retired worker gets SIGTERM: it withdraws from
  discovery (no new requests), drains its requests in flight for up to ``--drain-grace``
  seconds (every child gets ``DYNAMO_DRAIN_GRACE_S``) and exits; it is killed if it has not
  after that plus ``--stop-timeout``. Its exit is expected: never restarted.
- **Cores**: once ready, and every 2 s after, the graph's own processes are bound to the
  cores vLLM's model runners are not bound to, and the engines' niceness follows from
  that (``--engine-cores keep-off``, the default; ``dynagraph.cli.core_keeper``);
  ``--engine-cores share`` leaves placement to the kernel and niceness to the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dynagraph.aio import cancel_and_wait
from dynagraph.cli import serve_part, serve_state
from dynagraph.cli._banner import component_lines
from dynagraph.cli._logging import child_log_env
from dynagraph.cli.core_keeper import INTERVAL_S as CORE_KEEPER_INTERVAL_S
from dynagraph.cli.core_keeper import CoreKeeper
from dynagraph.cli.scaling import Child, RuntimeScaling, sweep_group
from dynagraph.cli.startup_output import StartupOutput
from dynagraph.errors import GraphError
from dynagraph.llm.tenants.identity import SECRET_ENV, new_secret
from dynagraph.observability.graph_targets import GraphTargets
from dynagraph.runtime import progress
from dynagraph.runtime.cpus import GRAPH_CPUS_ENV, cpu_list
from dynagraph.runtime.infra import LocalService, start_etcd, start_nats
from dynagraph.runtime.nice import ENGINE_NICE_DIR_ENV
from dynagraph.sdk._config import ComponentConfig
from dynagraph.sdk._graph import Graph
from dynagraph.sdk._runtime import DRAIN_GRACE_ENV, DRAIN_GRACE_S
from dynagraph.sdk._service import spec_of

if TYPE_CHECKING:
    from dynagraph.runtime.discovery import Discovery

log = logging.getLogger("dynagraph.serve")

RESTART_WINDOW = 60.0


@dataclass
class ServeOptions:
    ready_timeout: float = 180.0
    stop_timeout: float = 8.0
    restart: str = "on-failure"  # or "never"
    max_restarts: int = 5
    log_level: str = "info"
    drain_grace: float = DRAIN_GRACE_S
    host: str = "127.0.0.1"
    """This host's address (``--host``): the children bind and publish it."""
    service_names: tuple[str, ...] = ()
    """Start only these components (``--service-name``); empty: the whole graph."""
    engine_cores: str = "keep-off"
    """``keep-off``: the graph's processes keep off the cores vLLM bound its model runners
    to (``dynagraph.cli.core_keeper``); ``share``: the kernel places them."""


IPC_PATH_MAX = 107
"""Longest unix socket path (``sockaddr_un.sun_path``)."""
IPC_NAME_LEN = 37
"""What vLLM appends to the temp dir for an IPC socket: ``/`` and a uuid4."""


def children_tmpdir(base: str | None = None) -> tempfile.TemporaryDirectory[str]:
    """A short, fresh temp dir for the components, in the current one (``TMPDIR``) or,
    where a socket path in it would be too long for a unix socket, in ``/tmp``."""
    base = base if base is not None else tempfile.gettempdir()
    if len(os.path.join(base, "dg-xxxxxxxx")) + IPC_NAME_LEN > IPC_PATH_MAX:
        base = "/tmp"
    return tempfile.TemporaryDirectory(prefix="dg-", dir=base)


class Supervisor(RuntimeScaling):
    def __init__(self, target: str, graph: Graph, configs: dict[str, ComponentConfig],
                 options: ServeOptions) -> None:
        self.target = target
        self.graph = graph
        self.configs = configs
        self.opts = options
        self.children: list[Child] = []
        self.services: list[LocalService] = []
        self.stopping = asyncio.Event()
        self.exit_code = 0
        self._tmp = tempfile.TemporaryDirectory(prefix="dynamo-serve-")
        self._children_tmp = children_tmpdir()
        """The components' TMPDIR: vLLM leaves its IPC sockets there; removed at exit."""
        self.startup: StartupOutput | None = None
        self._child_base_env: dict[str, str] = {}
        self._children_changed = asyncio.Event()
        self._retirements: set[asyncio.Task[None]] = set()
        self.started = serve_part.select(graph, configs, options.service_names)
        self.serve_id = uuid.uuid4().hex
        self._core_keeper: CoreKeeper | None = None
        self._nice_dir = os.path.join(self._tmp.name, "engine-nice")
        """Where the workers leave their engines' niceness for the core keeper."""
        self._cores = frozenset(os.sched_getaffinity(0))
        """The cores this serve may use: the graph's."""

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        t0 = time.monotonic()
        discovery = None
        targets: GraphTargets | None = None
        state_path: str | None = None
        try:
            env = self._infra_env()
            state_path = serve_state.publish(
                self.target, {spec_of(c).name: spec_of(c).namespace for c in self.graph.nodes},
                self.configs, env, embedded=bool(self.services))
            from dynagraph.runtime.discovery import discovery_from_env

            discovery = discovery_from_env(env)
            await discovery.start()
            targets = await self._start_targets(discovery, env)
            spec_path = self._write_spec(env)
            secret = {SECRET_ENV: await self._graph_secret(discovery)}  # not in the spec
            self.startup = StartupOutput(self.target, self.started, self.opts.log_level)
            self._child_base_env = {**env, **secret, "TMPDIR": self._children_tmp.name,
                                    DRAIN_GRACE_ENV: str(self.opts.drain_grace),
                                    "DYNAMO_HOST": self.opts.host,
                                    serve_part.SERVE_ID_ENV: self.serve_id}
            if self.opts.engine_cores == "keep-off":  # their engines leave niceness to it
                self._child_base_env[ENGINE_NICE_DIR_ENV] = self._nice_dir
                self._child_base_env[GRAPH_CPUS_ENV] = cpu_list(self._cores)  # engines start there
            for cls in self.graph.nodes:
                name = spec_of(cls).name
                if name not in self.started or self.configs[name].service_args.embed_in:
                    continue  # an embedded component starts inside its host's processes
                for i in range(self.configs[name].service_args.workers):
                    await self._start_child(name, i, spec_path)
            waiting = asyncio.create_task(self.startup.say_waiting(), name="say-waiting")
            try:
                ready = await self._wait_ready(discovery, t0)
            finally:
                await cancel_and_wait([waiting])
            if ready:
                await self.startup.all_said_ready()
                if self.opts.engine_cores == "keep-off":
                    self._core_keeper = CoreKeeper(os.getpid(), self._nice_dir, self._cores)
                    self._scan_cores()  # bound before the banner says ready
                banner = self._ready_banner(await self._records(discovery),
                                            time.monotonic() - t0, targets)
                print(banner, flush=True)
                scaler = asyncio.create_task(self._follow_scale(discovery, spec_path),
                                             name="scale-keys")
                tasks = [scaler]
                if self._core_keeper is not None:
                    tasks.append(asyncio.create_task(self._keep_cores(), name="core-keeper"))
                try:
                    await self._watch_children(spec_path)
                finally:
                    await cancel_and_wait(tasks)
            else:
                self.exit_code = 1
        finally:
            t1 = time.monotonic()
            await self._stop_children()
            await cancel_and_wait(list(self._retirements))
            if targets is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(targets.close(), 3)
            if discovery is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(discovery.close(), 3)
            for svc in reversed(self.services):
                svc.stop()
            self._tmp.cleanup()
            self._children_tmp.cleanup()
            if state_path is not None:
                serve_state.remove_state(state_path)
            log.info("stopped in %.2fs", time.monotonic() - t1)
        return self.exit_code

    async def _keep_cores(self) -> None:
        """``CoreKeeper.scan`` every ``INTERVAL_S`` (restarted or scaled components,
        threads started since)."""
        while not self.stopping.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), CORE_KEEPER_INTERVAL_S)
            if not self.stopping.is_set():
                self._scan_cores()

    def _scan_cores(self) -> None:
        """One ``CoreKeeper.scan``; a failure is logged (placement is an optimisation:
        the graph serves without it)."""
        assert self._core_keeper is not None
        try:
            self._core_keeper.scan()
        except Exception:
            log.exception("core keeper: scan failed (the graph's processes keep their cores)")

    def _on_signal(self, sig: int) -> None:
        if not self.stopping.is_set():
            log.info("received %s, stopping the graph", signal.Signals(sig).name)
        self.stopping.set()

    async def _start_targets(self, discovery: Any, env: dict[str, str]) -> GraphTargets | None:
        """Prometheus file_sd targets for this graph (never fatal: logs and goes on)."""
        monitor = next((s.extra["monitor_url"] for s in self.services
                        if "monitor_url" in s.extra), None)
        try:
            return await GraphTargets.start(
                discovery, {spec_of(c).namespace for c in self.graph.nodes}, env, self._tmp.name,
                nats_monitor_url=monitor)
        except Exception as exc:
            log.warning("no Prometheus targets file: %s", exc)
            return None

    async def _graph_secret(self, discovery: Discovery) -> str:
        """``$DYNAGRAPH_GRAPH_SECRET``, else the namespace's secret in etcd (made by the first
        ``dynamo serve`` of the namespace): every serve of one graph, on any host, signs and
        verifies tenant identities with the same key."""
        given = os.environ.get(SECRET_ENV)
        if given:
            return given
        namespace = min(spec_of(c).namespace for c in self.graph.nodes)
        stored = await discovery.put_if_absent(f"/{namespace}/graph-secret", new_secret())
        if not isinstance(stored, str):
            raise GraphError(f"/{namespace}/graph-secret in etcd is not a string")
        return stored

    def _infra_env(self) -> dict[str, str]:
        return {"ETCD_ENDPOINTS": self._service_url("ETCD_ENDPOINTS", start_etcd),
                "NATS_SERVER": self._service_url("NATS_SERVER", start_nats)}

    def _service_url(self, var: str, start: Callable[[], LocalService]) -> str:
        """``$var`` if set, else the URL of a local service started (and owned) here."""
        url = os.environ.get(var)
        if url:
            return url
        svc = start()
        self.services.append(svc)
        log.info("%s not set: started a local %s at %s", var, svc.name, svc.url)
        return svc.url

    def _write_spec(self, env: dict[str, str]) -> str:
        spec = {
            "target": self.target,
            "cwd": os.getcwd(),
            "configs": {n: {"values": c.values, "service_args": c.service_args.model_dump()}
                        for n, c in self.configs.items()},
            **env,
        }
        path = os.path.join(self._tmp.name, "run.json")
        with open(path, "w") as f:
            json.dump(spec, f)
        return path

    @property
    def _drain_limit(self) -> float:
        return self.opts.drain_grace + self.opts.stop_timeout

    async def _start_child(self, name: str, index: int, spec_path: str) -> None:
        cfg = self.configs[name]
        child_env = {**os.environ, **self._child_base_env,
                     **child_log_env(self.opts.log_level, {**os.environ, **cfg.service_args.env}),
                     **cfg.service_args.env,
                     **_devices(cfg.service_args.resources, index),
                     progress.ENV: "1"}
        child = Child(name, index, child_env)
        self.children.append(child)
        await self._spawn(child, spec_path)
        self._children_changed.set()

    def _render(self, child: Child, line: bytes) -> bytes | None:
        """What to print for one line of ``child``'s output (None: nothing)."""
        if self.startup is None or child.output is None:
            return b"[" + child.label.encode() + b"] " + line
        return self.startup.render(child.name, child.label, child.output, line)

    async def _spawn(self, child: Child, spec_path: str) -> None:
        child.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dynagraph.cli.child", "--spec", spec_path,
            "--component", child.component, "--index", str(child.index),
            "--parent-pid", str(os.getpid()),
            env=child.env, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, start_new_session=True,
        )
        if self.startup is not None:
            child.output = self.startup.output_filter(child.env)
            self.startup.started(child.name, child.proc.pid, len(child.restarts))
        child.pump = asyncio.create_task(_pump(child, self._render))

    async def _records(self, discovery: Any) -> dict[str, list[dict[str, Any]]]:
        """Instance records of the processes *this* serve started (their ``serve_id``), by
        component (another graph or host may serve the same components in the namespace)."""
        out: dict[str, list[dict[str, Any]]] = {}
        for ns in {spec_of(c).namespace for c in self.graph.nodes}:
            for key, value in (await discovery.get_prefix(f"/{ns}/instances/")).items():
                out.setdefault(key.split("/")[3], []).append(value)
        return serve_part.own(out, self.serve_id)

    async def _wait_ready(self, discovery: Any, t0: float) -> bool:
        want = {n: c.instances for n, c in self.started.items()}
        delay = 0.02
        while not self.stopping.is_set():
            have = {n: len(v) for n, v in (await self._records(discovery)).items()}
            missing = {n: w - have.get(n, 0) for n, w in want.items() if have.get(n, 0) < w}
            if not missing:
                return True
            dead = [c for c in self.children if c.proc and c.proc.returncode is not None]
            if dead:
                self.exit_code = _exit_code(dead[0].proc.returncode)  # type: ignore[union-attr]
                log.error("%s exited with code %s before the graph was ready", dead[0].label,
                          dead[0].proc.returncode)  # type: ignore[union-attr]
                return False
            if time.monotonic() - t0 > self.opts.ready_timeout:
                log.error("graph not ready after %.0fs; still missing: %s", self.opts.ready_timeout,
                          ", ".join(f"{n} ({k} of {want[n]} instances)" for n, k in missing.items()))
                return False
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), delay)
            delay = min(delay * 1.5, 0.25)
        return False

    def _ready_banner(self, records: dict[str, list[dict[str, Any]]], secs: float,
                      targets: GraphTargets | None = None) -> str:
        part = ("" if len(self.started) == len(self.configs)
                else f" (here: {', '.join(self.started)}; the rest elsewhere)")
        lines = [f"dynamo serve: graph {self.target}{part} ready in {secs:.2f}s"]
        for name in self.graph.names():
            lines.extend(component_lines(name, records.get(name, [])))
        if targets is not None:
            lines.append(f"  prometheus targets: {targets.path} "
                         f"(bash scripts/prometheus.sh {targets.path})")
        http = [r for recs in records.values() for r in recs if r.get("url")]
        if http:
            url, model = http[0]["url"], http[0].get("model", "MODEL")
            lines.append(f"try:\n  curl {url}/v1/models\n  curl {url}/v1/chat/completions "
                         "-H 'Content-Type: application/json' -d '{\"model\": \"" + model + "\", "
                         "\"messages\": [{\"role\": \"user\", \"content\": \"Hello!\"}], "
                         "\"max_tokens\": 32}'\n"
                         "  dynamo status    # components, instances, load, live settings")
        return "\n".join(lines)

    async def _watch_children(self, spec_path: str) -> None:
        while not self.stopping.is_set():
            self._children_changed.clear()
            waits = {asyncio.ensure_future(c.proc.wait()): c for c in self.children
                     if c.proc and not c.retiring}
            stop_wait = asyncio.ensure_future(self.stopping.wait())
            changed = asyncio.ensure_future(self._children_changed.wait())
            done, _ = await asyncio.wait([*waits, stop_wait, changed],
                                         return_when=asyncio.FIRST_COMPLETED)
            for fut in [*waits, stop_wait, changed]:
                if fut not in done:
                    fut.cancel()
            if self.stopping.is_set():
                return
            for fut in done:
                child = waits.get(fut)
                if child is not None and child.retiring:
                    continue  # scaled down meanwhile: _retire owns it
                if child is not None and not await self._handle_exit(child, spec_path):
                    return

    async def _handle_exit(self, child: Child, spec_path: str) -> bool:
        """A child exited on its own: restart it (True) or stop the graph (False)."""
        assert child.proc is not None
        code = child.proc.returncode
        log.error("%s (pid %d) exited with code %s", child.label, child.proc.pid, code)
        if self.startup is not None:
            self.startup.exited(child.name)
        await sweep_group(child)
        now = time.monotonic()
        child.restarts = [t for t in child.restarts if now - t < RESTART_WINDOW]
        if self.opts.restart == "never" or len(child.restarts) >= self.opts.max_restarts:
            why = "--restart never" if self.opts.restart == "never" else (
                f"{len(child.restarts)} restarts within {RESTART_WINDOW:.0f}s")
            log.error("stopping the graph (%s)", why)
            self.exit_code = _exit_code(code)
            self.stopping.set()
            return False
        backoff = min(2.0 ** len(child.restarts), 30.0)
        log.warning("restarting %s in %.0fs (restart %d)", child.label, backoff,
                    len(child.restarts) + 1)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.stopping.wait(), backoff)
        if self.stopping.is_set():
            return False
        child.restarts.append(time.monotonic())
        await self._spawn(child, spec_path)
        return True

    async def _stop_children(self) -> None:
        live = [c for c in self.children if c.proc and c.proc.returncode is None]
        for c in live:
            with contextlib.suppress(ProcessLookupError):
                c.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        if live:
            waits = [asyncio.ensure_future(c.proc.wait()) for c in live]  # type: ignore[union-attr]
            _, pending = await asyncio.wait(waits, timeout=self.opts.stop_timeout)
            for c in live:
                if c.proc.returncode is None:  # type: ignore[union-attr]
                    log.warning("%s did not stop in %.0fs: SIGKILL", c.label, self.opts.stop_timeout)
                    with contextlib.suppress(ProcessLookupError):
                        c.proc.kill()  # type: ignore[union-attr]
            if pending:
                await asyncio.wait(pending, timeout=5)
        for c in self.children:
            await sweep_group(c)
            if c.pump is not None:
                with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                    await asyncio.wait_for(c.pump, 2)


async def _pump(child: Child, render: Callable[[Child, bytes], bytes | None]) -> None:
    """Echo the child's output line by line, as ``render`` shows it."""
    assert child.proc is not None and child.proc.stdout is not None
    out = sys.stdout.buffer
    echo = True
    while True:
        line = await child.proc.stdout.readline()
        if not line:
            return
        if not echo:
            continue  # keep draining so the child never blocks on a full pipe
        shown = render(child, line if line.endswith(b"\n") else line + b"\n")
        if shown is None:
            continue
        try:
            out.write(shown)
            out.flush()
        except (BrokenPipeError, ValueError, OSError):
            echo = False  # whoever read our output is gone; the graph keeps running


def _exit_code(returncode: int | None) -> int:
    if returncode is None:
        return 1
    return 128 - returncode if returncode < 0 else (returncode or 1)


def _devices(resources: dict[str, Any], index: int) -> dict[str, str]:
    """Give worker ``index`` its own GPUs when ``resources: {gpu: N}`` is set."""
    n = int(resources.get("gpu", 0) or 0)
    if n <= 0:
        return {}
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(index * n + k) for k in range(n))}
