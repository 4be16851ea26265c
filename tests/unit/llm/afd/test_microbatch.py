"""Where a forward batch splits into two micro-batches (pure part)."""

from __future__ import annotations

import torch

from dynagraph.llm.afd.microbatch import MicroBatch, split_point


def test_split_balances_tokens_at_a_request_boundary() -> None:
    assert split_point([0, 1, 2, 3, 4], 1) == 2          # four decodes: 2 + 2
    assert split_point([0, 1, 2, 3], 1) == 1             # three: 1 + 2 (first best)
    assert split_point([0, 100, 101, 102], 1) == 1       # a prefill and two decodes
    assert split_point([0, 5, 10, 60], 1) == 2           # 10 + 50 beats 5 + 55


def test_no_split_for_one_request_or_a_tiny_half() -> None:
    assert split_point([0, 37], 1) is None
    assert split_point([0, 1, 2], 2) is None
    assert split_point([0, 2, 4], 2) == 1
    assert split_point([0, 1, 100], 2) is None


def test_installed_swaps_and_restores_the_forward_context() -> None:
    class Ctx:
        attn_metadata: object = "whole"
        slot_mapping: object = "whole-slots"

    ctx = Ctx()
    half = MicroBatch(0, 2, attn_metadata={"l": "half"}, slot_mapping={"l": torch.zeros(2)})
    with half.installed(ctx):
        assert ctx.attn_metadata == {"l": "half"}
    assert (ctx.attn_metadata, ctx.slot_mapping) == ("whole", "whole-slots")
    with MicroBatch(0, 4).installed(ctx):
        assert ctx.attn_metadata == "whole"
