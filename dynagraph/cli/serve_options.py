"""The options of one ``dynamo serve`` (its command line, parsed by ``dynagraph.cli.main``).

:class:`ServeOptions` is plain data, read by the supervisor (``dynagraph.cli.serve``) and
its parts; the defaults are the command line's.
"""

from __future__ import annotations

from dataclasses import dataclass

from dynagraph.sdk._runtime import DRAIN_GRACE_S


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
