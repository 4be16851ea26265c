"""Open-loop trace replay against an OpenAI-compatible server.

:func:`replay` sends each record at its timestamp (seconds from the start of the run),
whether or not earlier requests have finished, as a streamed ``/v1/completions`` request
with a token-id prompt::

    {"model": M, "prompt": [ids...], "max_tokens": output_length, "ignore_eos": true,
     "stream": true, "stream_options": {"include_usage": true}}

and records, per request, when it was due, when it went out, when each token event
arrived, when it ended, the usage counts and any error. Every record yields exactly one
:class:`RequestResult`; nothing is dropped.

Latencies are measured from the time the request was **due** (its scheduled arrival), not
from when it went out, so a client that falls behind (all ``max_connections`` busy, or a
late event loop) shows up as latency instead of hiding it; ``sent_s - scheduled_s`` says
how late each one went out.

Errors (``RequestResult.error``): ``HTTP <status>: <OpenAI error message>``; ``stream
error: <message>`` for an error event inside a 200 stream; ``truncated: ...`` for a stream
that ends without ``[DONE]`` or with fewer completion tokens than ``max_tokens`` (with
``ignore_eos`` the server must produce all of them); ``timeout: ...``; ``connection:
...``; ``bad event: ...`` for an event that is not JSON.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from benchmarks._common import SseLineParser
from benchmarks.traces.prompts import PromptSynthesizer
from benchmarks.traces.trace import TraceRecord

log = logging.getLogger("bench.traces.replay")


@dataclass
class RequestResult:
    """One replayed request; all times are seconds from the start of the run."""

    index: int
    scheduled_s: float
    input_length: int
    max_tokens: int
    sent_s: float = float("nan")
    status: int | None = None
    token_times: list[float] = field(default_factory=list)
    end_s: float | None = None
    output_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tokens(self) -> int:
        """Completion tokens: the usage count, else the number of token events seen."""
        return self.output_tokens if self.output_tokens is not None else len(self.token_times)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.scheduled_s if self.token_times else None

    @property
    def e2e_s(self) -> float | None:
        return self.end_s - self.scheduled_s if self.end_s is not None else None

    @property
    def mean_itl_s(self) -> float | None:
        """(last token - first token) / (tokens - 1); None with fewer than two tokens.

        Independent of how tokens were grouped into events, unlike the event gaps.
        """
        n = self.tokens
        if n < 2 or len(self.token_times) < 1:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (n - 1)

    def as_dict(self) -> dict[str, Any]:
        """A JSON-friendly summary (without the per-token times)."""
        def ms(v: float | None) -> float | None:
            return None if v is None else round(v * 1000.0, 3)
        return {
            "index": self.index, "scheduled_s": round(self.scheduled_s, 4),
            "send_lag_ms": ms(self.sent_s - self.scheduled_s), "status": self.status,
            "input_length": self.input_length, "max_tokens": self.max_tokens,
            "output_tokens": self.output_tokens, "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens, "token_events": len(self.token_times),
            "ttft_ms": ms(self.ttft_s), "mean_itl_ms": ms(self.mean_itl_s),
            "e2e_ms": ms(self.e2e_s), "error": self.error,
        }


@dataclass(frozen=True)
class ReplayOptions:
    """Where and how to send: ``url`` is the server's base URL (``http://host:port``)."""

    url: str
    model: str
    max_connections: int = 256
    request_timeout_s: float = 600.0
    read_timeout_s: float = 120.0
    endpoint: str = "/v1/completions"
    extra_body: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError("max_connections must be >= 1")


@dataclass
class ReplayRun:
    """The results of one replay, one per record in record order.

    ``loop_lag_s``: how late each wake-up of a 10 ms timer in the client's event loop was,
    over the run. Large values mean the client itself was stalled (its own work, or no CPU
    for its process); during a stall token events queue up and are read together, which
    shows as late first tokens and near-zero gaps.
    """

    results: list[RequestResult]
    wall_s: float
    options: ReplayOptions
    run_id: str
    loop_lag_s: list[float] = field(default_factory=list)


def request_body(record: TraceRecord, prompts: PromptSynthesizer, options: ReplayOptions
                 ) -> dict[str, Any]:
    """The JSON body sent for ``record``."""
    return {
        "model": options.model,
        "prompt": prompts.prompt(record),
        "max_tokens": record.output_length,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **options.extra_body,
    }


def error_message(status: int, text: str) -> str:
    """``HTTP <status>: <message>`` from an OpenAI error body (or the raw text)."""
    message = text.strip()[:300]
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            message = str(err["message"])
            if err.get("type"):
                message = f"{err['type']}: {message}"
        elif isinstance(err, str):
            message = err
    return f"HTTP {status}: {message}"


async def wait_ready(url: str, timeout_s: float) -> None:
    """Poll ``GET {url}/v1/models`` until it answers 200; ``TimeoutError`` after
    ``timeout_s`` naming the last failure."""
    last = "no answer"
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while time.monotonic() < deadline:
            try:
                async with session.get(url.rstrip("/") + "/v1/models") as resp:
                    if resp.status == 200:
                        return
                    last = f"HTTP {resp.status}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(0.2)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f} s ({last})")


