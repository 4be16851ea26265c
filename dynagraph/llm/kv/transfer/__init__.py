"""KV transfer between engines: a remote prefill's KV from the prefill engine to the decode
engine (NIXL, same-host copies, a shared tier), and what the peers publish to find each other."""
