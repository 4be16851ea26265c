"""Sending trace requests to a served graph open loop, at their arrival times.

Each request is posted at its ``arrival_s`` from the start whether or not earlier ones
finished (as the simulation admits them), as the streamed ``/v1/completions`` body
``dynagraph.simulate.served.completion_body`` builds; the client records when it was
sent, when the first chunk with a choice came (the first token's, even if its text is
empty), when the stream ended and the usage's cached prompt tokens. Used by
``benchmarks/simulate_fidelity.py`` and ``tests/e2e_mocker/test_simulate_fidelity.py``.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

from dynagraph.simulate.served import ServedRequest
from dynagraph.simulate.trace import TraceRequest


async def _one(session: Any, url: str, request: TraceRequest, body: dict[str, Any],
               t0: float, limit_s: float) -> ServedRequest:
    import aiohttp

    res = ServedRequest(request.index, request.arrival_s, request.input_length)
    delay = t0 + request.arrival_s - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    res.sent_s = time.perf_counter() - t0
    try:
        async with session.post(url, json=body,
                                timeout=aiohttp.ClientTimeout(total=limit_s)) as resp:
            if resp.status != 200:
                res.rejected = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                payload = json.loads(data)
                if "error" in payload:
                    res.error = str(payload["error"])[:200]
                    continue
                if payload.get("choices") and res.first_token_s is None:
                    res.first_token_s = time.perf_counter() - t0
                usage = payload.get("usage")
                if usage:
                    res.completion_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = int(details.get("cached_tokens") or 0)
            res.end_s = time.perf_counter() - t0
    except (aiohttp.ClientError, TimeoutError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    if res.error is None and res.cached_tokens is None:
        res.error = "the stream ended without usage"
    return res


async def replay_open_loop(base_url: str, requests: Sequence[TraceRequest],
                           bodies: Sequence[dict[str, Any]], *, limit_s: float = 300.0,
                           lead_s: float = 0.2) -> list[ServedRequest]:
    """Send ``bodies[i]`` for ``requests[i]`` at its arrival time (from ``lead_s`` after
    the call, so the first ones are not late), all in flight together as due; each
    request may take ``limit_s`` seconds."""
    import aiohttp

    url = f"{base_url}/v1/completions"
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.perf_counter() + lead_s
        return list(await asyncio.gather(*(_one(session, url, r, b, t0, limit_s)
                                           for r, b in zip(requests, bodies, strict=True))))

