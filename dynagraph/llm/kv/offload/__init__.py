"""KV offloading: blocks that leave an engine's cache kept in a host pool and a shared tier
under it, to be loaded back instead of recomputed."""
