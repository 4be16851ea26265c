"""Run-at-a-time block copies (``dynagraph.llm.kv.offload.block_copy``) equal indexed copies."""

from __future__ import annotations

import pytest
import torch

from dynagraph.llm.kv.offload.block_copy import contiguous_runs, copy_runs


def test_runs_break_where_either_side_jumps() -> None:
    assert contiguous_runs([], []) == []
    assert contiguous_runs([5, 6, 7], [10, 11, 12]) == [(5, 10, 3)]
    assert contiguous_runs([5, 6, 9, 10, 11], [1, 2, 3, 4, 8]) == [
        (5, 1, 2), (9, 3, 2), (11, 8, 1)]
    assert contiguous_runs([3, 2, 1], [0, 1, 2]) == [(3, 0, 1), (2, 1, 1), (1, 2, 1)]
    with pytest.raises(ValueError, match="2 destination ids for 1 source ids"):
        contiguous_runs([1, 2], [1])


@pytest.mark.parametrize("cols", [None, 3])
def test_copying_runs_equals_an_indexed_copy_even_into_strided_rows(cols: int | None) -> None:
    src = torch.arange(40 * 6, dtype=torch.int64).reshape(40, 6)
    base = torch.full((20 * 12,), -1, dtype=torch.int64)
    dst = torch.as_strided(base, (20, 6), (12, 1), 6)  # every other half-row of base
    want = dst.clone()
    d_ids, s_ids = [2, 3, 4, 9, 10, 0], [30, 31, 32, 7, 8, 39]
    for d, s in zip(d_ids, s_ids, strict=True):
        want[d, :cols] = src[s, :cols]
    copy_runs(dst, src, contiguous_runs(d_ids, s_ids), cols)
    assert torch.equal(dst, want)
    assert (base.reshape(20, 12)[:, :6] == -1).all()  # the other half of each row untouched
