"""400 concurrent streams with the official client: each completes or is refused with
429/503 (with Retry-After); none is broken or cut short."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import openai
import pytest

from dynagraph.observability.task_dump import format_tasks
from tests.support.serve import ServeProcess

from .conftest import MODEL

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="package")]

STREAMS = 400
MAX_TOKENS = 12


async def one(client: openai.AsyncOpenAI, i: int) -> dict[str, Any]:
    out: dict[str, Any] = {"status": None, "tokens": 0, "finish": None, "error": None,
                           "opened": None, "chunks": 0}
    start = time.monotonic()
    try:
        stream = await client.completions.create(
            model=MODEL, prompt=f"Request {i}: count slowly.", max_tokens=MAX_TOKENS,
            temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        out["opened"] = round(time.monotonic() - start, 2)  # response headers arrived
        async for chunk in stream:
            out["chunks"] += 1
            for c in chunk.choices:
                out["finish"] = c.finish_reason or out["finish"]
            if chunk.usage is not None:
                out["tokens"] = chunk.usage.completion_tokens
        out["status"] = 200
    except openai.APIStatusError as exc:
        out["status"] = exc.status_code
        out["retry_after"] = exc.response.headers.get("retry-after")
    except Exception as exc:  # anything else is a broken stream
        cause = exc.__cause__ or exc.__context__
        out["error"] = f"{type(exc).__name__}: {exc}" + (
            f" ({type(cause).__name__}: {cause})" if cause is not None else "")
        out["after_s"] = round(time.monotonic() - start, 1)
    return out


async def load(router_graph: ServeProcess) -> tuple[list[dict[str, Any]], str]:
    """The 400 streams, and (if some still hang after 100 s) every component's tasks."""
    client = openai.AsyncOpenAI(base_url=f"{router_graph.url()}/v1", api_key="none",
                                max_retries=0, timeout=120, http_client=None)
    try:
        tasks = [asyncio.create_task(one(client, i)) for i in range(STREAMS)]
        _, pending = await asyncio.wait(tasks, timeout=100)
        # Requests that hang: what every component waits on, while they still hang.
        dump = (f"{router_graph.dump_tasks()}\n[client] {format_tasks()}"
                if pending else "")
        return list(await asyncio.gather(*tasks)), dump
    finally:
        await client.close()


async def test_overload_refuses_cleanly(router_graph: ServeProcess) -> None:
    # The client runs in a fresh event loop on a thread of its own (see conftest: the test
    # process's loop once stopped seeing some of its sockets become readable).
    results, dump = await asyncio.to_thread(asyncio.run, load(router_graph))
    broken = [r for r in results if r["error"] is not None]
    assert broken == [], f"{len(broken)} broken, e.g. {broken[:3]}\n{dump[-30000:]}"
    done = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] in (429, 503)]
    assert len(done) + len(refused) == STREAMS, [r for r in results if r not in done + refused]
    assert all(r["tokens"] == MAX_TOKENS and r["finish"] == "length" for r in done)
    assert all(r["retry_after"] is not None for r in refused)
    assert done and refused  # the test graph's admission limits are small: both happen
