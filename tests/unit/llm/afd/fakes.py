"""Fake FFN computations for data-plane tests: exact, cheap, easy to tell apart."""

from __future__ import annotations

import threading

import torch

HIDDEN = 64
DTYPE = torch.bfloat16


class ScaleFfn:
    """``FfnCompute``: layer ``l`` multiplies by ``l + 2`` (expert groups: by the number
    of experts held, so partial sums are checkable)."""

    model = "fake"
    hidden_size = HIDDEN
    dtype = DTYPE

    def __init__(self, layers: list[int], experts: list[int] | None = None,
                 gate: threading.Event | None = None) -> None:
        self.layers = layers
        self.experts = experts
        self.gate = gate
        self.calls = 0

    def forward(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        if layer not in self.layers:
            raise ValueError(f"layer {layer} is not served here")
        if self.gate is not None:
            self.gate.wait(10)
        self.calls += 1
        factor = layer + 2 if self.experts is None else len(self.experts)
        return hidden * factor


def rows(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, HIDDEN, generator=g).to(DTYPE)
