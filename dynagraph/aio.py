"""Two asyncio chores done in one place: ending background tasks and closing streams."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Iterable
from typing import Any

log = logging.getLogger(__name__)


async def cancel_and_wait(
    tasks: Iterable[asyncio.Task[Any] | None], timeout: float = 5.0  # noqa: ASYNC109 - a bound, not a deadline
) -> None:
    """Cancel ``tasks`` and wait up to ``timeout`` s for them to finish.

    A task that failed before it was cancelled has its exception logged (it would
    otherwise be lost); one still running after ``timeout`` is logged and left behind.
    Cancelling the caller cancels the wait, not the (already cancelled) tasks' clean-up.
    """
    pending = [t for t in tasks if t is not None]
    for task in pending:
        task.cancel()
    if not pending:
        return
    done, stuck = await asyncio.wait(pending, timeout=timeout)
    for task in done:
        if not task.cancelled() and task.exception() is not None:
            log.error("background task %s failed", task.get_name(), exc_info=task.exception())
    for task in stuck:
        log.warning("background task %s did not stop within %.1fs", task.get_name(), timeout)


async def aclose(stream: AsyncIterator[Any] | None) -> None:
    """Close an async iterator if it can be closed (async generators, request-plane streams)."""
    close = getattr(stream, "aclose", None)
    if close is not None:
        await close()
