"""KV compressed on the NIXL wire, without vLLM or NIXL: the raw-to-shadow map and the
hand-shake trailer (``wire_shadow``), the codec over memory ranges (``wire_encode``), and
the NIXL agent's stand-in between two engines of one process (``wire_codec``; a fake
agent moves the bytes a READ names)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from dynagraph.llm.kv.codec import Int8
from dynagraph.llm.kv.transfer import wire_codec as wc
from dynagraph.llm.kv.transfer import wire_encode as we
from dynagraph.llm.kv.transfer import wire_shadow as ws
from dynagraph.llm.kv.transfer.nixl_descs import merge_ranges
from tests.support.bad_codec import SignOnly
from tests.support.nixl import FakeNixlAgent

BLOCK = 1024  # bytes of one block of one region (512 16-bit values)


def test_raw_ranges_map_linearly_onto_the_shadow() -> None:
    m = ws.ShadowMap.of([(1 << 20, 8 * BLOCK, 1 << 30), (1 << 22, 4 * BLOCK, 1 << 31)], 66)
    got = m.to_shadow(np.array([(1 << 20) + 3 * BLOCK, (1 << 22) + BLOCK], np.uint64),
                      np.array([BLOCK, 2 * BLOCK], np.uint64))
    assert got is not None
    addrs, lens = got
    assert addrs.tolist() == [(1 << 30) + 3 * 8 * 66, (1 << 31) + 8 * 66]
    assert lens.tolist() == [8 * 66, 16 * 66]
    # outside every region, past a region's end, or not on a group boundary: no map
    assert m.to_shadow(np.array([5], np.uint64), np.array([128], np.uint64)) is None
    assert m.to_shadow(np.array([(1 << 20) + 7 * BLOCK], np.uint64),
                       np.array([2 * BLOCK], np.uint64)) is None
    assert m.to_shadow(np.array([(1 << 20) + 64], np.uint64),
                       np.array([128], np.uint64)) is None
    assert ws.ShadowMap.from_info(m.info("int8")).info("x") == m.info("x")


def test_the_trailer_rides_on_nixl_metadata_and_comes_off() -> None:
    md = b"\x00nixl-agent-metadata\xff" * 10
    info = {"codec": "int8", "encoded": 66, "regions": [[1, 2, 3]]}
    sent = ws.add_trailer(md, info)
    assert sent.startswith(md) and ws.split_trailer(sent) == (md, info)
    assert ws.split_trailer(md) == (md, None)  # a peer without one
    assert ws.split_trailer(b"x" + ws.MAGIC) == (b"x" + ws.MAGIC, None)


def test_block_ranges_cover_every_region() -> None:
    addrs, lens = ws.block_ranges([1000, 50_000], [128, 256], [256, 256], [0, 2])
    assert addrs.tolist() == [1000, 1512, 50_000, 50_512]
    assert lens.tolist() == [128, 128, 256, 256]


def test_runs_merge_where_every_side_follows_on() -> None:
    raw = np.array([0, 128, 256, 1024], np.uint64)
    here = np.array([0, 66, 132, 528], np.uint64)
    there = np.array([10, 76, 500, 566], np.uint64)
    merged = merge_ranges(raw, here, there, lens=np.full(4, 128, np.uint64),
                          other_lens=np.full(4, 66, np.uint64))
    assert [m.tolist() for m in merged] == [[0, 256, 1024], [0, 132, 528], [10, 500, 566],
                                            [256, 128, 128], [132, 66, 66]]


def test_encode_and_decode_over_memory_restore_the_values_closely() -> None:
    torch.manual_seed(0)
    kv = torch.randn(4 * 512, dtype=torch.bfloat16)
    raw = kv.view(torch.uint8)
    enc = Int8()
    shadow = torch.zeros(raw.numel() // 128 * 66, dtype=torch.uint8)
    we.encode_into(enc, torch.bfloat16, raw, shadow)
    back = torch.zeros_like(kv)
    we.decode_into(enc, torch.bfloat16, shadow, back.view(torch.uint8))
    err = (back.float() - kv.float()).abs().max().item()
    assert 0 < err < 0.03 * kv.float().abs().max().item()
    again = kv.clone()
    we.roundtrip(enc, torch.bfloat16, again.view(torch.uint8))
    assert torch.equal(again, back)


def engine(name: str, codec: str, blocks: int = 8) -> tuple[wc.CodecNixl, torch.Tensor]:
    """An engine's KV cache (one region of ``blocks`` blocks) registered through the
    stand-in, as vLLM's register_kv_caches does."""
    cache = torch.zeros(blocks * BLOCK // 2, dtype=torch.float16)
    nixl = wc.CodecNixl(FakeNixlAgent(name, moves_bytes=True), codec)
    nixl.dtype = cache.dtype
    reg = nixl.get_reg_descs([(cache.data_ptr(), cache.numel() * 2, 0, "")], "DRAM")
    nixl.register_memory(reg, backends=["UCX"])
    return nixl, cache


def prep(nixl: wc.CodecNixl, agent: str, cache_addr: int, blocks: int = 8) -> Any:
    rows = np.array([[cache_addr + b * BLOCK, BLOCK, 0] for b in range(blocks)], np.uint64)
    return nixl.prep_xfer_dlist(agent, nixl.get_xfer_descs(rows, "DRAM"))


def test_a_read_from_a_peer_of_the_same_codec_moves_encoded_bytes() -> None:
    prefill, p_cache = engine("prefill", "int8")
    decode, d_cache = engine("decode", "int8")
    assert len(prefill._agent.registered) == 2  # the cache and its shadow
    torch.manual_seed(1)
    blocks = p_cache.view(8, BLOCK // 2)
    blocks.copy_(torch.randn(8, BLOCK // 2, dtype=torch.float16))
    # prefill: the request's blocks 2, 3 and 6 go into the shadow after its forward pass
    addrs, lens = ws.block_ranges([p_cache.data_ptr()], [BLOCK], [BLOCK], [2, 3, 6])
    assert prefill.encode(addrs, lens) == 3 * BLOCK
    # the hand-shake carries the shadow's place; NIXL gets its own metadata only
    peer = decode.add_remote_agent(prefill.get_agent_metadata())
    assert peer == "prefill" and decode._agent.remotes == [b"md:prefill"]
    mine = prep(decode, "NIXL_INIT_AGENT", d_cache.data_ptr())
    theirs = prep(decode, peer, p_cache.data_ptr())
    handle = decode.make_prepped_xfer("READ", mine, [0, 1, 5], theirs, [2, 3, 6],
                                      notif_msg=b"req-7")
    assert isinstance(handle, wc.CodecRead)
    assert decode.transfer(handle) == "PROC"
    assert decode.check_xfer_state(handle) == "DONE"
    assert decode._agent.reads == [("encoded", 3 * BLOCK // 128 * 66, b"req-7")]
    got = d_cache.view(8, BLOCK // 2)
    for here, there in ((0, 2), (1, 3), (5, 6)):
        ref = blocks[there].float()
        assert (got[here].float() - ref).abs().max() < 0.02 * ref.abs().max()
    assert not got[[2, 3, 4, 6, 7]].any()
    tele = decode.get_xfer_telemetry(handle)  # the decode's time is the transfer's too
    assert tele.totalBytes == 3 * BLOCK // 128 * 66 and tele.xferDuration > 3.0
    assert decode.reads == 1


def test_a_peer_without_a_codec_or_with_another_is_read_raw() -> None:
    decode, d_cache = engine("decode", "int8")
    for name, codec in (("plain", None), ("fp8-peer", "fp8")):
        if codec is None:
            metadata = FakeNixlAgent(name, moves_bytes=True).get_agent_metadata()
            p_addr = 1 << 40
        else:
            other, p_cache = engine(name, codec)
            metadata, p_addr = other.get_agent_metadata(), p_cache.data_ptr()
        peer = decode.add_remote_agent(metadata)
        mine = prep(decode, "NIXL_INIT_AGENT", d_cache.data_ptr())
        theirs = prep(decode, peer, p_addr)
        handle = decode.make_prepped_xfer("READ", mine, [0], theirs, [1])
        assert handle[0] == "raw", name


def test_a_peer_the_shm_stand_in_copies_is_left_to_it() -> None:
    """Under ``kv-transport: auto`` a same-host peer's READ is a raw copy (cheaper than
    the codec): the codec's stand-in hands it to the one below."""
    prefill, p_cache = engine("prefill", "int8")
    decode, d_cache = engine("decode", "int8")
    decode._agent.peer = lambda agent: object() if agent == "prefill" else None
    peer = decode.add_remote_agent(prefill.get_agent_metadata())
    mine = prep(decode, "NIXL_INIT_AGENT", d_cache.data_ptr())
    theirs = prep(decode, peer, p_cache.data_ptr())
    assert decode.make_prepped_xfer("READ", mine, [0], theirs, [1])[0] == "raw"


def test_an_engine_whose_cache_is_not_16_bit_stays_raw() -> None:
    nixl = wc.CodecNixl(FakeNixlAgent("x", moves_bytes=True), "int8")
    nixl.dtype = torch.float32
    cache = torch.zeros(1024, dtype=torch.float32)
    nixl.register_memory(nixl.get_reg_descs([(cache.data_ptr(), 4096, 0, "")], "DRAM"))
    assert nixl.local is None and nixl.get_agent_metadata() == b"md:x"
    assert nixl.roundtrip_all() == 0


def test_the_guards_round_trip_changes_the_cache_as_the_codec_does() -> None:
    nixl, cache = engine("e", "int8")
    torch.manual_seed(2)
    cache.copy_(torch.randn_like(cache))
    before = cache.clone()
    assert nixl.roundtrip_all() == cache.numel() * 2
    assert not torch.equal(cache, before)
    assert (cache.float() - before.float()).abs().max() < 0.05
    bad, bad_cache = engine("bad", "tests.support.bad_codec:SignOnly")
    assert isinstance(bad.codec, SignOnly)
    bad_cache.copy_(before)
    bad.roundtrip_all()
    assert (bad_cache.float() - before.float()).abs().max() > 0.5


def test_the_env_switch() -> None:
    assert wc.wire_codec({wc.ENV: "int8"}) == "int8"
    assert wc.wire_codec({wc.ENV: "none"}) is None and wc.wire_codec({}) is None


def test_an_unknown_codec_is_refused_naming_the_key() -> None:
    from pydantic import ValidationError

    from dynagraph.llm.engines.vllm.args import VllmEngineArgs

    with pytest.raises(ValidationError, match="kv-transfer-compression 'zip'"):
        VllmEngineArgs(model="m", kv_transfer_compression="zip")
