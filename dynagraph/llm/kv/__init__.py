"""KV cache plumbing around the engines, one sub-package per concept.

    events/     vLLM's KV events -> this worker's block set -> Router subscribers (relay)
    transfer/   KV between engines: NIXL set-up and records, our NIXL connector (the
                module vLLM loads as ``kv_connector_module_path``), same-host copies
                (shm_direct, shm_memory), the tier hand-off, the wire codec (wire_codec,
                wire_shadow, wire_encode), read settling
    offload/    the host KV pool, the shared tier under it and its size limit
    codec       int8 / fp8 block codecs (the pool's and the wire's)
    quality_guard  a lossy codec's start-up check

Modules that import vLLM (``transfer.nixl_connector``, ``offload.host_pool``,
``offload.host_tiers``) are loaded by vLLM itself, inside engine processes.
"""
