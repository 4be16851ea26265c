"""``kill -USR1 <pid>`` on a component process: every asyncio task's stack and every
thread's stack go to its stderr (the graph's log). For a request that hangs without a
trace: the dump shows what each of its tasks is waiting on. ``kill -USR2 <pid>``: the
threads only, written by the signal handler itself, so a blocked event loop shows too.

    install_task_dump(asyncio.get_running_loop())
"""

from __future__ import annotations

import asyncio
import faulthandler
import inspect
import io
import linecache
import signal
import sys
from types import FrameType
from typing import Any

__all__ = ["format_tasks", "install_task_dump"]


def format_tasks(loop: asyncio.AbstractEventLoop | None = None) -> str:
    """The await chain of each of the loop's pending tasks, innermost frame last."""
    out = io.StringIO()
    tasks = asyncio.all_tasks(loop)
    out.write(f"==== {len(tasks)} asyncio tasks\n")
    for task in sorted(tasks, key=lambda t: t.get_name()):
        out.write(f"--- {task.get_name()}\n")
        for frame in _await_chain(task.get_coro()):
            code = frame.f_code
            line = linecache.getline(code.co_filename, frame.f_lineno or 0).strip()
            out.write(f"    {code.co_filename}:{frame.f_lineno} in {code.co_name}: {line}\n")
    return out.getvalue()


def _await_chain(obj: Any, depth: int = 32) -> list[FrameType]:
    """The frames of a suspended coroutine and of what it awaits, following ``async for``
    into the async generator it iterates (found among the awaiting frame's locals)."""
    frames: list[FrameType] = []
    while obj is not None and len(frames) < depth:
        frame = (getattr(obj, "cr_frame", None) or getattr(obj, "ag_frame", None)
                 or getattr(obj, "gi_frame", None))
        if frame is None:
            break
        frames.append(frame)
        nxt = (getattr(obj, "cr_await", None) or getattr(obj, "ag_await", None)
               or getattr(obj, "gi_yieldfrom", None))
        if nxt is not None and not any(hasattr(nxt, a) for a in _FRAME_ATTRS):
            # ``async for``/``anext``: the awaited object hides its generator; the
            # suspended one among the frame's locals is it.
            nxt = next((v for v in frame.f_locals.values()
                        if inspect.isasyncgen(v) and v.ag_await is not None), None)
        obj = nxt
    return frames


_FRAME_ATTRS = ("cr_frame", "ag_frame", "gi_frame")


def install_task_dump(loop: asyncio.AbstractEventLoop) -> None:
    """SIGUSR1: the tasks of ``loop`` and every thread (from the loop: it must turn);
    SIGUSR2: every thread (from the C-level handler: works while the loop is blocked)."""
    faulthandler.register(signal.SIGUSR2, file=sys.stderr, all_threads=True, chain=False)

    def dump() -> None:
        sys.stderr.write(format_tasks(loop))
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)

    loop.add_signal_handler(signal.SIGUSR1, dump)
