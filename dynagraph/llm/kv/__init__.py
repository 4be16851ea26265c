"""KV cache plumbing around the engines.

    relay       vLLM's KV events -> this worker's block set -> Router subscribers
    nixl_side   per-process NIXL set-up for vLLM's NixlConnector (side channel, engine id)
    nixl_quiet  vLLM's NixlConnector with NIXL's progress thread asleep while idle

``nixl_quiet`` imports vLLM: it is loaded by vLLM itself, inside engine processes.
"""
