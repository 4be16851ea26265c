from __future__ import annotations

import pytest

from dynagraph.errors import ConfigError
from dynagraph.llm.router.hashing import (
    DEFAULT_NONE_HASH_SEED,
    BlockHasher,
    external_hash,
    seed_from_env,
)

# Golden values computed with vLLM 0.32's own hash_block_tokens + maybe_convert_block_hash
# (block size 32) -- tests/vllm_router checks the same against a live engine.
TOKENS = list(range(1, 101)) + [70000, 5, 300000] * 10  # 130 tokens: 4 full blocks
GOLDEN = {
    ("sha256", DEFAULT_NONE_HASH_SEED): [
        11290800355336220572,
        11189021207153552290,
        5777041184176187823,
        13082192139513834811,
    ],
    ("sha256_cbor", DEFAULT_NONE_HASH_SEED): [
        12204319907483556814,
        4209074748214054702,
        7302816728813537907,
        6078536134031220234,
    ],
    ("sha256", "42"): [
        14700471032653791925,
        3349333088389298850,
        1034116827605147802,
        8542850540771480370,
    ],
}


@pytest.mark.parametrize(("algo", "seed"), list(GOLDEN))
def test_block_hashes_match_vllm(algo: str, seed: str) -> None:
    hasher = BlockHasher(32, algo, seed)  # type: ignore[arg-type]
    assert hasher.block_hashes(TOKENS) == GOLDEN[(algo, seed)]


def test_partial_block_is_ignored_and_prefixes_agree() -> None:
    hasher = BlockHasher(32)
    full = hasher.block_hashes(TOKENS)
    assert hasher.block_hashes(TOKENS[:31]) == []
    assert hasher.block_hashes(TOKENS[:64]) == full[:2]
    assert hasher.block_hashes(TOKENS[:95]) == full[:2]
    assert hasher.num_full_blocks(len(TOKENS)) == 4


def test_chaining_from_a_parent_digest() -> None:
    hasher = BlockHasher(32)
    digests = hasher.digests(TOKENS)
    assert (
        hasher.block_hashes(TOKENS[64:128], parent=digests[1]) == hasher.block_hashes(TOKENS)[2:4]
    )
    assert hasher.hash_block(digests[0], TOKENS[32:64]) == digests[1]
    assert hasher.hash_block(None, TOKENS[:32]) == digests[0]


def test_same_tokens_different_prefix_differ() -> None:
    hasher = BlockHasher(32)
    a = hasher.block_hashes([1] * 32 + [2] * 32)
    b = hasher.block_hashes([3] * 32 + [2] * 32)
    assert a[1] != b[1]


def test_external_hash_forms() -> None:
    digest = BlockHasher(32).digests(TOKENS)[0]
    assert external_hash(digest) == GOLDEN[("sha256", DEFAULT_NONE_HASH_SEED)][0]
    assert external_hash(5) == 5
    assert external_hash(-1) == (1 << 64) - 1


def test_seed_from_env() -> None:
    assert seed_from_env({}) == DEFAULT_NONE_HASH_SEED
    assert seed_from_env({"PYTHONHASHSEED": "0"}) == "0"


def test_bad_config() -> None:
    with pytest.raises(ConfigError, match="xxhash"):
        BlockHasher(32, "xxhash")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="block_size"):
        BlockHasher(0)


SALTED = [2568054554326681913, 3495638639682938195, 7760729844423388877, 13950834164718238296]
"""vLLM 0.32's hashes of TOKENS for a request with cache_salt "tenant-salt-1" (the salt is
an extra key of the first block only)."""


def test_a_cache_salt_changes_every_hash_as_vllm_does() -> None:
    hasher = BlockHasher(32)
    salted = hasher.block_hashes(TOKENS, cache_salt="tenant-salt-1")
    assert salted == SALTED
    assert not set(salted) & set(hasher.block_hashes(TOKENS))
    assert hasher.block_hashes(TOKENS, cache_salt="") == hasher.block_hashes(TOKENS)


@pytest.mark.parametrize(("algo", "seed"), list(GOLDEN))
def test_a_cached_hasher_gives_the_same_hashes_and_hashes_a_known_prefix_once(
        algo: str, seed: str) -> None:
    hasher = BlockHasher(32, algo, seed, cached_blocks=6)  # type: ignore[arg-type]
    calls: list[object] = []
    fn = hasher._fn
    object.__setattr__(hasher, "_fn", lambda x: calls.append(x) or fn(x))
    assert hasher.block_hashes(TOKENS) == GOLDEN[(algo, seed)]
    assert len(calls) == 4
    other = TOKENS[:64] + [7] * 64  # the first two blocks known, two new
    assert hasher.block_hashes(other) == BlockHasher(32, algo, seed).block_hashes(other)  # type: ignore[arg-type]
    assert len(calls) == 6
    salted = hasher.block_hashes(TOKENS, cache_salt="t")  # salt is part of the key
    assert salted == BlockHasher(32, algo, seed).block_hashes(TOKENS, cache_salt="t")  # type: ignore[arg-type]
    assert len(calls) == 10
    assert len(hasher._cache) == 6  # bounded: the oldest went
    assert hasher.block_hashes(TOKENS) == GOLDEN[(algo, seed)]
