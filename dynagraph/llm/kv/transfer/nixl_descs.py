"""What the stand-ins in front of vLLM's NIXL agent share (``shm_direct.ShmNixl``,
``wire_codec.CodecNixl``): the descriptor arrays vLLM prepares, as rows of address,
length and device; agent names, which NIXL gives as ``str`` or ``bytes``; the merging of
descriptor ranges into runs contiguous on every side; and the ``nixlXferTelemetry`` a
stand-in reports for a READ it did itself.

Pure: numpy only, no memory calls, no NIXL or vLLM import. ``merge_ranges`` keeps the
order of its input and merges a range into the one before only where it follows it on
every side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

LOCAL_AGENT = "NIXL_INIT_AGENT"
"""The agent name vLLM gives ``prep_xfer_dlist`` for this process's own descriptors."""


@dataclass
class Telemetry:
    """What ``nixlXferTelemetry`` carries (microseconds)."""

    startTime: float  # noqa: N815  (NIXL's names)
    postDuration: float  # noqa: N815
    xferDuration: float  # noqa: N815
    totalBytes: int  # noqa: N815
    descCount: int  # noqa: N815


def agent_text(name: str | bytes) -> str:
    return name.decode() if isinstance(name, bytes) else name


def descriptor_rows(descs: Any) -> np.ndarray | None:
    """An ``N x 3`` (address, length, device) descriptor array as uint64, else None."""
    if isinstance(descs, np.ndarray) and descs.ndim == 2 and descs.shape[1] == 3:
        return np.asarray(descs, dtype=np.uint64).copy()
    return None


def merge_runs(dst: np.ndarray, src: np.ndarray,
               lens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Descriptor pairs (copy ``lens[i]`` bytes from ``src[i]`` to ``dst[i]``) merged
    into runs that are contiguous on both sides, in order."""
    d, s, n = merge_ranges(dst, src, lens=lens)
    return d, s, n


def merge_ranges(first: np.ndarray, *others: np.ndarray, lens: np.ndarray,
                 other_lens: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
    """Ranges ``(first[i], lens[i])`` and ``(others[k][i], other_lens[i])`` (``lens`` when
    None: the same sizes) merged where each follows the one before on every side; returns
    the sides' run starts, then the runs' ``lens`` (and ``other_lens``) sums."""
    lens = np.asarray(lens, np.uint64)
    sizes = lens if other_lens is None else np.asarray(other_lens, np.uint64)
    cols = [np.asarray(first, np.uint64), *(np.asarray(o, np.uint64) for o in others)]
    sums = [lens] if other_lens is None else [lens, sizes]
    if len(lens) == 0:
        return (*cols, *sums)
    follows = cols[0][1:] == cols[0][:-1] + lens[:-1]
    for col in cols[1:]:
        follows &= col[1:] == col[:-1] + sizes[:-1]
    starts = np.concatenate(([0], np.flatnonzero(~follows) + 1))
    return (*(c[starts] for c in cols), *(np.add.reduceat(x, starts) for x in sums))

