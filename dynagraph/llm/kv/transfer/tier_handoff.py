"""Same-host KV hand-off through a shared tier of block files (``kv-transport: tier``).

(``kv-transport: shm`` / ``auto`` copy from the prefill engine's cache instead, which is
faster: ``dynagraph.llm.kv.transfer.shm_direct``.)

When a decode worker and a prefill worker of one host name the same ``kv-offload-dir``
on a tmpfs (``dynagraph.llm.kv.offload.host_tiers``), the KV of a remote prefill does not need
NIXL: the prefill engine's pool writes every block it computes through to that directory,
and the decode engine, asked for the same prompt, finds the blocks there and loads them
instead of computing them. So:

1. the decode worker offers its tier in the job (``engine_params["kv_tier"]``: its boot
   id and the tier's directory, :func:`offer`);
2. a prefill worker whose own tier is that one (same boot id, same directory:
   :func:`accepts`) prefills without NIXL's remote-decode parameters, waits until every
   full block of the prompt is a file in the tier (:func:`wait_for_blocks`), and hands
   over ``{"kv_transport": "shm", ...}`` (:func:`handed_over`) instead of NIXL's
   parameters; any other prefill worker hands over by NIXL as before;
3. the decode worker runs the request as a local one (:func:`is_shm`): its pool's tier
   lookup finds the prompt's blocks and loads them.

A block file is named by vLLM's ``FileMapper``: ``<tier>/<model>_<layout digest>_r0/
<hex[:3]>/<hex[3:5]>_g0/<hex>.bin``, ``hex`` the block's hash digest (the same
``BlockHasher.digests`` the Router uses). The layout directory is found by its ``_r0``
suffix (both engines serve the same model with the same layout, so they share one).
No vLLM import: runs in the worker processes.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dynagraph.runtime.addresses import host_id

TIER_KEY = "kv_tier"
"""The job's ``engine_params`` key of the decode worker's offer."""

TRANSPORT_KEY = "kv_transport"
"""The hand-off's key: ``"shm"`` when the KV is in the shared tier."""


def tier_dir(offload_dir: str, codec: str) -> str:
    """The directory the blocks of ``codec`` go to under ``kv-offload-dir`` (workers with
    different codecs never read each other's bytes)."""
    return str(Path(offload_dir).absolute() / codec.replace(":", "-").replace("/", "-"))


def offer(offload_dir: str | None, codec: str) -> dict[str, str] | None:
    """What a decode worker with ``kv-offload-dir`` puts in its jobs; None without one."""
    if not offload_dir:
        return None
    return {"host": host_id(), "dir": tier_dir(offload_dir, codec)}


def tier_name(tier: Mapping[str, str]) -> str:
    """An offered tier as one string (a worker's ``kv_tier`` metadata, which the Router
    groups workers by)."""
    return f"{tier['host']}:{tier['dir']}"


def accepts(own: Mapping[str, str] | None, engine_params: Mapping[str, Any]) -> bool:
    """True when a prefill worker with tier ``own`` shares the job's offered tier."""
    theirs = engine_params.get(TIER_KEY)
    return (own is not None and isinstance(theirs, Mapping)
            and theirs.get("host") == own["host"] and theirs.get("dir") == own["dir"])


def handed_over(blocks: int, present: bool, wait_s: float) -> dict[str, Any]:
    """A prefill worker's hand-off through the tier (in place of NIXL's parameters)."""
    return {TRANSPORT_KEY: "shm", "blocks": blocks, "present": present,
            "wait_s": round(wait_s, 6)}


def is_shm(kv_transfer_params: Mapping[str, Any] | None) -> bool:
    """True for a hand-off through the tier (the decode engine runs it as local)."""
    return kv_transfer_params is not None and kv_transfer_params.get(TRANSPORT_KEY) == "shm"


def block_paths(layout_dir: str, digests: Sequence[bytes]) -> list[str]:
    """vLLM's ``FileMapper`` names of the blocks (group 0) under one layout directory."""
    out = []
    for d in digests:
        h = d.hex()
        out.append(f"{layout_dir}/{h[:3]}/{h[3:5]}_g0/{h}.bin")
    return out


def blocks_present(tier: str, digests: Sequence[bytes]) -> bool:
    """Every block is a file under one of the tier's layout directories."""
    try:
        layouts = [e.path for e in os.scandir(tier) if e.is_dir() and e.name.endswith("_r0")]
    except FileNotFoundError:
        return False
    return any(all(os.path.exists(p) for p in block_paths(layout, digests))
               for layout in layouts)


async def wait_for_blocks(tier: str, digests: Sequence[bytes], timeout_s: float,
                          poll_s: float = 0.002) -> tuple[bool, float]:
    """Poll until every block is in the tier: (all there, seconds waited). The pool
    stores a request's blocks the engine step after it computed them, and its tier
    writes them a moment later."""
    began = time.monotonic()
    while True:
        if blocks_present(tier, digests):
            return True, time.monotonic() - began
        if time.monotonic() - began >= timeout_s:
            return False, time.monotonic() - began
        await asyncio.sleep(poll_s)
