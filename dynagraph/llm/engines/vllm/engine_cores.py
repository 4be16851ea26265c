"""An engine core starts on the graph's cores, even where its worker was kept off the
model runners' (a vLLM general plugin; ``dynamo serve --engine-cores keep-off``).

``dynamo serve``'s core keeper (``dynagraph.cli.core_keeper``) binds a worker's threads to
the cores no model runner is bound to. A worker that starts an engine after that (a
restart, a worker scaled up while the graph runs) would hand that binding down: vLLM
picks the new runner's cores among the cores its engine-core process may use, and on a
2-core box that left one core for the runner and none to reserve. So ``dynamo serve``
names the graph's cores in ``GRAPH_CPUS_ENV``, and this plugin, which vLLM runs in its
engine-core process before it starts the model runner, puts that process's thread back on
them. vLLM's own binding then applies as on a fresh start.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from dynagraph.llm.engines.vllm.engine_spin import engine_core_setting
from dynagraph.runtime.cpus import GRAPH_CPUS_ENV, cpu_list

log = logging.getLogger("vllm.dynagraph.engine_cores")


def graph_cpus(env: Mapping[str, str] = os.environ, process_name: str | None = None
               ) -> frozenset[int] | None:
    """The cores an engine-core process should start on: ``GRAPH_CPUS_ENV`` in a process
    named ``EngineCore...``; None elsewhere, or where it is unset or malformed."""
    raw = engine_core_setting(GRAPH_CPUS_ENV, env, process_name)
    if raw is None:
        return None
    try:
        return frozenset(int(c) for c in raw.split(","))
    except ValueError:
        log.warning("%s=%r is not a list of cores: ignored", GRAPH_CPUS_ENV, raw)
        return None


def register() -> None:
    """vLLM's general-plugin hook (``vllm.general_plugins`` entry point)."""
    cpus = graph_cpus()
    if cpus is None or frozenset(os.sched_getaffinity(0)) == cpus:
        return
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        log.warning("engine core: could not move to the graph's cores %s: %s",
                    sorted(cpus), exc)
        return
    log.info("engine core: on the graph's cores %s again (its worker was kept off the "
             "model runners')", cpu_list(cpus))
