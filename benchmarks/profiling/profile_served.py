"""Probe vLLM as it is served, for ``benchmarks/profiling/profile_vllm_cpu.py --as-served``.

The in-process prober times one ``LLMEngine.step()``; a served engine takes longer than
that (processes, IPC, an event loop). Two probers here time what a client sees instead,
on the same grid:

- :class:`EngineProber` (``--as-served engine``) drives our own
  :class:`~dynagraph.llm.engines.vllm.engine.VllmEngine` (the VllmWorker's engine:
  ``AsyncLLM``, engine core in a process of its own, vLLM's CPU binding, outputs over
  ZMQ into an event loop) in this process;
- :class:`GraphProber` (``--as-served graph``) streams ``/v1/completions`` from a
  served ``graphs.agg`` (``dynamo serve``: Frontend, Processor and VllmWorker in
  processes of their own). On a 2-core machine the graph's own processes compete with
  the engine for the CPU, which a profile of the engine alone cannot show; the mocker
  graph then adds its own overhead on top of the profile (``calibrate_profile`` takes
  that out).

What each point means (the mocker prices engine steps with them):

- prefill ``(n, c)``: the first output of a ``max_tokens=1`` request after its
  ``c``-token prefix was cached (checked with the engine's cached-token count);
- decode ``(B, C)``: ``B`` requests decoding together; each request's seconds per token
  over the window in which all ``B`` have started and none has finished (outputs may
  arrive merged when a reader is behind, so tokens are counted, not outputs); one
  sample per batch, the median over its requests;
- mixed: the first output of a new prompt sent while ``B`` requests decode.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import statistics
import time
from typing import Any

from benchmarks.profiling.profile_vllm_cpu import FIRST_TOKEN_ID
from dynagraph.llm.engines.base import SamplingSpec
from dynagraph.llm.engines.vllm.args import VllmEngineArgs
from dynagraph.llm.engines.vllm.engine import VllmEngine

Arrivals = list[tuple[float, int]]
"""(time, tokens so far) for every output of one request."""


def steady_seconds_per_token(arrivals: list[Arrivals]) -> list[float]:
    """Each request's seconds per token while all of them ran (pure; see the module
    docstring). A request with no two outputs in that window is measured from its own
    first to its last output instead."""
    started = max(a[0][0] for a in arrivals)
    ended = min(a[-1][0] for a in arrivals)
    per_token = []
    for a in arrivals:
        window = [(t, n) for t, n in a if started <= t <= ended]
        if len(window) < 2:
            window = a
        (t0, n0), (t1, n1) = window[0], window[-1]
        if n1 > n0:
            per_token.append((t1 - t0) / (n1 - n0))
    return per_token


class _AsyncProber:
    """The prober interface of ``benchmarks.profiling.profile_vllm_cpu`` over an asynchronous
    ``_run`` (one request to its end); subclasses say how a request is sent."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self._ids = itertools.count()

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(FIRST_TOKEN_ID, self.vocab_size) for _ in range(n)]

    async def _run(self, ids: list[int], max_tokens: int,
                   arrivals: Arrivals | None = None) -> tuple[float, int]:
        """Run one request to its end: (seconds to its first output, cached prompt
        tokens); ``arrivals`` gets (time, tokens so far) for every output."""
        raise NotImplementedError

    def prefill(self, new: int, cached: int) -> float:
        prefix = self.tokens(cached)
        if cached:
            self.loop.run_until_complete(self._run(prefix, 1))
        seconds, hit = self.loop.run_until_complete(self._run(prefix + self.tokens(new), 1))
        if hit != cached:
            raise RuntimeError(f"prefill ({new}, {cached}): vLLM reused {hit} cached tokens")
        return seconds

    def decode(self, batch: int, context: int, steps: int) -> tuple[list[float], float]:
        """Seconds per decode step (one sample per batch) and the mean total context."""
        prompt_len = max(1, round(context / batch - 1 - (steps - 1) / 2))
        arrivals: list[Arrivals] = [[] for _ in range(batch)]

        async def run_all() -> None:
            await asyncio.gather(*(self._run(self.tokens(prompt_len), steps + 2, a)
                                   for a in arrivals))

        self.loop.run_until_complete(run_all())
        per_token = steady_seconds_per_token(arrivals)
        if not per_token:
            raise RuntimeError(f"decode ({batch}, {context}): no request made progress")
        mean_context = batch * (prompt_len + 1 + (steps - 1) / 2)
        return [statistics.median(per_token)], mean_context

    def mixed(self, batch: int, context: int, new: int) -> tuple[float, int]:
        """Time to the first output of a ``new``-token prompt sent while ``batch``
        requests decode, and the decodes' total context."""
        prompt_len = max(1, round(context / batch - 1))

        async def probe() -> float:
            arrivals: list[Arrivals] = [[] for _ in range(batch)]
            decoders = [asyncio.ensure_future(self._run(self.tokens(prompt_len), 64, a))
                        for a in arrivals]
            try:
                while not all(arrivals):  # noqa: ASYNC110 (filled by the decoders)
                    await asyncio.sleep(0.0005)
                seconds, _ = await self._run(self.tokens(new), 1)
                return seconds
            finally:
                for d in decoders:
                    d.cancel()
                await asyncio.gather(*decoders, return_exceptions=True)

        return self.loop.run_until_complete(probe()), batch * (prompt_len + 1)

    def close(self) -> None:
        self.loop.close()


