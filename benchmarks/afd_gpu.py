"""FFN / MoE-expert compute of one layer on a device, for benchmarks/afd.py (AFD on a GPU).

    python benchmarks/afd_gpu.py cuda OUT.json    # on the H200 (needs only torch)
    python benchmarks/afd_gpu.py cpu OUT.json     # the same shapes here, small M only

Per model shape and row count M (tokens in one layer call): the dense SwiGLU FFN, an MoE
layer (8 experts, top-2, eager per-expert loop), and on the GPU the host<->device copy of
the hidden rows (pinned). Microseconds per call, bf16.
"""
import json
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

DEV, OUT = sys.argv[1], sys.argv[2]
GPU = DEV == "cuda"
if not GPU:
    torch.set_num_threads(1)  # two busy cores: OpenMP barriers would dominate
B = torch.bfloat16
ROWS = (1, 8, 64, 256, 1024) if GPU else (1, 8, 64)


def timed(f: Callable[..., Any], *args: Any, n: int = 30) -> float:
    for _ in range(3):
        f(*args)
    if GPU:
        torch.cuda.synchronize()
    s = time.perf_counter()
    for _ in range(n):
        f(*args)
    if GPU:
        torch.cuda.synchronize()
    return (time.perf_counter() - s) / n * 1e6


def mlp(hidden: int, inter: int) -> Callable[[torch.Tensor], torch.Tensor]:
    g = torch.randn(2 * inter, hidden, device=DEV, dtype=B) * .02
    w = torch.randn(hidden, inter, device=DEV, dtype=B) * .02

    def f(x: torch.Tensor) -> torch.Tensor:
        u, v = (x @ g.t()).chunk(2, -1)
        return (torch.nn.functional.silu(u) * v) @ w.t()
    return f


def moe(x: torch.Tensor, fs: list[Any], rows: list[torch.Tensor], wr: list[torch.Tensor]
        ) -> torch.Tensor:
    o = torch.zeros(x.shape, device=DEV)
    for e, f in enumerate(fs):
        o.index_add_(0, rows[e], (f(x[rows[e]]) * wr[e]).float())
    return o.to(B)


def copy_round(xh: torch.Tensor, xd: torch.Tensor) -> None:
    xh.copy_(xd.copy_(xh, non_blocking=True))


r: dict[str, Any] = {"device": torch.cuda.get_device_name() if GPU else "cpu"}
dense = [("tiny", 256, 512), ("llama8b", 4096, 14336)] + ([("llama70b", 8192, 28672)] * GPU)
for name, hidden, inter in dense:
    f = mlp(hidden, inter)
    for m in ROWS:
        x = torch.randn(m, hidden, device=DEV, dtype=B)
        r[f"{name}/dense/{m}"] = timed(f, x)
        if GPU:
            r[f"{name}/h2d+d2h/{m}"] = timed(copy_round, torch.randn(m, hidden, dtype=B)
                                             .pin_memory(), x)
for name, hidden, inter in [("tiny-moe", 256, 512)] + ([("mixtral", 4096, 14336)] * GPU):
    fs = [mlp(hidden, inter) for _ in range(8)]
    for m in ROWS:
        x = torch.randn(m, hidden, device=DEV, dtype=B)
        ids = torch.randint(0, 8, (m, 2), device=DEV)
        wt = torch.rand(m, 2, device=DEV)
        rows = [(ids == e).any(1).nonzero().flatten() for e in range(8)]
        wr = [(wt * (ids == e)).sum(1)[rr].unsqueeze(1) for e, rr in enumerate(rows)]
        r[f"{name}/moe/{m}"] = timed(moe, x, fs, rows, wr)
json.dump(r, open(OUT, "w"), indent=1)
print(json.dumps(r))
