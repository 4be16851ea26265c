"""The request plane between two real processes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dynagraph.errors import InstanceUnavailable, InvalidRequest, StreamBroken
from dynagraph.runtime.rpc import RpcClient

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]


class ServerProcess:
    def __init__(self, proc: asyncio.subprocess.Process, address: str) -> None:
        self.proc = proc
        self.address = address


async def start_server() -> ServerProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.integration.rpc.server_main",
        cwd=REPO, env=env, stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 20)
    except BaseException:
        await stop_server(proc)
        raise
    assert line.startswith(b"ADDRESS "), line
    return ServerProcess(proc, line.split()[1].decode())


async def stop_server(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 5)
        except TimeoutError:
            proc.kill()
            await asyncio.wait_for(proc.wait(), 5)


@pytest.fixture(scope="module")
async def server() -> AsyncIterator[ServerProcess]:
    srv = await start_server()
    yield srv
    await stop_server(srv.proc)
    assert srv.proc.returncode == 0


@pytest.fixture
async def client() -> AsyncIterator[RpcClient]:
    cl = RpcClient()
    yield cl
    await cl.close()


async def test_streams_and_typed_errors_cross_processes(
        server: ServerProcess, client: RpcClient) -> None:
    assert [i async for i in client.call(server.address, "count", 10_000)] == list(range(10_000))
    with pytest.raises(InvalidRequest, match="bad request 7") as info:
        async for _ in client.call(server.address, "fail", 7):
            pass
    assert info.value.param == "prompt"


async def test_cancel_reaches_the_other_process(server: ServerProcess, client: RpcClient) -> None:
    stream = client.call(server.address, "slow", None, headers={"x-request-id": "cancel-me"})
    assert await anext(stream) == "first"
    await stream.aclose()
    start = time.monotonic()
    async with asyncio.timeout(2):
        while True:
            [cancelled] = [s async for s in client.call(server.address, "state", None)]
            if "cancel-me" in cancelled:
                break
            await asyncio.sleep(0.01)
    assert time.monotonic() - start < 1.0


async def test_killed_server_breaks_the_stream_then_fails_fast(client: RpcClient) -> None:
    srv = await start_server()
    try:
        stream = client.call(srv.address, "slow", None)
        assert await anext(stream) == "first"
        srv.proc.kill()
        await asyncio.wait_for(srv.proc.wait(), 5)
        with pytest.raises(StreamBroken):
            await asyncio.wait_for(anext(stream), 5)
        start = time.monotonic()
        with pytest.raises(InstanceUnavailable):
            async for _ in client.call(srv.address, "count", 1):
                pass
        assert time.monotonic() - start < 0.1
    finally:
        await stop_server(srv.proc)


async def test_a_frozen_process_is_detected_by_its_silence() -> None:
    """A quiet handler is kept alive by heartbeats; SIGSTOP stops them: StreamBroken."""
    srv = await start_server()
    patient = RpcClient(idle_timeout=2.5)
    try:
        stream = patient.call(srv.address, "slow", None)
        assert await anext(stream) == "first"
        waiting = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(3.0)  # quiet for longer than idle_timeout, alive: heartbeats
        assert not waiting.done()
        srv.proc.send_signal(signal.SIGSTOP)
        frozen_at = time.monotonic()
        with pytest.raises(StreamBroken, match="sent nothing"):
            await waiting
        assert time.monotonic() - frozen_at < 4.0
    finally:
        srv.proc.send_signal(signal.SIGCONT)
        await patient.close()
        await stop_server(srv.proc)
