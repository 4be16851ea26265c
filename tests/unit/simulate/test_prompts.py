"""Prompt tokens from trace block ids: shared ids share tokens and the engine's digests."""

from __future__ import annotations

from dynagraph.llm.router.hashing import BlockHasher
from dynagraph.simulate.prompts import PromptBuilder, block_tokens, shared_ids
from dynagraph.simulate.trace import TraceRequest

HASHER = BlockHasher(16)


def req(index: int, n: int, ids: tuple[int, ...]) -> TraceRequest:
    return TraceRequest(index, 0.0, n, 1, ids)


def test_block_tokens_are_deterministic_distinct_and_in_the_vocabulary() -> None:
    a = block_tokens(7, 64, 1000)
    assert a == block_tokens(7, 64, 1000) and len(a) == 64
    assert all(0 <= t < 1000 for t in a)
    assert a[:16] != block_tokens(8, 64, 1000)[:16]
    assert max(block_tokens(7, 64, 1 << 17)) < 1 << 16


def test_prompts_share_tokens_and_digests_where_the_trace_shares_ids() -> None:
    reqs = [req(0, 150, (1, 2, 3)), req(1, 100, (1, 2)), req(2, 130, (1, 4, 5)),
            req(3, 64, (6,))]
    builder = PromptBuilder(HASHER, trace_block_size=64, vocab_size=5000,
                            shared=shared_ids(reqs))
    prompts = [builder.prompt(r) for r in reqs]
    for r, p in zip(reqs, prompts, strict=True):
        assert len(p.token_ids) == r.input_length
        assert p.digests == HASHER.digests(p.token_ids)  # the hasher's own, memo or not
    assert prompts[0].token_ids[:100] == prompts[1].token_ids
    assert prompts[0].token_ids[:64] == prompts[2].token_ids[:64]
    assert prompts[0].token_ids[64:80] != prompts[2].token_ids[64:80]
    assert prompts[0].digests[:4] == prompts[2].digests[:4]
    assert not builder._memo  # every shared id's digests dropped after its last use


def test_unaligned_block_sizes_hash_the_whole_prompt() -> None:
    builder = PromptBuilder(BlockHasher(48), trace_block_size=64, vocab_size=5000)
    p = builder.prompt(req(0, 150, (1, 2, 3)))
    assert p.digests == BlockHasher(48).digests(p.token_ids) and len(p.digests) == 3
