from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from dynagraph.errors import EngineError
from dynagraph.llm.detokenize import (
    IncrementalDetokenizer,
    ResponseDetokenizer,
    StopStringMatcher,
    detokenize_stream,
    to_openai_finish_reason,
)
from dynagraph.llm.protocol import (
    LLMEngineOutput,
    PreprocessedRequest,
    Resume,
    SamplingParams,
    TextChunk,
)
from dynagraph.llm.tokenizer import Tokenizer

MULTIBYTE = "Café crème 日本 🙂🚀👍🏽 déjà vu 日本語"


def ids_of(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def make_request(
    tok: Tokenizer, *, stop: list[str] | None = None, max_tokens: int = 1000
) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id="r1",
        token_ids=tok.encode_chat([{"role": "user", "content": "hi 日本"}]),
        sampling=SamplingParams(max_tokens=max_tokens),
        eos_token_ids=list(tok.eos_token_ids),
        stop=stop or [],
    )


def run(
    tok: Tokenizer, outputs: list[LLMEngineOutput], **kw: object
) -> tuple[list[TextChunk], ResponseDetokenizer]:
    detok = ResponseDetokenizer(tok, make_request(tok, **kw))  # type: ignore[arg-type]
    chunks = [c for out in outputs if (c := detok.process(out)) is not None]
    return chunks, detok


def one_token_each(ids: list[int], finish: str | None = "length") -> list[LLMEngineOutput]:
    outs = [LLMEngineOutput(token_ids=[i]) for i in ids]
    outs[-1].finish_reason = finish  # type: ignore[assignment]
    return outs


# --- IncrementalDetokenizer ------------------------------------------------


def test_multibyte_split_tokens_never_emit_replacement_char(tok: Tokenizer) -> None:
    ids = ids_of(tok, MULTIBYTE)
    # The fixture's vocabulary splits some characters across tokens; make sure we test that.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok.backend)
    pieces = [detok.step(i) for i in ids]
    assert "" in pieces
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == MULTIBYTE


def test_prompt_context_keeps_leading_space(tok: Tokenizer) -> None:
    prompt = ids_of(tok, "Hello")
    out = ids_of(tok, " world")
    detok = IncrementalDetokenizer(tok.backend, prompt_token_ids=prompt)
    assert "".join(detok.step(i) for i in out) == " world"


def test_prompt_ending_mid_character_is_not_re_emitted(tok: Tokenizer) -> None:
    prompt = ids_of(tok, "🙂🚀👍🏽日本語")
    out = ids_of(tok, " Café 🚀 日本")
    for cut in range(1, len(prompt) + 1):
        detok = IncrementalDetokenizer(tok.backend, prompt_token_ids=prompt[:cut])
        text = "".join(detok.step(i) for i in out)
        assert text.endswith(" Café 🚀 日本") and "🙂" not in text, (cut, text)


def test_special_tokens_skipped_or_kept(tok: Tokenizer) -> None:
    eos = tok.eos_token_ids[0]
    assert IncrementalDetokenizer(tok.backend).step(eos) == ""
    assert IncrementalDetokenizer(tok.backend, skip_special_tokens=False).step(eos) == "</s>"


# --- StopStringMatcher -----------------------------------------------------


def test_stop_matcher_holds_back_possible_prefix() -> None:
    m = StopStringMatcher(["###"])
    assert m.feed("abc#") == ("abc", False)
    assert m.held == "#"
    assert m.feed("#x") == ("##x", False)
    assert m.held == ""
    assert m.feed("a##") == ("a", False)
    assert m.feed("#tail") == ("", True)
    assert m.matched == "###"


def test_stop_matcher_emits_nothing_for_non_prefix_text() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.feed("hello S") == ("hello ", False)
    assert m.feed("x") == ("Sx", False)
    assert m.flush() == ""


def test_stop_matcher_earliest_match_wins() -> None:
    m = StopStringMatcher(["cd", "b"])
    assert m.feed("abcd") == ("a", True)
    assert m.matched == "b"


def test_stop_matcher_flush_returns_held_text() -> None:
    m = StopStringMatcher(["END"])
    assert m.feed("the EN") == ("the ", False)
    assert m.flush() == "EN"


def test_stop_matcher_overlapping_stops() -> None:
    m = StopStringMatcher(["abab", "abc"])
    assert m.feed("xaba") == ("x", False)  # "aba" may still become "abab"
    assert m.feed("c") == ("abac", False)  # neither stop string can start in "abac"
    assert m.feed("xab") == ("x", False)
    assert m.feed("abc") == ("", True)  # "ababc": "abab" starts first
    assert m.matched == "abab"
    m = StopStringMatcher(["abc"])
    assert m.feed("aab") == ("a", False)
    assert m.feed("c") == ("", True)


