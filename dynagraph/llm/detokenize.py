"""Token ids -> streamed text: incremental detokenization, stop strings, finish reasons.

Three layers, each usable alone:

* :class:`IncrementalDetokenizer` turns one token id at a time into the text it adds,
  using ``tokenizers.decoders.DecodeStream`` (Rust; ~1 us per token). A token that ends
  in the middle of a UTF-8 sequence yields ``""`` and its bytes come out with the token
  that completes the character, so no U+FFFD is ever emitted for a split character.
* :class:`StopStringMatcher` is pure text logic: it finds stop strings across chunk
  boundaries and holds back only the tail that could still become a stop string.
* :class:`ResponseDetokenizer` combines them for one request: it consumes
  :class:`LLMEngineOutput` deltas and produces :class:`TextChunk` values with the
  OpenAI finish reason and running usage counts. The Processor owns one per request and
  stops reading from the worker once :attr:`ResponseDetokenizer.finished` is true;
  :func:`detokenize_stream` does exactly that over an async iterator of engine outputs.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

from tokenizers.decoders import DecodeStream

from dynagraph.errors import EngineError
from dynagraph.llm.protocol import LLMEngineOutput, PreprocessedRequest, Resume, TextChunk

if TYPE_CHECKING:
    import tokenizers

    from dynagraph.llm.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Prompt ids used to prime the decoder: enough context for a leading space or a
# character split between the prompt and the first output token, without decoding a
# long prompt again.
PROMPT_CONTEXT_TOKENS = 8

_INVALID_PREFIX = "Invalid prefix encountered"

OpenAIFinishReason = Literal["stop", "length"]


class IncrementalDetokenizer:
    """Decodes a stream of token ids into text deltas. One instance per sequence."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
        request_id: str = "",
    ) -> None:
        self._backend = backend
        self._skip_special = skip_special_tokens
        self._request_id = request_id
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        # A prompt that ends inside a character would make the stream re-emit prompt
        # text; prime only with whole characters (the orphan bytes then decode on their
        # own, as U+FFFD: the one case where it can appear).
        while context and backend.decode(context, skip_special_tokens=skip_special_tokens).endswith(
            "\ufffd"
        ):
            context.pop()
        self._stream = DecodeStream(ids=context or None, skip_special_tokens=skip_special_tokens)

    def step(self, token_id: int) -> str:
        """Return the text ``token_id`` completes (``""`` if none yet)."""
        try:
            text = self._stream.step(self._backend, token_id)
        except Exception as exc:
            if not str(exc).startswith(_INVALID_PREFIX):
                raise
            # A tokenizer whose decode is not prefix-monotonic broke the stream's state
            # (seen by vLLM, issue 17448): restart from this token.
            log.warning("request %s: resetting decode stream (%s)", self._request_id, exc)
            self._stream = DecodeStream(skip_special_tokens=self._skip_special)
            text = self._stream.step(self._backend, token_id)
        return text or ""


class StopStringMatcher:
    """Finds the earliest stop string in streamed text, holding back possible prefixes.

    :meth:`feed` returns the text that is safe to emit. Text that might be the start of a
    stop string is held until the next chunk disambiguates it; on a match, the text
    before the stop string is returned and the stop string itself is dropped. With
    ``include`` (``include_stop_str_in_output``) nothing is held back and the text up to
    the end of the stop string is returned.
    """

    def __init__(self, stops: Sequence[str], *, include: bool = False) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self._include = include
        self._tail = ""
        self._stops = tuple(stops)
        self._prefixes = frozenset(s[:i] for s in self._stops for i in range(1, len(s)))
        self._max_hold = max((len(s) - 1 for s in self._stops), default=0)
        self._held = ""
        self.matched: str | None = None

    @property
    def held(self) -> str:
        """Text received but not yet emitted."""
        return self._held

    def feed(self, text: str) -> tuple[str, bool]:
        """Add ``text``; return ``(safe_text, matched)``. Feeding after a match is an error."""
        assert self.matched is None, "feed() after a stop string matched"
        if self._include:
            return self._feed_including(text)
        buf = self._held + text
        best_at = -1
        for stop in self._stops:
            at = buf.find(stop)
            if at != -1 and (best_at == -1 or at < best_at):
                best_at, self.matched = at, stop
        if best_at != -1:
            self._held = ""
            return buf[:best_at], True
        keep = min(len(buf), self._max_hold)
        while keep and buf[len(buf) - keep :] not in self._prefixes:
            keep -= 1
        cut = len(buf) - keep
        self._held = buf[cut:]
        return buf[:cut], False

    def _feed_including(self, text: str) -> tuple[str, bool]:
        buf = self._tail + text
        best_end = -1
        for stop in self._stops:
            at = buf.find(stop)
            if at != -1 and (best_end == -1 or at + len(stop) < best_end):
                best_end, self.matched = at + len(stop), stop
        if best_end != -1:
            return buf[len(self._tail):best_end], True
        self._tail = buf[len(buf) - min(len(buf), self._max_hold):]
        return text, False

    def flush(self) -> str:
        """Release held text (the sequence ended without completing a stop string)."""
        held, self._held = self._held, ""
        return held