class _Replayer:
    def __init__(self, session: aiohttp.ClientSession, options: ReplayOptions, run_id: str,
                 t0: float) -> None:
        self.session = session
        self.options = options
        self.url = options.url.rstrip("/") + options.endpoint
        self.run_id = run_id
        self.t0 = t0
        self.slots = asyncio.Semaphore(options.max_connections)
        self.in_flight = 0
        self.finished = 0
        self.failed = 0

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def send(self, res: RequestResult, body: bytes) -> None:
        async with self.slots:
            res.sent_s = self.now()
            self.in_flight += 1
            try:
                async with asyncio.timeout(self.options.request_timeout_s):
                    await self._stream(res, body)
            except aiohttp.ServerTimeoutError as exc:  # sock_read: a silent stream
                res.error = f"timeout: {exc}"
            except TimeoutError:
                res.error = f"timeout: no end after {self.options.request_timeout_s:g} s"
            except (aiohttp.ClientError, OSError) as exc:
                res.error = f"connection: {type(exc).__name__}: {exc}"
            except ValueError as exc:
                res.error = f"bad event: {exc}"
            finally:
                if res.end_s is None:
                    res.end_s = self.now()
                self.in_flight -= 1
                self.finished += 1
                self.failed += res.error is not None
        if res.error is not None:
            log.debug("request %d failed: %s", res.index, res.error)

    async def _stream(self, res: RequestResult, body: bytes) -> None:
        headers = {"content-type": "application/json",
                   "x-request-id": f"{self.run_id}-{res.index}"}
        async with self.session.post(self.url, data=body, headers=headers) as resp:
            res.status = resp.status
            if resp.status != 200:
                res.error = error_message(resp.status, await resp.text())
                res.end_s = self.now()
                return
            parser = SseLineParser()
            done = False
            async for raw in resp.content.iter_any():
                now = self.now()
                for data in parser.feed(raw):
                    if data == b"[DONE]":
                        done = True
                        continue
                    event = json.loads(data)
                    self._event(res, event, now)
            res.end_s = self.now()
        if res.error is None:
            if not done:
                res.error = "truncated: the stream ended without [DONE]"
            elif res.tokens < res.max_tokens:
                res.error = f"truncated: {res.tokens} of {res.max_tokens} tokens"

    @staticmethod
    def _event(res: RequestResult, event: Any, now: float) -> None:
        if not isinstance(event, dict):
            raise ValueError(f"event is not a JSON object: {str(event)[:100]}")
        if "error" in event:
            err = event["error"]
            message = err.get("message", err) if isinstance(err, dict) else err
            if res.error is None:
                res.error = f"stream error: {message}"
            return
        usage = event.get("usage")
        if isinstance(usage, dict):
            res.output_tokens = int(usage.get("completion_tokens", 0))
            res.prompt_tokens = usage.get("prompt_tokens")
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and details.get("cached_tokens") is not None:
                res.cached_tokens = int(details["cached_tokens"])
        if event.get("choices"):
            res.token_times.append(now)

    async def watch_loop(self, lags: list[float], interval_s: float = 0.01) -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(interval_s)
            lags.append(max(0.0, time.perf_counter() - t - interval_s))

    async def report_progress(self, every_s: float, total: int) -> None:
        while True:
            await asyncio.sleep(every_s)
            log.info("t=%.0fs sent %d/%d, in flight %d, finished %d, errors %d", self.now(),
                     self.finished + self.in_flight, total, self.in_flight, self.finished,
                     self.failed)


async def replay(records: Sequence[TraceRecord], prompts: PromptSynthesizer,
                 options: ReplayOptions, *, progress_every_s: float | None = None
                 ) -> ReplayRun:
    """Replay ``records`` open loop (timestamps in ms from the run start; see :func:`scale`
    in :mod:`.trace` for speed and windows) and return one result per record.

    The body of the next request is built before waiting for its time, so building never
    delays a send. At most ``max_connections`` requests are on the wire; a request due
    while all are busy waits for one (its latency counts from when it was due).
    """
    run_id = f"trace-{secrets.token_hex(4)}"
    connector = aiohttp.TCPConnector(limit=options.max_connections)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=options.read_timeout_s)
    results: list[RequestResult] = []
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        t0 = time.perf_counter()
        rep = _Replayer(session, options, run_id, t0)
        lags: list[float] = []
        watchers = [asyncio.create_task(rep.watch_loop(lags))]
        if progress_every_s:
            watchers.append(asyncio.create_task(rep.report_progress(progress_every_s,
                                                                    len(records))))
        try:
            async with asyncio.TaskGroup() as tg:
                for i, record in enumerate(records):
                    body = json.dumps(request_body(record, prompts, options)).encode()
                    res = RequestResult(index=i, scheduled_s=record.timestamp / 1000.0,
                                        input_length=record.input_length,
                                        max_tokens=record.output_length)
                    results.append(res)
                    delay = res.scheduled_s - rep.now()
                    if delay > 0:
                        await asyncio.sleep(delay)
                    tg.create_task(rep.send(res, body))
        finally:
            for w in watchers:
                w.cancel()
            await asyncio.wait(watchers, timeout=5)
        wall = rep.now()
    assert len(results) == len(records)
    return ReplayRun(results=results, wall_s=wall, options=options, run_id=run_id,
                     loop_lag_s=lags)
