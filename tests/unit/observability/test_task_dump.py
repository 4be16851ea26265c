"""SIGUSR1 prints every asyncio task's stack: a hung request shows what it waits on."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator

import pytest

from dynagraph.observability.task_dump import format_tasks, install_task_dump


async def test_the_dump_names_each_task_and_where_it_waits() -> None:
    gate = asyncio.Event()

    async def items() -> AsyncIterator[int]:
        await gate.wait()
        yield 1

    async def waits_at_the_gate() -> None:
        stream = items()
        async for _ in stream:
            pass

    task = asyncio.create_task(waits_at_the_gate(), name="stuck-request")
    await asyncio.sleep(0)
    text = format_tasks()
    gate.set()
    await task
    assert "--- stuck-request" in text
    # The chain goes through ``async for`` into the generator and down to the Event.
    assert "in waits_at_the_gate: async for _ in stream:" in text
    assert "in items: await gate.wait()" in text and "in wait: await fut" in text


async def test_sigusr1_writes_the_dump_to_stderr(capfd: pytest.CaptureFixture[str]) -> None:
    loop = asyncio.get_running_loop()
    install_task_dump(loop)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        err = ""
        for _ in range(100):
            await asyncio.sleep(0.01)
            err += capfd.readouterr().err
            if "Current thread" in err:
                break
        assert "asyncio tasks" in err and "test_sigusr1_writes_the_dump_to_stderr" in err
        assert "Current thread" in err
    finally:
        loop.remove_signal_handler(signal.SIGUSR1)
        import faulthandler
        faulthandler.unregister(signal.SIGUSR2)
