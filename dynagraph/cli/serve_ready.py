"""When the graph ``dynamo serve`` started is ready, and the banner that says so.

:class:`Readiness` is mixed into ``dynagraph.cli.serve.Supervisor``, which provides its
attributes. Ready means every component this serve started has its ``instances`` instance
records in etcd, counting only this serve's own (their ``serve_id``: another graph or host
may serve the same components in the namespace). ``_wait_ready`` returns False, having
logged why and set ``exit_code`` where a child is to blame, when a child exits first, after
``--ready-timeout``, or on a stop signal. ``_ready_banner`` is the text printed once ready:
each component's instances, the Prometheus targets file and a ``curl`` to try.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from typing import Any

from dynagraph.cli import serve_part
from dynagraph.cli._banner import component_lines
from dynagraph.cli.scaling import Child
from dynagraph.cli.serve_children import child_exit_code
from dynagraph.cli.serve_options import ServeOptions
from dynagraph.observability.graph_targets import GraphTargets
from dynagraph.sdk._config import ComponentConfig
from dynagraph.sdk._graph import Graph
from dynagraph.sdk._service import spec_of

log = logging.getLogger("dynagraph.serve")


class Readiness:
    """The supervisor's part that waits for the graph and announces it
    (``dynagraph.cli.serve.Supervisor`` provides these attributes)."""

    target: str
    graph: Graph
    configs: dict[str, ComponentConfig]
    opts: ServeOptions
    started: Mapping[str, ComponentConfig]
    serve_id: str
    children: list[Child]
    stopping: asyncio.Event
    exit_code: int

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
                self.exit_code = child_exit_code(dead[0].proc.returncode)  # type: ignore[union-attr]
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
