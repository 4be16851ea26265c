"""Engine outputs -> OpenAI text chunks for requests beyond plain text (the Processor's back half).

A plain request (one prompt, one choice, text only) goes through
:func:`dynagraph.llm.detokenize.detokenize_stream` alone. Everything else goes through
:class:`ResponseAssembler`, which keeps one :class:`ResponseDetokenizer` per choice
(stop strings, finish reason, token counts) and adds, only where the request asked:

* the choice ``index`` (``prompt_index * n + engine index``, vLLM's order);
* ``logprobs`` in the endpoint's shape, token text from this tokenizer
  (:mod:`dynagraph.llm.api.logprobs`), for exactly the tokens the detokenizer counted;
* ``echo``: the prompt (completions) or the last message (chat) leads the choice's
  first chunk, with the prompt's logprobs under completions' ``logprobs``;
* ``prompt_logprobs`` (vLLM's field) on each choice's first chunk;
* tool calls: parsed from the choice's text (streamed as deltas, or once at the end
  for a non-streamed answer) by :class:`dynagraph.llm.api.tools.ChoiceTools`.

Token counts in the chunks are running totals over all choices and prompts.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

from dynagraph.errors import EngineError
from dynagraph.llm.api.logprobs import LogprobFormatter, TokenTexts, echo_positions, prompt_logprobs
from dynagraph.llm.api.tools import ChoiceTools
from dynagraph.llm.detokenize import ResponseDetokenizer
from dynagraph.llm.preprocess import PromptPlan, RequestPlan
from dynagraph.llm.protocol import LLMEngineOutput, TextChunk
from dynagraph.llm.tokenizer import Tokenizer


class _Choice:
    __slots__ = ("index", "prompt", "detok", "logprobs", "tools", "echo", "first", "text",
                 "done")

    def __init__(self, index: int, prompt: PromptPlan, detok: ResponseDetokenizer,
                 logprobs: LogprobFormatter | None, tools: ChoiceTools | None) -> None:
        self.index = index
        self.prompt = prompt
        self.detok = detok
        self.logprobs = logprobs
        self.tools = tools
        self.echo = prompt.echo_text
        self.first = True
        self.text = ""
        self.done = False


class ResponseAssembler:
    """Per request: engine outputs of every prompt and choice in, :class:`TextChunk` out.

    Called by the Processor for each worker output, in order per prompt. Pure and
    synchronous; raises :class:`EngineError` for an engine-side failure.
    """

    def __init__(self, tokenizer: Tokenizer, texts: TokenTexts, plan: RequestPlan) -> None:
        self.plan = plan
        self._texts = texts
        self._choices: list[_Choice] = []
        for p, prompt in enumerate(plan.prompts):
            for c in range(plan.n):
                fmt = None if plan.logprobs is None else LogprobFormatter(texts, plan.logprobs)
                self._choices.append(_Choice(
                    p * plan.n + c, prompt,
                    ResponseDetokenizer(tokenizer, prompt.request,
                                        include_stop_str=plan.include_stop_str),
                    fmt, None if plan.tools is None else ChoiceTools(plan.tools)))
        self._prompt_tokens = [len(p.request.token_ids) for p in plan.prompts]
        self._cached: list[int | None] = [None] * len(plan.prompts)
        self._prompt_lp: list[list[dict[str, Any] | None] | None] = [None] * len(plan.prompts)
        self._raw_prompt_lp: list[Any] = [None] * len(plan.prompts)
        self.completion_tokens = 0
        self._open = len(self._choices)

    @property
    def finished(self) -> bool:
        return self._open == 0

    def prompt_finished(self, prompt_index: int) -> bool:
        n = self.plan.n
        return all(c.done for c in self._choices[prompt_index * n:(prompt_index + 1) * n])

    def process(self, prompt_index: int, output: LLMEngineOutput) -> TextChunk | None:
        """Consume one engine output of prompt ``prompt_index``; the chunk to send, or None."""
        if not 0 <= output.index < self.plan.n:
            raise EngineError(f"the engine answered for choice {output.index} of "
                              f"{self.plan.n}")
        ch = self._choices[prompt_index * self.plan.n + output.index]
        if ch.done:
            return None
        if output.prompt_tokens is not None:
            self._prompt_tokens[prompt_index] = output.prompt_tokens
        if output.cached_tokens is not None:
            self._cached[prompt_index] = output.cached_tokens
        if output.prompt_logprobs is not None and self._raw_prompt_lp[prompt_index] is None:
            self._raw_prompt_lp[prompt_index] = output.prompt_logprobs
        before = ch.detok.completion_tokens
        piece = ch.detok.process(output)
        consumed = ch.detok.completion_tokens - before
        self.completion_tokens += consumed
        text = piece.text if piece is not None else ""
        finish: str | None = ch.detok.finish_reason if piece is not None else None
        if ch.prompt.echo_only:
            text = ""
        logprobs = self._logprobs(ch, prompt_index, output, consumed)
        if ch.echo is not None:
            text, ch.echo = ch.echo + text, None
        tool_calls = None
        if ch.tools is not None:
            text, tool_calls, finish = self._tools(ch, text, finish)
        prompt_lp = None
        if ch.first and self.plan.prompt_logprobs and (finish is not None or text or logprobs):
            prompt_lp = self._formatted_prompt_logprobs(prompt_index)
        if finish is not None:
            ch.done = True
            self._open -= 1
        if not (text or logprobs or tool_calls or finish or prompt_lp):
            return None
        ch.first = False
        return TextChunk(
            text=text, finish_reason=finish,  # type: ignore[arg-type]
            prompt_tokens=sum(self._prompt_tokens),
            completion_tokens=self.completion_tokens,
            cached_tokens=self._cached_total(), index=ch.index, logprobs=logprobs,
            tool_calls=tool_calls, prompt_logprobs=prompt_lp)

    def _cached_total(self) -> int | None:
        known = [c for c in self._cached if c is not None]
        return sum(known) if known else None

    def _logprobs(self, ch: _Choice, prompt_index: int, output: LLMEngineOutput,
                  consumed: int) -> dict[str, Any] | None:
        fmt = ch.logprobs
        if fmt is None:
            return None
        if consumed and output.logprobs is None:
            raise EngineError("the engine sent no logprobs although the request asked")
        ids: Sequence[int] = output.token_ids[:consumed]
        positions: Sequence[Any] = (output.logprobs or [])[:consumed]
        if ch.prompt.echo_only:
            ids, positions = [], []
        if self.plan.endpoint == "chat":
            return {"content": fmt.chat(ids, positions)} if ids else None
        lead: dict[str, Any] | None = None
        if ch.first and self.plan.echo_logprobs:
            raw = self._raw_prompt_lp[prompt_index]
            if raw is None:
                raise EngineError("the engine sent no prompt logprobs for echo")
            lead = fmt.completion(ch.prompt.request.token_ids, echo_positions(raw))
            fmt.reset_context()
        body = fmt.completion(ids, positions) if ids else None
        if lead is None:
            return body
        if body is not None:
            for key in lead:
                lead[key].extend(body[key])
        return lead

    def _tools(self, ch: _Choice, text: str, finish: str | None
               ) -> tuple[str, list[dict[str, Any]] | None, str | None]:
        assert ch.tools is not None
        if self.plan.stream:
            content, calls = ch.tools.delta(text)
            if finish is not None:
                finish = ch.tools.stream_finish_reason(finish)
            return content or "", calls, finish
        ch.text += text
        if finish is None:
            return "", None, None
        content, calls, finish = ch.tools.whole(ch.text, finish)
        return content or "", calls or None, finish

    def _formatted_prompt_logprobs(self, prompt_index: int) -> list[dict[str, Any] | None]:
        done = self._prompt_lp[prompt_index]
        if done is None:
            raw = self._raw_prompt_lp[prompt_index]
            if raw is None:
                raise EngineError("the engine sent no prompt logprobs although the request "
                                  "asked")
            done = prompt_logprobs(self._texts, self.plan.prompts[prompt_index].request.token_ids,
                                   raw)
            self._prompt_lp[prompt_index] = done
        return done


async def assemble_stream(
    assembler: ResponseAssembler,
    streams: Sequence[AsyncIterator[LLMEngineOutput]],
) -> AsyncGenerator[TextChunk, None]:
    """Drive ``assembler`` over one worker stream per prompt.

    Ends after every choice finished; the worker streams are closed then (so an early
    finish, e.g. a stop string, cancels the engine requests). Raises
    :class:`EngineError` if a stream ends before its choices finished. Close this
    generator when stopping early (``contextlib.aclosing``).
    """
    async with _merged(streams) as merged:
        async for prompt_index, output in merged:
            chunk = assembler.process(prompt_index, output)
            if chunk is not None:
                yield chunk
            if assembler.finished:
                return
        raise EngineError("the engine stream ended before every choice finished")


class _merged:
    """``async with _merged(streams) as items``: ``(stream_index, item)`` from all streams.

    One stream is read in the caller's task; several are pumped by one task each into a
    queue. Leaving the block cancels the pumps and closes every stream.
    """

    def __init__(self, streams: Sequence[AsyncIterator[Any]]) -> None:
        self._streams = list(streams)
        self._tasks: list[asyncio.Task[None]] = []
        self._reader: AsyncGenerator[tuple[int, Any], None] | None = None

    async def __aenter__(self) -> AsyncIterator[tuple[int, Any]]:
        if len(self._streams) == 1:
            self._reader = self._one(self._streams[0])
            return self._reader
        queue: asyncio.Queue[tuple[int, Any, BaseException | None, bool]] = asyncio.Queue(64)

        async def pump(i: int, stream: AsyncIterator[Any]) -> None:
            try:
                async for item in stream:
                    await queue.put((i, item, None, False))
                await queue.put((i, None, None, True))
            except Exception as exc:  # handed to the reader, which raises it
                await queue.put((i, None, exc, True))

        self._tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self._streams)]
        self._reader = self._many(queue, len(self._streams))
        return self._reader

    @staticmethod
    async def _one(stream: AsyncIterator[Any]) -> AsyncGenerator[tuple[int, Any], None]:
        async for item in stream:
            yield 0, item

    @staticmethod
    async def _many(queue: asyncio.Queue[tuple[int, Any, BaseException | None, bool]],
                    count: int) -> AsyncGenerator[tuple[int, Any], None]:
        ended = 0
        while ended < count:
            i, item, err, end = await queue.get()
            if err is not None:
                raise err
            if end:
                ended += 1
                continue
            yield i, item

    async def __aexit__(self, *_: object) -> None:
        if self._reader is not None:
            await self._reader.aclose()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for stream in self._streams:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
