"""The supervisor's child processes: start, echo, restart on exit, stop.

:class:`ChildProcesses` is mixed into ``dynagraph.cli.serve.Supervisor``, which provides
its attributes. A child is ``python -m dynagraph.cli.child`` in a session of its own; each
line it prints is echoed as ``StartupOutput`` renders it (before that exists, with a
``[Component:index]`` prefix). A child that exits by itself is restarted after a backoff
of 1, 2, 4 ... 30 s unless ``--restart never`` or more than ``--max-restarts`` restarts
within ``RESTART_WINDOW`` s; then the graph stops with ``child_exit_code`` of it. Stopping
sends SIGTERM, SIGKILL after ``--stop-timeout``, then sweeps each child's process group.

``children_tmpdir`` is the components' ``TMPDIR``: short enough for vLLM's IPC sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from dynagraph.cli._logging import child_log_env
from dynagraph.cli.scaling import Child, sweep_group
from dynagraph.cli.serve_options import ServeOptions
from dynagraph.cli.startup_output import StartupOutput
from dynagraph.runtime import progress
from dynagraph.sdk._config import ComponentConfig

log = logging.getLogger("dynagraph.serve")

RESTART_WINDOW = 60.0

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


class ChildProcesses:
    """The supervisor's part that runs its children (``dynagraph.cli.serve.Supervisor``
    provides these attributes)."""

    configs: dict[str, ComponentConfig]
    opts: ServeOptions
    children: list[Child]
    stopping: asyncio.Event
    exit_code: int
    startup: StartupOutput | None
    _child_base_env: dict[str, str]
    _children_changed: asyncio.Event

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
            self.exit_code = child_exit_code(code)
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


def child_exit_code(returncode: int | None) -> int:
    """What a graph stopped because of a child exits with: the child's exit code (1 for 0
    or none), 128 + the signal number if it was killed."""
    if returncode is None:
        return 1
    return 128 - returncode if returncode < 0 else (returncode or 1)


def _devices(resources: dict[str, Any], index: int) -> dict[str, str]:
    """Give worker ``index`` its own GPUs when ``resources: {gpu: N}`` is set."""
    n = int(resources.get("gpu", 0) or 0)
    if n <= 0:
        return {}
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(index * n + k) for k in range(n))}
