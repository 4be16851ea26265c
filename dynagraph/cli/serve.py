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

The supervisor is :class:`Supervisor` (``run`` once; it returns the exit code); its parts
are mixed in: ``serve_infra`` (etcd, NATS, graph secret, Prometheus targets, run spec),
``serve_children`` (start, echo, restart, stop the children), ``serve_ready`` (readiness
and the ready banner) and ``scaling`` (scale keys at run time). Its options are
``serve_options.ServeOptions``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import tempfile
import time
import uuid

from dynagraph.aio import cancel_and_wait
from dynagraph.cli import serve_part, serve_state
from dynagraph.cli.core_keeper import INTERVAL_S as CORE_KEEPER_INTERVAL_S
from dynagraph.cli.core_keeper import CoreKeeper
from dynagraph.cli.scaling import Child, RuntimeScaling
from dynagraph.cli.serve_children import ChildProcesses, children_tmpdir
from dynagraph.cli.serve_infra import GraphInfra
from dynagraph.cli.serve_options import ServeOptions
from dynagraph.cli.serve_ready import Readiness
from dynagraph.cli.startup_output import StartupOutput
from dynagraph.observability.graph_targets import GraphTargets
from dynagraph.runtime.cpus import GRAPH_CPUS_ENV, cpu_list
from dynagraph.runtime.infra import LocalService
from dynagraph.runtime.nice import ENGINE_NICE_DIR_ENV
from dynagraph.runtime.secret import SECRET_ENV
from dynagraph.sdk._config import ComponentConfig
from dynagraph.sdk._graph import Graph
from dynagraph.sdk._runtime import DRAIN_GRACE_ENV
from dynagraph.sdk._service import spec_of

log = logging.getLogger("dynagraph.serve")


class Supervisor(ChildProcesses, Readiness, GraphInfra, RuntimeScaling):
    """One ``dynamo serve`` of a graph (see the module docstring)."""

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

    @property
    def _drain_limit(self) -> float:
        return self.opts.drain_grace + self.opts.stop_timeout
