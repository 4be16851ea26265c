"""The event loop a component process runs on: uvloop, or asyncio's own.

Every token of a stream passes through the event loops of the processes on its path
(socket reads and writes, task wake-ups), so the loop's own cost is paid per token.
uvloop (libuv) does that work in C, and vLLM's own server runs on it too. The gain is
small: on the agg graph as shipped, 151 / 127 us of CPU per output token at 16 / 64
streams outside the engine against 164 / 129 on asyncio's loop
(``benchmarks/results/vllm_bench_serve_uvloop.md``). ``DYNAGRAPH_EVENT_LOOP=asyncio``
keeps asyncio's loop (to compare, or where uvloop misbehaves); ``uvloop`` (the default)
falls back to asyncio's with a warning when uvloop cannot be imported.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

from dynagraph.errors import ConfigError

log = logging.getLogger(__name__)

EVENT_LOOP_ENV = "DYNAGRAPH_EVENT_LOOP"
CHOICES = ("uvloop", "asyncio")

T = TypeVar("T")


def loop_factory(environ: Mapping[str, str]) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The factory of the configured loop (None: asyncio's default)."""
    choice = environ.get(EVENT_LOOP_ENV, "uvloop").strip().lower() or "uvloop"
    if choice not in CHOICES:
        raise ConfigError(f"{EVENT_LOOP_ENV}={choice!r}: expected one of {', '.join(CHOICES)}")
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        log.warning("uvloop is not installed: running on asyncio's event loop")
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def run(main: Callable[[], Coroutine[Any, Any, T]], environ: Mapping[str, str]) -> T:
    """``asyncio.run(main())`` on the loop ``environ`` configures (a bad choice raises
    ``ConfigError`` before ``main`` is called)."""
    with asyncio.Runner(loop_factory=loop_factory(environ)) as runner:
        return runner.run(main())