def to_openai_finish_reason(reason: str) -> OpenAIFinishReason:
    """Map an engine finish reason to OpenAI's. ``abort``/``error`` raise EngineError."""
    if reason == "stop":
        return "stop"
    if reason == "length":
        return "length"
    raise EngineError(f"the engine ended the request with finish reason {reason!r}")


class ResponseDetokenizer:
    """Per-request post-processing: engine token deltas in, OpenAI text chunks out.

    Called by the Processor for each :class:`LLMEngineOutput` of one request, in order.
    Pure and synchronous; raises :class:`EngineError` for an engine-side failure. Each
    chunk carries the token ids it completes (``TextChunk.token_ids``: every id consumed
    since the previous chunk), so :meth:`resume` can rebuild this state elsewhere.
    """

    def __init__(self, tokenizer: Tokenizer, request: PreprocessedRequest, *,
                 include_stop_str: bool = False) -> None:
        self._detok = IncrementalDetokenizer(
            tokenizer.backend,
            prompt_token_ids=request.token_ids,
            skip_special_tokens=request.skip_special_tokens,
            request_id=request.request_id,
        )
        self._stops = (StopStringMatcher(request.stop, include=include_stop_str)
                       if request.stop else None)
        self._max_tokens = request.sampling.max_tokens
        self.prompt_tokens = len(request.token_ids)
        self.cached_tokens: int | None = None
        self.completion_tokens = 0
        self.finish_reason: OpenAIFinishReason | None = None
        self._pending: list[int] = []  # consumed since the last chunk

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def resume(self, resume: Resume) -> None:
        """Continue a request whose client already has the text of ``resume.token_ids``
        (another Processor sent it): the state becomes what it was when that text was
        sent (the decoder's, the stop strings' held-back text, the counts), and nothing
        is emitted for those ids. ``EngineError`` if they already finish the request."""
        self.process(LLMEngineOutput(token_ids=list(resume.token_ids),
                                     prompt_tokens=resume.prompt_tokens,
                                     cached_tokens=resume.cached_tokens))
        if self.finished:
            raise EngineError("the request had already finished: nothing to resume")
        self._pending = []

    def process(self, output: LLMEngineOutput) -> TextChunk | None:
        """Consume one engine output; return the chunk to send, or None if nothing is new.

        Tokens that arrive after the request finished (a stop string matched, or
        ``max_tokens`` was reached) are ignored.
        """
        if self.finish_reason is not None:
            return None
        if output.finish_reason == "error" or output.error is not None:
            raise EngineError(output.error or "the engine failed the request")
        if output.prompt_tokens is not None:
            self.prompt_tokens = output.prompt_tokens
        if output.cached_tokens is not None:
            self.cached_tokens = output.cached_tokens

        ids = output.token_ids
        # With "stop" the last id is EOS / a stop token id: counted, but not text.
        last_text_index = len(ids) - 1 if output.finish_reason == "stop" else len(ids)
        parts: list[str] = []
        finish: OpenAIFinishReason | None = None
        consumed = 0
        for index, token_id in enumerate(ids):
            self.completion_tokens += 1
            consumed += 1
            if index == last_text_index:
                break
            piece = self._detok.step(token_id)
            if piece:
                if self._stops is None:
                    parts.append(piece)
                else:
                    safe, matched = self._stops.feed(piece)
                    parts.append(safe)
                    if matched:
                        finish = "stop"
                        break
            if self.completion_tokens >= self._max_tokens:
                break

        if finish is None:
            if output.finish_reason is not None:
                finish = to_openai_finish_reason(output.finish_reason)
            elif self.completion_tokens >= self._max_tokens:
                finish = "length"
            if finish is not None and self._stops is not None:
                parts.append(self._stops.flush())

        self._pending.extend(ids[:consumed])
        text = "".join(parts)
        if not text and finish is None:
            return None
        self.finish_reason = finish
        token_ids, self._pending = self._pending, []
        return TextChunk(
            text=text,
            finish_reason=finish,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
            token_ids=token_ids,
        )


async def detokenize_stream(
    detok: ResponseDetokenizer,
    outputs: AsyncIterator[LLMEngineOutput],
) -> AsyncGenerator[TextChunk, None]:
    """Drive ``detok`` over a worker's output stream.

    Yields the text chunks; the last one has ``finish_reason`` set. ``outputs`` is
    closed before that last chunk is yielded (so a consumer that stops at the finish
    reason leaves nothing open); an early finish (a stop string matched, or
    ``max_tokens`` reached) thereby cancels the engine request. It is also closed if
    the consumer closes this generator. Raises :class:`EngineError` if ``outputs`` ends
    without a finish reason. Consumers should close this generator when they stop early
    (``contextlib.aclosing``): ``async for`` alone does not.
    """
    try:
        async for output in outputs:
            chunk = detok.process(output)
            if detok.finished:
                await _aclose(outputs)
                if chunk is not None:
                    yield chunk
                return
            if chunk is not None:
                yield chunk
        raise EngineError("the engine stream ended without a finish reason")
    finally:
        await _aclose(outputs)


async def _aclose(stream: AsyncIterator[Any]) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()
