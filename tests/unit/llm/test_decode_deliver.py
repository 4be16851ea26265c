"""The decode side of a remote prefill's hand-off: the prefill engine's side channel comes
from that prefill instance's NIXL record, not from the transfer parameters it sent."""

from __future__ import annotations

import asyncio

from dynagraph.llm.disagg.coordinator import (
    PrefillResult,
    PrefixCacheEstimate,
    RemotePrefillCoordinator,
)
from dynagraph.llm.disagg.decode import DecodeDisagg
from dynagraph.llm.disagg.keys import DecodeDisaggKeys
from dynagraph.llm.disagg.policy import DisaggConfig, LiveDisaggSettings
from dynagraph.llm.kv.transfer.nixl_peers import NixlPeers
from dynagraph.llm.kv.transfer.nixl_side import NixlEndpoint, nixl_key
from dynagraph.llm.router.hashing import BlockHasher
from dynagraph.runtime.discovery import MemoryDiscovery, MemoryStore
from dynagraph.runtime.queue import MemoryPrefillQueue, ReplyTarget
from dynagraph.sdk import RuntimeContext

PREFILL = NixlEndpoint(engine_id="PrefillWorker-2a", host="198.18.0.3", port=17001,
                       role="kv_producer")
SENT = {"remote_engine_id": "PrefillWorker-2a", "remote_block_ids": [3],
        "remote_host": "127.0.0.1", "remote_port": 17001}


async def make(store: MemoryStore) -> tuple[DecodeDisagg, MemoryDiscovery]:
    disc = MemoryDiscovery(store)
    await disc.start()
    rt = RuntimeContext.standalone("dynamo", "VllmWorker")
    keys = DecodeDisaggKeys(remote_prefill=True, conditional_disagg=False,
                            remote_prefill_timeout=1.0, prefill_queue_ack_wait=0.5)
    d = DecodeDisagg(keys, rt, prefill=object(), kv_transfer_config={}, nixl=PREFILL)
    queue = MemoryPrefillQueue()
    await queue.connect()
    d.coordinator = RemotePrefillCoordinator(
        settings=LiveDisaggSettings(DisaggConfig(remote_prefill=True, conditional_disagg=False,
                                                 remote_prefill_timeout=1.0), namespace="dynamo"),
        queue=queue, reply_to=ReplyTarget(component="VllmWorker", endpoint="prefill_done",
                                          instance_id=1),
        prefix=PrefixCacheEstimate(BlockHasher(16), capacity_blocks=100))
    d.peers = NixlPeers(disc, "dynamo")
    await d.peers.start()
    return d, disc


async def test_the_engine_gets_the_side_channel_of_the_prefill_instances_record() -> None:
    store = MemoryStore()
    prefill = MemoryDiscovery(store)
    await prefill.start()
    await prefill.put(nixl_key("dynamo", "PrefillWorker", prefill.instance_id), PREFILL.record(),
                      lease=True)
    d, disc = await make(store)
    try:
        assert d.coordinator is not None
        planning = asyncio.create_task(d.coordinator.plan("r1", list(range(40))))
        while d.coordinator.pending == 0:  # noqa: ASYNC110 - the plan is queued in this loop
            await asyncio.sleep(0.001)
        ok = await d.deliver(PrefillResult(request_id="r1", kv_transfer_params=SENT,
                                           prefill_instance=prefill.instance_id))
        plan = await planning
        assert ok and plan.remote
        assert plan.kv_transfer_params == {**SENT, "remote_host": "198.18.0.3"}

        planning = asyncio.create_task(d.coordinator.plan("r2", list(range(100, 140))))
        while d.coordinator.pending == 0:  # noqa: ASYNC110
            await asyncio.sleep(0.001)
        # from an instance with no NIXL record: not used, the request prefills locally
        assert not await d.deliver(PrefillResult(request_id="r2", kv_transfer_params=SENT,
                                                 prefill_instance=0xDEAD))
        # params naming another engine than the instance's record: not used either
        other = {**SENT, "remote_engine_id": "PrefillWorker-ff"}
        assert not await d.deliver(PrefillResult(request_id="r2", kv_transfer_params=other,
                                                 prefill_instance=prefill.instance_id))
        plan = await planning
        assert not plan.remote and plan.fallback == "timeout"
    finally:
        await d.stop()
        await disc.close()
        await prefill.close()