def test_stop_matcher_rejects_empty() -> None:
    with pytest.raises(ValueError):
        StopStringMatcher([""])


# --- ResponseDetokenizer ---------------------------------------------------


def test_full_text_and_usage_one_token_per_output(tok: Tokenizer) -> None:
    ids = ids_of(tok, MULTIBYTE)
    chunks, detok = run(tok, one_token_each(ids))
    assert "".join(c.text for c in chunks) == MULTIBYTE
    assert all("\ufffd" not in c.text for c in chunks)
    assert all(c.text for c in chunks[:-1])  # no empty chunks mid-stream
    last = chunks[-1]
    assert last.finish_reason == "length"
    assert last.completion_tokens == len(ids)
    assert last.prompt_tokens == len(make_request(tok).token_ids)
    assert detok.finished


def test_eos_counts_as_a_token_but_not_text(tok: Tokenizer) -> None:
    ids = ids_of(tok, "Hello world") + [tok.eos_token_ids[0]]
    outs = [LLMEngineOutput(token_ids=ids[:-2], prompt_tokens=9, cached_tokens=4)]
    outs.append(LLMEngineOutput(token_ids=ids[-2:], finish_reason="stop"))
    chunks, _ = run(tok, outs)
    assert "".join(c.text for c in chunks) == "Hello world"
    assert chunks[-1].finish_reason == "stop"
    assert chunks[-1].completion_tokens == len(ids)
    assert chunks[-1].prompt_tokens == 9 and chunks[-1].cached_tokens == 4


def test_non_special_stop_token_id_is_not_text(tok: Tokenizer) -> None:
    ids = ids_of(tok, "Hello!")
    chunks, _ = run(tok, one_token_each(ids, finish="stop"))
    assert "".join(c.text for c in chunks) == tok.decode(ids[:-1])


@pytest.mark.parametrize("stop", ["quick", "ck br", " ", "o"])
def test_stop_string_across_token_boundaries(tok: Tokenizer, stop: str) -> None:
    text = "Hello world! The quick brown fox"
    ids = ids_of(tok, text)
    chunks, detok = run(tok, one_token_each(ids), stop=[stop])
    out = "".join(c.text for c in chunks)
    assert out == text[: text.index(stop)]
    assert chunks[-1].finish_reason == "stop"
    # Counted up to the token that completed the stop string, not beyond.
    assert detok.completion_tokens < len(ids) or text.endswith(stop)
    assert detok.process(LLMEngineOutput(token_ids=[ids[0]])) is None  # ignored after finish


def test_stop_string_hold_back_is_released_at_the_end(tok: Tokenizer) -> None:
    text = "the lazy dog ###"
    ids = ids_of(tok, text)
    chunks, _ = run(tok, one_token_each(ids), stop=["####"])
    assert "".join(c.text for c in chunks) == text
    assert chunks[-1].finish_reason == "length"


def test_stop_string_inside_one_multi_token_output(tok: Tokenizer) -> None:
    text = "Hello world! The quick brown fox"
    ids = ids_of(tok, text)
    chunks, detok = run(tok, [LLMEngineOutput(token_ids=ids)], stop=["The"])
    assert [c.text for c in chunks] == ["Hello world! "]
    assert chunks[0].finish_reason == "stop"
    assert detok.completion_tokens < len(ids)


def test_multibyte_stop_string(tok: Tokenizer) -> None:
    chunks, _ = run(tok, one_token_each(ids_of(tok, MULTIBYTE)), stop=["🚀"])
    assert "".join(c.text for c in chunks) == "Café crème 日本 🙂"


def test_max_tokens_enforced_by_processor(tok: Tokenizer) -> None:
    ids = ids_of(tok, "Hello world! The quick brown fox")
    chunks, detok = run(tok, [LLMEngineOutput(token_ids=ids)], max_tokens=3)
    assert chunks[-1].finish_reason == "length"
    assert detok.completion_tokens == 3
    assert "".join(c.text for c in chunks) == tok.decode(ids[:3])


def test_engine_error_and_abort_raise(tok: Tokenizer) -> None:
    detok = ResponseDetokenizer(tok, make_request(tok))
    with pytest.raises(EngineError, match="out of memory"):
        detok.process(LLMEngineOutput(token_ids=[], finish_reason="error", error="out of memory"))
    detok = ResponseDetokenizer(tok, make_request(tok))
    with pytest.raises(EngineError, match="abort"):
        detok.process(LLMEngineOutput(token_ids=[5], finish_reason="abort"))


def test_finish_reason_mapping() -> None:
    assert to_openai_finish_reason("stop") == "stop"
    assert to_openai_finish_reason("length") == "length"
    with pytest.raises(EngineError):
        to_openai_finish_reason("abort")


