"""A decode worker finds a prefill engine's NIXL side channel in that instance's record."""

from __future__ import annotations

import pytest

from dynagraph.llm.kv.transfer.nixl_peers import (
    NixlPeerError,
    NixlPeers,
    endpoint_of,
    instance_of,
    peer_params,
)
from dynagraph.llm.kv.transfer.nixl_side import NixlEndpoint, nixl_key
from dynagraph.runtime.discovery import MemoryDiscovery, MemoryStore
from tests.support.poll import until

PREFILL = NixlEndpoint(engine_id="PrefillWorker-1f", host="198.18.0.3", port=15600,
                       role="kv_producer")
PARAMS = {"do_remote_prefill": True, "remote_engine_id": "PrefillWorker-1f",
          "remote_block_ids": [1, 2], "remote_host": "127.0.0.1", "remote_port": 15600}


def test_params_take_the_records_side_channel() -> None:
    out = peer_params(PARAMS, PREFILL)
    assert out == {**PARAMS, "remote_host": "198.18.0.3", "remote_port": 15600}
    assert PARAMS["remote_host"] == "127.0.0.1"  # not modified in place


def test_params_of_another_engine_are_refused() -> None:
    with pytest.raises(NixlPeerError, match="PrefillWorker-2"):
        peer_params({**PARAMS, "remote_engine_id": "PrefillWorker-2"}, PREFILL)


def test_record_parsing() -> None:
    assert instance_of("/dynamo/nixl/PrefillWorker/1f") == 0x1F
    assert instance_of("/dynamo/nixl/PrefillWorker/zz") is None
    assert endpoint_of(PREFILL.record()) == PREFILL
    assert endpoint_of({"engine_id": "x"}) is None and endpoint_of("nope") is None


async def test_peers_follow_records_and_read_one_not_seen_yet() -> None:
    store = MemoryStore()
    prefill, decode = MemoryDiscovery(store), MemoryDiscovery(store)
    await prefill.start()
    await decode.start()
    peers = NixlPeers(decode, "dynamo")
    await peers.start()
    try:
        key = nixl_key("dynamo", "PrefillWorker", prefill.instance_id)
        await prefill.put(key, PREFILL.record(), lease=True)
        await until(lambda: prefill.instance_id in peers.peers)
        got = await peers.resolve(prefill.instance_id, PARAMS)
        assert (got["remote_host"], got["remote_port"]) == ("198.18.0.3", 15600)

        peers.peers.clear()  # a hand-off that beats the watch event: read from the store
        assert await peers.lookup(prefill.instance_id) == PREFILL

        await prefill.close()  # the lease goes, and the record with it
        await until(lambda: prefill.instance_id not in peers.peers)
        with pytest.raises(NixlPeerError, match="no NIXL record"):
            await peers.resolve(prefill.instance_id, PARAMS)
    finally:
        await peers.close()
        await decode.close()
