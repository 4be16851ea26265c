"""A deliberately bad KV codec for the quality guard's test: it keeps only each value's
sign and its group's absmax (one bit of information per value)."""

from __future__ import annotations

import torch

from dynagraph.llm.kv.codec import Int8


class SignOnly(Int8):
    name = "sign-only"

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        return super().encode(torch.sign(rows.float()).to(rows.dtype) * rows.abs().amax())