def test_empty_output_yields_nothing(tok: Tokenizer) -> None:
    detok = ResponseDetokenizer(tok, make_request(tok))
    assert detok.process(LLMEngineOutput(token_ids=[], prompt_tokens=3)) is None
    assert detok.prompt_tokens == 3


class EngineStream:
    """An engine output stream that records whether it was closed early."""

    def __init__(self, outputs: list[LLMEngineOutput]) -> None:
        self.outputs = outputs
        self.served = 0
        self.closed = False

    async def gen(self) -> AsyncIterator[LLMEngineOutput]:
        try:
            for out in self.outputs:
                self.served += 1
                await asyncio.sleep(0)
                yield out
        finally:
            self.closed = True


async def test_detokenize_stream_stops_reading_at_a_stop_string(tok: Tokenizer) -> None:
    ids = ids_of(tok, "Hello world! The quick brown fox")
    engine = EngineStream(one_token_each(ids))
    detok = ResponseDetokenizer(tok, make_request(tok, stop=["The"]))
    chunks = [c async for c in detokenize_stream(detok, engine.gen())]
    assert "".join(c.text for c in chunks) == "Hello world! "
    assert chunks[-1].finish_reason == "stop"
    assert engine.closed and engine.served < len(ids)


async def test_detokenize_stream_without_finish_is_an_error(tok: Tokenizer) -> None:
    engine = EngineStream([LLMEngineOutput(token_ids=ids_of(tok, "Hello"))])
    detok = ResponseDetokenizer(tok, make_request(tok))
    with pytest.raises(EngineError, match="without a finish reason"):
        async for _ in detokenize_stream(detok, engine.gen()):
            pass
    assert engine.closed


async def test_detokenize_stream_closed_by_consumer_closes_engine(tok: Tokenizer) -> None:
    engine = EngineStream(one_token_each(ids_of(tok, "Hello world! The quick brown fox")))
    stream = detokenize_stream(ResponseDetokenizer(tok, make_request(tok)), engine.gen())
    assert (await anext(stream)).text
    await stream.aclose()
    assert engine.closed


async def test_detokenize_stream_closes_engine_before_the_final_chunk(tok: Tokenizer) -> None:
    engine = EngineStream(one_token_each(ids_of(tok, "Hello world! The quick"), finish="length"))
    stream = detokenize_stream(ResponseDetokenizer(tok, make_request(tok)), engine.gen())
    async for chunk in stream:
        if chunk.finish_reason is not None:
            assert engine.closed  # already closed when the last chunk arrives
            break
    else:
        raise AssertionError("no final chunk")


# --- resuming on another Processor --------------------------------------------


@pytest.mark.parametrize("stop", [[], ["vu 日"], ["🚀👍"]])
@pytest.mark.parametrize("cut", [1, 3, 7, 12])
def test_a_resumed_detokenizer_continues_the_text_exactly(tok: Tokenizer, stop: list[str],
                                                         cut: int) -> None:
    """Chunks carry the ids they complete; a detokenizer resumed from the ids of the chunks
    a client got goes on with exactly the text and counts of the uninterrupted one (split
    characters and held-back stop-string prefixes included)."""
    ids = ids_of(tok, MULTIBYTE)
    outs = [LLMEngineOutput(token_ids=[i], prompt_tokens=11 if n == 0 else None,
                            cached_tokens=4 if n == 0 else None) for n, i in enumerate(ids)]
    outs[-1].finish_reason = "length"
    whole, _ = run(tok, outs, stop=stop)
    assert sum(len(c.token_ids or []) for c in whole) == whole[-1].completion_tokens
    sent = whole[:min(cut, len(whole) - 1)]  # the client got these, then its Processor died
    resumed = ResponseDetokenizer(tok, make_request(tok, stop=stop))
    resumed.resume(Resume(token_ids=[t for c in sent for t in c.token_ids or []],
                          prompt_tokens=sent[-1].prompt_tokens,
                          cached_tokens=sent[-1].cached_tokens))
    done = sum(len(c.token_ids or []) for c in sent)
    rest = [c for out in outs[done:] if (c := resumed.process(
        LLMEngineOutput(token_ids=out.token_ids, finish_reason=out.finish_reason))) is not None]
    assert "".join(c.text for c in sent + rest) == "".join(c.text for c in whole)
    assert (rest[-1].finish_reason, rest[-1].completion_tokens, rest[-1].prompt_tokens,
            rest[-1].cached_tokens) == (whole[-1].finish_reason, whole[-1].completion_tokens,
                                        11, 4)


def test_resuming_a_finished_request_is_an_error(tok: Tokenizer) -> None:
    detok = ResponseDetokenizer(tok, make_request(tok, max_tokens=2))
    with pytest.raises(EngineError, match="already finished"):
        detok.resume(Resume(token_ids=ids_of(tok, "Hello world")[:2], prompt_tokens=3))
