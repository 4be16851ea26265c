"""The environment variables the workers set to switch an engine's KV transfer modes.

Kept apart from the modules that act on them (``shm_direct``, ``wire_codec``), which
import numpy and torch: the processes that only set them (every component of a graph
imports the worker's config) start without those.
"""

from __future__ import annotations

KV_SHM = "DYNAGRAPH_KV_SHM"
"""``1`` in an engine's environment: its KV cache goes to shared memory, published, and
its READs from mapped peers are copies (set by the workers for ``kv-transport`` shm/auto)."""

KV_WIRE_CODEC = "DYNAGRAPH_KV_WIRE_CODEC"
"""The codec an engine's KV crosses the NIXL wire with (set by the disagg workers from
``kv-transfer-compression``; unset or ``none``: raw)."""
