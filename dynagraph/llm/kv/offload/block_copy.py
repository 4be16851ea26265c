"""Copying KV blocks between two tensors of rows, one slice copy per run of blocks.

A request's blocks are mostly consecutive in the engine's cache and in the host pool
(both allocate in order), so a load or a store of ``n`` blocks is a few runs of
consecutive rows on both sides. Copying each run as one slice (a memcpy per row of the
run, no index tensors) is far faster than torch's advanced indexing
(``dst[ids] = src[ids]``: a gather into a temporary, then a scatter).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def contiguous_runs(dst_ids: Sequence[int] | np.ndarray,
                    src_ids: Sequence[int] | np.ndarray) -> list[tuple[int, int, int]]:
    """``(dst_start, src_start, length)`` of each maximal run where both id lists go up
    by one together, in order."""
    d = np.asarray(dst_ids, dtype=np.int64)
    s = np.asarray(src_ids, dtype=np.int64)
    if d.shape != s.shape:
        raise ValueError(f"{len(d)} destination ids for {len(s)} source ids")
    if len(d) == 0:
        return []
    breaks = np.flatnonzero((np.diff(d) != 1) | (np.diff(s) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [len(d)]))
    return [(int(d[a]), int(s[a]), int(b - a)) for a, b in zip(starts, ends, strict=True)]


def copy_runs(dst: torch.Tensor, src: torch.Tensor, runs: Sequence[tuple[int, int, int]],
              cols: int | None = None) -> None:
    """For each ``(dst_start, src_start, n)``: rows ``dst_start..+n`` of ``dst`` (their
    first ``cols`` elements, or all) become the same rows of ``src`` from ``src_start``."""
    for d0, s0, n in runs:
        if cols is None:
            dst[d0:d0 + n].copy_(src[s0:s0 + n])
        else:
            dst[d0:d0 + n, :cols].copy_(src[s0:s0 + n, :cols])
