"""The graph's cores as ``dynamo serve`` names them to its components.

``dynamo serve`` puts the cores it may use in ``GRAPH_CPUS_ENV`` of every component's
environment; the engine-core plugin (``dynagraph.llm.engines.vllm.engine_cores``) reads
it back, and the core keeper (``dynagraph.cli.core_keeper``) logs core sets the same way.
"""

from __future__ import annotations

GRAPH_CPUS_ENV = "DYNAGRAPH_GRAPH_CPUS"
"""The cores ``dynamo serve`` may use (comma-separated), in its components' environment."""


def cpu_list(cores: frozenset[int]) -> str:
    """``cores`` as ``GRAPH_CPUS_ENV`` holds them (and as logs show them): ``0,1``."""
    return ",".join(str(c) for c in sorted(cores))