class EngineProber(_AsyncProber):
    """Our VllmEngine (the VllmWorker's engine) driven in this process."""

    def __init__(self, args: VllmEngineArgs, seed: int = 0) -> None:
        super().__init__(0, seed)
        self.engine = VllmEngine(args)
        self.loop.run_until_complete(self.engine.start())
        llm = self.engine._llm
        self.vllm_config = llm.vllm_config
        self.vocab_size = int(llm.model_config.get_vocab_size())

    def close(self) -> None:
        self.loop.run_until_complete(self.engine.shutdown())
        super().close()

    async def _run(self, ids: list[int], max_tokens: int,
                   arrivals: Arrivals | None = None) -> tuple[float, int]:
        spec = SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        began = time.perf_counter()
        first, cached, tokens = 0.0, 0, 0
        async for out in self.engine.generate(f"p{next(self._ids)}", ids, spec):
            now = time.perf_counter()
            if not first:
                first, cached = now - began, out.num_cached_tokens
            tokens += len(out.token_ids)
            if arrivals is not None:
                arrivals.append((now, tokens))
        return first, cached


class GraphProber(_AsyncProber):
    """A served graph's ``/v1/completions``, streamed as a client reads it (the body
    ``benchmarks/mocker_fidelity.py`` sends, plus usage in every chunk)."""

    def __init__(self, url: str, model: str, vocab_size: int, seed: int = 0) -> None:
        super().__init__(vocab_size, seed)
        import aiohttp

        self.url = f"{url}/v1/completions"
        self.model = model
        self.session = self.loop.run_until_complete(self._session(aiohttp))

    async def _session(self, aiohttp: Any) -> Any:
        # a fresh connection per request: a kept-alive one can be closed by the server
        # between two points (ServerDisconnectedError); connecting costs well under 1 ms
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                     timeout=aiohttp.ClientTimeout(total=600))

    def close(self) -> None:
        self.loop.run_until_complete(self.session.close())
        super().close()

    async def _run(self, ids: list[int], max_tokens: int,
                   arrivals: Arrivals | None = None) -> tuple[float, int]:
        from benchmarks._common import SseLineParser

        # continuous usage: every chunk says how many tokens the request has so far, so
        # outputs merged by a reader that fell behind, or tokens with no text of their
        # own (special tokens, a partial character), are counted right
        body = {"model": self.model, "prompt": ids, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "skip_special_tokens": False,  # a special token is text too: an output
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        parser = SseLineParser()
        seen: Arrivals = []
        cached = 0
        began = time.perf_counter()
        async with self.session.post(self.url, json=body) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
            async for raw in resp.content.iter_any():
                now = time.perf_counter()
                for data in parser.feed(raw):
                    if data == b"[DONE]":
                        continue
                    payload = json.loads(data)
                    if "error" in payload:
                        raise RuntimeError(f"stream error: {payload['error']}")
                    usage = payload.get("usage") or {}
                    tokens = int(usage.get("completion_tokens") or 0)
                    if payload.get("choices") and tokens > (seen[-1][1] if seen else 0):
                        seen.append((now, tokens))
                    details = usage.get("prompt_tokens_details") or {}
                    cached = int(details.get("cached_tokens") or cached)
        if not seen or seen[-1][1] != max_tokens:
            raise RuntimeError(f"{seen[-1][1] if seen else 0} of {max_tokens} tokens came")
        if arrivals is not None:
            arrivals.extend(seen)
        return seen[0][0] - began, cached
