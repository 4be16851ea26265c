"""A decode worker frozen or killed mid-stream: every stream goes on, on the other worker;
a Processor killed mid-stream: every stream goes on through the other Processor.

Runs before test_worker_loss (file order); the killed worker is restarted by dynamo
serve and back before that test needs two workers again.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from typing import Any

import openai
import pytest

from tests.support.greedy import TOP_LOGPROBS, Greedy, assert_agrees

from ._probe import GraphProbe
from .conftest import MODEL

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="package")]

STREAMS = 8
MAX_TOKENS = 300
PREFIX = "The history of the printing press in Europe, told in detail. " * 6
PROMPTS = [f"{PREFIX}Chapter {i}:" for i in range(STREAMS)]


def streams_on_own_loop(url: str, started: threading.Event | None = None,
                        logprobs: int | None = None) -> asyncio.Future[list[dict[str, Any]]]:
    """``run_streams`` with its own client, in a fresh event loop on a thread of its own:
    the test process's loop, shared with the probes, once stopped seeing some sockets
    become readable (see conftest), and a client must not depend on it."""
    async def main() -> list[dict[str, Any]]:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                    timeout=120)
        try:
            return await run_streams(client, started, logprobs)
        finally:
            await client.close()

    return asyncio.ensure_future(asyncio.to_thread(asyncio.run, main()))


async def run_streams(client: openai.AsyncOpenAI, started: threading.Event | None = None,
                      logprobs: int | None = None) -> list[dict[str, Any]]:
    """The 8 prompts at once, streamed; each result: text, finish reasons, usage, error
    and, asked for ``logprobs``, the text as a greedy reference (``tests.support.greedy``)."""
    first_chunks = 0

    async def one(prompt: str) -> dict[str, Any]:
        nonlocal first_chunks
        out: dict[str, Any] = {"text": "", "finish": [], "usage": None, "error": None}
        seen = False
        tokens: list[str] = []
        tops: list[dict[str, float] | None] = []
        try:
            stream = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                stream=True, stream_options={"include_usage": True}, logprobs=logprobs,
                extra_body={"ignore_eos": True})
            async for chunk in stream:
                for c in chunk.choices:
                    out["text"] += c.text
                    if c.logprobs is not None:
                        tokens += c.logprobs.tokens or []
                        tops += c.logprobs.top_logprobs or []
                    if c.finish_reason:
                        out["finish"].append(c.finish_reason)
                    if not seen and c.text:
                        seen = True
                        first_chunks += 1
                        if started is not None and first_chunks == STREAMS:
                            started.set()
                if chunk.usage is not None:
                    out["usage"] = chunk.usage.completion_tokens
        except openai.APIError as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
        if logprobs:
            out["greedy"] = Greedy.of_parts(out["text"], tokens, tops)
        return out

    return list(await asyncio.gather(*(one(p) for p in PROMPTS)))


def assert_complete(results: list[dict[str, Any]], uninterrupted: list[dict[str, Any]]
                    ) -> None:
    """Every stream finished in full, without an error, with the uninterrupted run's text
    up to a near tie (what moved elsewhere mid-way is recomputed there)."""
    for i, (got, want) in enumerate(zip(results, uninterrupted, strict=True)):
        assert got["error"] is None, f"stream {i}: {got['error']}"
        assert got["finish"] == ["length"], f"stream {i}: {got['finish']}"
        assert got["usage"] == MAX_TOKENS, f"stream {i}: usage {got['usage']}"
        assert_agrees(want["greedy"], got["text"], f"stream {i} vs the uninterrupted run")


_REFERENCE: list[dict[str, Any]] = []
"""The uninterrupted run of the 8 streams (with logprobs), shared by the kill tests."""


async def reference(url: str) -> list[dict[str, Any]]:
    """The 8 streams' uninterrupted results (run once, by the first test that asks)."""
    if not _REFERENCE:
        got = await streams_on_own_loop(url, logprobs=TOP_LOGPROBS)
        assert all(r["error"] is None and r["usage"] == MAX_TOKENS for r in got), got
        _REFERENCE.extend(got)
    return _REFERENCE


async def busiest_worker(probe: GraphProbe) -> tuple[int, int]:
    """(instance id, pid) of the worker running the most requests now."""
    best: tuple[float, int, int] = (-1.0, 0, 0)
    for wid, rec in (await probe.workers()).items():
        text = (await probe.http.get(f"http://{rec['metrics']}/metrics")).text
        running = next(float(line.split()[-1]) for line in text.splitlines()
                       if line.startswith("dynamo_worker_requests_running"))
        best = max(best, (running, wid, int(rec["pid"])))
    return best[1], best[2]


async def test_a_frozen_worker_s_streams_move_on(router_url: str, probe: GraphProbe) -> None:
    """SIGSTOP (not dead: its connections stay open): its heartbeats stop, the streams
    migrate within seconds; it serves again after SIGCONT."""
    await probe.wait_workers(2)
    pid = 0
    try:
        started = threading.Event()
        streams = streams_on_own_loop(router_url, started)
        assert await asyncio.to_thread(started.wait, 60), "not every stream had output"
        _, pid = await busiest_worker(probe)
        os.kill(pid, signal.SIGSTOP)
        results = await asyncio.wait_for(streams, 120)
    finally:
        if pid:
            os.kill(pid, signal.SIGCONT)
    for i, got in enumerate(results):
        assert got["error"] is None and got["usage"] == MAX_TOKENS, f"stream {i}: {got}"
    await probe.wait_workers(2)  # back (its lease expired while frozen: it re-registers)


async def test_sigkill_during_streams_loses_nothing(router_url: str, probe: GraphProbe) -> None:
    await probe.wait_workers(2)
    want = await reference(router_url)

    started = threading.Event()
    streams = streams_on_own_loop(router_url, started)
    assert await asyncio.to_thread(started.wait, 60), "not every stream had output"
    _, pid = await busiest_worker(probe)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    results = await asyncio.wait_for(streams, 120)
    assert_complete(results, want)  # recomputed on the other worker
    assert time.monotonic() - killed_at < 60


def complete_now(url: str, n: int) -> list[int]:
    """The status codes of ``n`` short completions sent at once (in threads)."""
    import concurrent.futures

    import httpx

    def one(i: int) -> int:
        return httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": f"Request {i} during the kill:", "max_tokens": 8,
            "temperature": 0}).status_code

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


async def test_a_killed_processor_s_streams_go_on_through_the_other(
        router_url: str, probe: GraphProbe) -> None:
    """SIGKILL one of the two Processors once every stream has output: the Frontend sends
    each of its streams on through the other Processor (the prompt plus the tokens the
    client already has), so all 8 finish in full; requests sent during the kill succeed."""
    await probe.wait_workers(2)
    processors = await probe.processes("Processor")
    assert len(processors) == 2, processors
    want = await reference(router_url)

    started = threading.Event()
    streams = streams_on_own_loop(router_url, started)
    assert await asyncio.to_thread(started.wait, 60), "not every stream had output"
    victim = int(next(iter(processors.values()))["pid"])
    os.kill(victim, signal.SIGKILL)
    during = await asyncio.to_thread(complete_now, router_url, 4)
    results = await asyncio.wait_for(streams, 120)
    assert_complete(results, want)
    assert during == [200] * 4, during
