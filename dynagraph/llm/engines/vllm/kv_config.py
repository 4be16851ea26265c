"""vLLM's ``KVTransferConfig`` for an engine: its NIXL connector, its host KV pool, or both.

Also :func:`block_hasher`, the block hashes the engine computes (the Router's must match).
Importing this module does not import vLLM: the pool's modules are named here and loaded
by vLLM in the engine processes.
"""

from __future__ import annotations

import os
from typing import Any

from dynagraph.llm.engines.vllm.args import VllmEngineArgs
from dynagraph.llm.kv.transfer.tier_handoff import tier_dir
from dynagraph.llm.router.hashing import BlockHasher, seed_from_env

TIER_IO_THREADS = 2
"""Read and write threads of the ``kv-offload-dir`` tier (vLLM's default is 16 each)."""

RECOMPUTE = "recompute"


def kv_transfer_config(args: VllmEngineArgs) -> dict[str, Any] | None:
    """vLLM's ``KVTransferConfig`` fields: ``kv-transfer-config`` as given, the host KV
    pool's offloading connector, or both under vLLM's ``MultiConnector`` (the pool
    second: a remote prefill's KV arrives over NIXL, the pool serves what was evicted)."""
    if args.kv_offload_gib <= 0:
        return args.kv_transfer_config
    # dynagraph.llm.kv.offload.host_pool / host_tiers (import vLLM: named here, loaded by vLLM)
    extra: dict[str, Any] = {
        "spec_name": "HostPoolSpec", "spec_module_path": "dynagraph.llm.kv.offload.host_pool",
        "cpu_bytes_to_use": int(args.kv_offload_gib * 2**30), "codec": args.kv_compression}
    if args.kv_offload_dir:  # vLLM's file-system tier, one directory per codec
        extra.update(spec_name="TieredHostPoolSpec",
                     spec_module_path="dynagraph.llm.kv.offload.host_tiers",
                     secondary_tiers=[{
                         "type": "fs",
                         "root_dir": tier_dir(args.kv_offload_dir, args.kv_compression),
                         "n_read_threads": TIER_IO_THREADS,
                         "n_write_threads": TIER_IO_THREADS,
                         # the blocks it writes, as KV events (medium STORAGE) for the Router
                         "enable_kv_events": True}])
    # vLLM's scheduler reads the failure policy of the top connector only (its default:
    # fail the request). A block a connector could not load is computed instead: a NIXL
    # read from a prefill worker that died after its hand-off (nixl_side asks the same
    # of its own connector, which under the MultiConnector counted for nothing) or a
    # failed pool copy. A tier file gone or cut short never gets that far: the tier's
    # promotion into the pool fails and the lookup becomes a miss.
    pool = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_load_failure_policy": RECOMPUTE, "kv_connector_extra_config": extra}
    if not args.kv_transfer_config:
        return pool
    given = dict(args.kv_transfer_config)
    # vLLM 0.32's MultiConnector passes engine_id to each child besides the child's own
    # keys (TypeError when a child has one): it goes on the parent, children inherit it.
    engine_id = given.pop("engine_id", None)
    multi = {"kv_connector": "MultiConnector", "kv_role": given.get("kv_role", "kv_both"),
             "kv_load_failure_policy": given.get("kv_load_failure_policy", RECOMPUTE),
             "kv_connector_extra_config": {"connectors": [given, pool]}}
    if engine_id is not None:
        multi["engine_id"] = engine_id
    return multi


def block_hasher(args: VllmEngineArgs) -> BlockHasher:
    """Hashes blocks as this engine does: its block size, prefix-caching hash algorithm
    and seed (``PYTHONHASHSEED`` of the environment it inherits)."""
    return BlockHasher(args.block_size,
                       args.extra_engine_args.get("prefix_caching_hash_algo", "sha256"),
                       seed_from_env(os.environ))
