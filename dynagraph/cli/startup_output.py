"""``dynamo serve``'s start-up display on stdout: `dynagraph.cli.startup`'s filter and view
wired to the supervisor's children (the I/O half; the decisions are in ``startup``)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Mapping
from typing import Any

from dynagraph.cli._logging import quiet_vllm
from dynagraph.cli.startup import OutputFilter, StartupView
from dynagraph.sdk._config import embedded_in


def emit(text: str) -> None:
    """Print one of our own lines on the stream the children's lines go to, whole."""
    try:
        sys.stdout.buffer.write(text.encode() + b"\n")
        sys.stdout.buffer.flush()
    except (BrokenPipeError, ValueError, OSError):
        pass  # whoever read our output is gone; the graph keeps running


class StartupOutput:
    """One per supervisor. ``configs``: component name -> ``ComponentConfig``."""

    def __init__(self, target: str, configs: Mapping[str, Any], log_level: str) -> None:
        self.t0 = time.monotonic()
        self.quiet = log_level != "debug"
        workers = {n: c.service_args.workers for n, c in configs.items()
                   if c.service_args.embed_in is None}  # those run in their hosts' processes
        guests = {n: embedded_in(configs, n) for n in workers}
        names = [f"{n}[{i}]" for n, w in workers.items() for i in range(w)]
        self.view = StartupView(self.t0, names)
        self._all_ready = asyncio.Event()
        parts = [(n if w == 1 else f"{n} x{w}")
                 + (f" with {', '.join(guests[n])} inside" if guests[n] else "")
                 for n, w in workers.items()]
        emit(f"dynamo serve: starting {target}: {len(names)} "
             f"process{'' if len(names) == 1 else 'es'} ({', '.join(parts)})")

    def output_filter(self, child_env: Mapping[str, str]) -> OutputFilter:
        """The filter for a child started with ``child_env``."""
        return OutputFilter(quiet_vllm=self.quiet and quiet_vllm(dict(child_env)),
                            hide_benign=self.quiet)

    def started(self, name: str, pid: int, restart: int) -> None:
        emit(self.view.started(name, pid, time.monotonic(), restart=restart))

    def exited(self, name: str) -> None:
        self.view.exited(name)
        self._all_ready.clear()

    def render(self, name: str, label: str, filt: OutputFilter, line: bytes) -> bytes | None:
        """What to print for one line of child ``name``'s output (``label``: its prefix)."""
        verdict = filt.classify(line.decode(errors="replace"))
        if verdict.action == "hide":
            return None
        if verdict.action == "show" or verdict.event is None:
            return b"[" + label.encode() + b"] " + line
        text = self.view.event(name, verdict.event, time.monotonic())
        if self.view.all_ready():
            self._all_ready.set()
        return None if text is None else text.encode() + b"\n"

    async def say_waiting(self) -> None:
        """Until cancelled: name what the graph waits for when nothing else was printed."""
        while True:
            await asyncio.sleep(1.0)
            line = self.view.waiting(time.monotonic())
            if line is not None:
                emit(line)

    async def all_said_ready(self) -> None:
        """Wait (up to 3 s) until every child's "ready" line went through its pipe, so the
        ready banner comes after all of their start-up output."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._all_ready.wait(), 3.0)
