"""The tier's size limit (``kv-offload-dir-gib``): oldest written files go first."""

from __future__ import annotations

import asyncio
import fcntl
import os
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from dynagraph.llm.kv.events.relay import KvEventFeed
from dynagraph.llm.kv.offload.tier_trim import (
    LOCK_NAME,
    TierJanitor,
    TierTrimmer,
    TrimResult,
    block_hash_of,
    tier_janitor,
)
from dynagraph.llm.router.hashing import external_hash

BLOCK = 1000


def write_block(root: Path, digest: bytes, age_s: int, size: int = BLOCK) -> Path:
    """A block file as vLLM's FileMapper names it, written ``age_s`` seconds ago."""
    h = digest.hex()
    path = root / "none" / "tiny_abc_r0" / h[:3] / f"{h[3:5]}_g0" / f"{h}.bin"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"k" * size)
    t = 1_700_000_000 - age_s
    os.utime(path, (t, t))
    return path


def digest(i: int) -> bytes:
    return bytes([i]) * 32


def test_a_file_name_gives_the_routers_hash_of_its_block() -> None:
    d = bytes(range(32))
    assert block_hash_of(f"{d.hex()}.bin") == external_hash(d)
    for other in ("config.json", f"{d.hex()}.bin.tmp123", "abc.bin", f"{'zz' * 32}.bin"):
        assert block_hash_of(other) is None


def test_under_the_limit_nothing_is_deleted(tmp_path: Path) -> None:
    paths = [write_block(tmp_path, digest(i), age_s=i) for i in range(1, 4)]
    result = TierTrimmer(tmp_path, 3 * BLOCK).trim()
    assert result == TrimResult(bytes_before=3 * BLOCK, bytes_after=3 * BLOCK)
    assert all(p.exists() for p in paths)


def test_over_the_limit_the_oldest_written_go_until_low_water(tmp_path: Path) -> None:
    ages = {i: 10 * i for i in range(1, 11)}  # block 10 is the oldest
    paths = {i: write_block(tmp_path, digest(i), age_s=a) for i, a in ages.items()}
    (tmp_path / "none" / "tiny_abc_r0" / "config.json").write_text("{}")  # never counted
    result = TierTrimmer(tmp_path, 8 * BLOCK + 1, low_water=0.75).trim()
    # 10 blocks > limit: delete oldest until <= 6,000 bytes (0.75 of 8,001)
    assert result.removed == [external_hash(digest(i)) for i in (10, 9, 8, 7)]
    assert (result.bytes_before, result.bytes_after) == (10 * BLOCK, 6 * BLOCK)
    assert {i for i, p in paths.items() if p.exists()} == {1, 2, 3, 4, 5, 6}
    assert (tmp_path / "none" / "tiny_abc_r0" / "config.json").exists()
    assert TierTrimmer(tmp_path, 8 * BLOCK + 1).trim().removed == []  # fits now


def test_workers_sharing_a_tier_take_turns(tmp_path: Path) -> None:
    write_block(tmp_path, digest(1), age_s=1)
    write_block(tmp_path, digest(2), age_s=2)
    fd = os.open(tmp_path / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another worker is trimming
        assert TierTrimmer(tmp_path, BLOCK * 3 // 2).trim() == TrimResult(skipped=True)
    finally:
        os.close(fd)
    assert TierTrimmer(tmp_path, BLOCK * 3 // 2).trim().removed == [external_hash(digest(2))]


def test_a_tier_not_made_yet_and_bad_limits(tmp_path: Path) -> None:
    assert TierTrimmer(tmp_path / "missing", BLOCK).trim() == TrimResult()
    with pytest.raises(ValueError, match="positive"):
        TierTrimmer(tmp_path, 0)
    with pytest.raises(ValueError, match="low_water"):
        TierTrimmer(tmp_path, BLOCK, low_water=0)


@pytest.mark.asyncio
async def test_the_janitor_reports_each_pass_and_tells_the_router(tmp_path: Path) -> None:
    write_block(tmp_path, digest(1), age_s=1)
    write_block(tmp_path, digest(2), age_s=2)
    registry = CollectorRegistry()
    feed = KvEventFeed()
    sub = feed.subscribe()
    assert tier_janitor(str(tmp_path), 0, worker="w", registry=registry) is None
    assert tier_janitor(None, 1.0, worker="w", registry=registry) is None
    janitor = tier_janitor(str(tmp_path), 1.5 * BLOCK / 2**30, worker="w", registry=registry,
                           feed=feed)
    assert janitor is not None
    janitor._interval = 0.01
    janitor.start()
    try:
        first = await asyncio.wait_for(sub._queue.get(), 5)
        assert first.snapshot
        removal = await asyncio.wait_for(sub._queue.get(), 5)
        assert removal.tiered_removed == [external_hash(digest(2))]
    finally:
        await janitor.stop()
    sample = registry.get_sample_value
    assert sample("dynamo_worker_kv_tier_trimmed_blocks_total", {"worker": "w"}) == 1
    assert sample("dynamo_worker_kv_tier_bytes", {"worker": "w"}) == BLOCK


@pytest.mark.asyncio
async def test_the_janitor_goes_on_after_a_failed_pass(tmp_path: Path) -> None:
    calls: list[int] = []

    class Flaky(TierTrimmer):
        def trim(self) -> TrimResult:
            calls.append(1)
            if len(calls) == 1:
                raise PermissionError("read-only file system")
            return TrimResult()

    passed = asyncio.Event()
    janitor = TierJanitor(Flaky(tmp_path, BLOCK), lambda _: passed.set(), interval=0.01)
    janitor.start()
    try:
        await asyncio.wait_for(passed.wait(), 5)
    finally:
        await janitor.stop()
    assert len(calls) >= 2
