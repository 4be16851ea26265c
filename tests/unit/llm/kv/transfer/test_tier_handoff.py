"""The same-host KV hand-off through the shared tier (``kv-transport``), without services:
the decode worker's offer, the prefill worker's choice, the block files it waits for."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from dynagraph.llm.disagg.coordinator import PrefillResult
from dynagraph.llm.disagg.keys import DecodeDisaggKeys
from dynagraph.llm.disagg.prefill import PrefillJobHandler
from dynagraph.llm.kv.transfer.tier_handoff import (
    TIER_KEY,
    accepts,
    block_paths,
    blocks_present,
    is_shm,
    offer,
    tier_dir,
    wait_for_blocks,
)
from dynagraph.llm.router.hashing import BlockHasher
from dynagraph.runtime.addresses import host_id
from dynagraph.runtime.queue import MemoryPrefillQueue
from tests.unit.llm.test_remote_prefill import FakeEngine, coordinator, plan_served, wire

HASHER = BlockHasher(16)


def write_blocks(tier: str, digests: list[bytes], layout: str = "m_0123456789ab_r0") -> None:
    for path in block_paths(f"{tier}/{layout}", digests):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_bytes(b"kv")


def test_the_offer_names_this_host_and_the_codecs_directory(tmp_path: Path) -> None:
    assert offer(None, "none") is None
    mine = offer(str(tmp_path), "int8")
    assert mine == {"host": host_id(), "dir": str(tmp_path / "int8")}
    assert tier_dir("rel/kv", "pkg.mod:Codec").endswith("/rel/kv/pkg.mod-Codec")
    assert accepts(mine, {TIER_KEY: dict(mine)})
    assert not accepts(mine, {TIER_KEY: {**mine, "host": "another-boot-id"}})
    assert not accepts(mine, {TIER_KEY: {**mine, "dir": str(tmp_path / "none")}})
    assert not accepts(mine, {}) and not accepts(None, {TIER_KEY: mine})


def test_block_files_follow_vllms_file_mapper_names(tmp_path: Path) -> None:
    digest = bytes.fromhex("abcdef" + "00" * 29)
    [path] = block_paths("/t/model_x_r0", [digest])
    assert path == f"/t/model_x_r0/abc/de_g0/{digest.hex()}.bin"
    digests = HASHER.digests(list(range(48)))
    assert not blocks_present(str(tmp_path / "missing"), digests)
    write_blocks(str(tmp_path), digests[:2])
    assert not blocks_present(str(tmp_path), digests)
    write_blocks(str(tmp_path), digests[2:])
    assert blocks_present(str(tmp_path), digests)


async def test_waiting_for_blocks_ends_when_they_arrive_or_at_the_timeout(
        tmp_path: Path) -> None:
    digests = HASHER.digests(list(range(32)))
    present, waited = await wait_for_blocks(str(tmp_path), digests, 0.05)
    assert not present and waited >= 0.05
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, write_blocks, str(tmp_path), digests)
    present, waited = await wait_for_blocks(str(tmp_path), digests, 5.0)
    assert present and 0.04 <= waited < 5.0


class TierEngine(FakeEngine):
    """Its pool writes every full block of a local prefill to the tier, a moment later."""

    def __init__(self, tier: str) -> None:
        super().__init__()
        self.tier = tier

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: Any,
                       *, kv_transfer_params: dict[str, Any] | None = None) -> Any:
        async for out in super().generate(request_id, prompt_token_ids, sampling,
                                          kv_transfer_params=kv_transfer_params):
            if kv_transfer_params is None:
                asyncio.get_running_loop().call_later(
                    0.02, write_blocks, self.tier, HASHER.digests(prompt_token_ids))
            yield out


@pytest.mark.parametrize(("decode_offers", "same_tier", "shm"), [
    (True, True, True), (True, False, False), (False, True, False)])
async def test_a_prefill_worker_hands_over_through_the_tier_only_when_both_share_it(
        tmp_path: Path, decode_offers: bool, same_tier: bool, shm: bool) -> None:
    decode_tier = offer(str(tmp_path / "kv"), "none")
    prefill_tier = offer(str(tmp_path / ("kv" if same_tier else "other")), "none")
    assert decode_tier is not None and prefill_tier is not None
    q = MemoryPrefillQueue()
    await q.connect()
    c = coordinator(q, engine_params={TIER_KEY: decode_tier} if decode_offers else {})
    engine = TierEngine(prefill_tier["dir"])
    sent: list[PrefillResult] = []
    handler = PrefillJobHandler(engine, wire(c, sent), tier=prefill_tier, hasher=HASHER)
    plan = await plan_served(q, handler, c, list(range(200)))
    assert plan.remote
    assert is_shm(plan.kv_transfer_params) is shm
    if shm:
        assert engine.calls[0][2] is None  # a local prefill: no NIXL remote-decode params
        assert plan.kv_transfer_params is not None
        assert plan.kv_transfer_params["blocks"] == 12 and plan.kv_transfer_params["present"]
        assert blocks_present(decode_tier["dir"], HASHER.digests(list(range(200))))
    else:
        assert engine.calls[0][2] == {"do_remote_decode": True}


def test_kv_transport_tier_needs_a_tier_and_shm_does_not() -> None:
    with pytest.raises(ValueError, match="kv-transport tier.*kv-offload-dir"):
        DecodeDisaggKeys.model_validate({"kv-transport": "tier"})
    for transport, shared, tier in (("auto", True, False), ("shm", True, False),
                                    ("nixl", False, False)):
        keys = DecodeDisaggKeys.model_validate({"kv-transport": transport})
        assert (keys.shared_kv_memory, keys.through_tier) == (shared, tier), transport
