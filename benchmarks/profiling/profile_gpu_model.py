"""A Llama-shaped decoder in plain torch, built to be timed (``profile_gpu`` uses it).

Random weights, one flat KV cache of token slots, and interchangeable attention kernels.
The forward pass does the work a serving engine does in one scheduler step: embedding, per
layer RMSNorm, fused QKV projection, RoPE, writing the new K/V into the cache, attention of
the new tokens over their sequence's cached + new tokens, output projection, RMSNorm, fused
gate/up projection, SwiGLU, down projection; then the final norm, the LM head on the last
token of each sequence, and a greedy pick. Attention kernels are in
``profile_gpu_attention``.

Sequences sit back to back in the cache: sequence i holds slots
``[cu_k[i], cu_k[i+1])`` and its new tokens are the last ``q_len[i]`` of them. That is a
contiguous (not paged) layout; a paged kernel reads the same bytes through a block table.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch._dynamo
import torch.nn.functional as F


@dataclass(frozen=True)
class Shape:
    """Model dimensions (a decoder-only Llama with grouped-query attention)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rms_eps: float = 1e-5
    rope_theta: float = 500000.0

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V that one token occupies in the cache, all layers together."""
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype.itemsize

    def params(self) -> int:
        q_kv = (self.heads + 2 * self.kv_heads) * self.head_dim
        per_layer = (
            self.hidden * q_kv
            + self.heads * self.head_dim * self.hidden
            + 3 * self.hidden * self.intermediate
            + 2 * self.hidden
        )
        return self.layers * per_layer + 2 * self.vocab * self.hidden + self.hidden


LLAMA3_8B = Shape(
    hidden=4096, layers=32, heads=32, kv_heads=8, head_dim=128, intermediate=14336, vocab=128256
)
TINY = Shape(hidden=128, layers=2, heads=4, kv_heads=2, head_dim=32, intermediate=384, vocab=512)


@dataclass
class Weights:
    """Stacked per-layer weights in ``F.linear`` layout (out_features, in_features)."""

    embed: torch.Tensor
    attn_norm: torch.Tensor
    wqkv: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate_up: torch.Tensor
    w_down: torch.Tensor
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor


def _randn(shape: tuple[int, ...], std: float, dtype: torch.dtype, device: str) -> torch.Tensor:
    # Random (never zero) data: a matrix product on zeros runs faster than on real values.
    return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std)


def make_weights(shape: Shape, max_positions: int, dtype: torch.dtype, device: str) -> Weights:
    """Random weights, scaled so activations stay finite through all layers."""
    s = shape
    q_kv = (s.heads + 2 * s.kv_heads) * s.head_dim
    std_in = 1.0 / math.sqrt(s.hidden)
    inv_freq = 1.0 / (
        s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.float64) / s.head_dim)
    )
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv_freq)
    return Weights(
        embed=_randn((s.vocab, s.hidden), 1.0, dtype, device),
        attn_norm=torch.ones((s.layers, s.hidden), dtype=dtype, device=device),
        wqkv=_randn((s.layers, q_kv, s.hidden), std_in, dtype, device),
        wo=_randn((s.layers, s.hidden, s.heads * s.head_dim), std_in, dtype, device),
        mlp_norm=torch.ones((s.layers, s.hidden), dtype=dtype, device=device),
        w_gate_up=_randn((s.layers, 2 * s.intermediate, s.hidden), std_in, dtype, device),
        w_down=_randn(
            (s.layers, s.hidden, s.intermediate), 1.0 / math.sqrt(s.intermediate), dtype, device
        ),
        final_norm=torch.ones((s.hidden,), dtype=dtype, device=device),
        lm_head=_randn((s.vocab, s.hidden), std_in, dtype, device),
        rope_cos=angles.cos().to(dtype=dtype, device=device),
        rope_sin=angles.sin().to(dtype=dtype, device=device),
    )


@dataclass
class KVCache:
    """K and V for every layer: ``(layers, slots, kv_heads, head_dim)`` each."""

    k: torch.Tensor
    v: torch.Tensor

    @classmethod
    def random(cls, shape: Shape, slots: int, dtype: torch.dtype, device: str) -> KVCache:
        dims = (shape.layers, slots, shape.kv_heads, shape.head_dim)
        return cls(k=_randn(dims, 1.0, dtype, device), v=_randn(dims, 1.0, dtype, device))


@dataclass
class Batch:
    """One scheduler step: which new tokens, at which positions, over which cached tokens.

    Built once per timed cell and kept alive (a captured CUDA graph reads these tensors).
    """

    q_lens: list[int]
    k_lens: list[int]
    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    last: torch.Tensor
    cu_q: torch.Tensor
    cu_k: torch.Tensor

    @property
    def max_q(self) -> int:
        return max(self.q_lens)

    @property
    def max_k(self) -> int:
        return max(self.k_lens)

    @property
    def uniform(self) -> bool:
        """All sequences have the same new and total lengths (so a padded 4-D view has no pad)."""
        return len(set(self.q_lens)) == 1 and len(set(self.k_lens)) == 1


def make_batch(q_lens: Sequence[int], k_lens: Sequence[int], vocab: int, device: str) -> Batch:
    """Sequence i attends ``k_lens[i]`` tokens, the last ``q_lens[i]`` of which are new."""
    if len(q_lens) != len(k_lens) or any(
        q < 1 or q > k for q, k in zip(q_lens, k_lens, strict=True)
    ):
        raise ValueError(f"need 1 <= q_len <= k_len per sequence, got {q_lens} / {k_lens}")
    positions: list[torch.Tensor] = []
    slots: list[torch.Tensor] = []
    start = 0
    for q, k in zip(q_lens, k_lens, strict=True):
        positions.append(torch.arange(k - q, k))
        slots.append(torch.arange(start + k - q, start + k))
        start += k
    cu_q = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0, *k_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    return Batch(
        q_lens=list(q_lens),
        k_lens=list(k_lens),
        tokens=torch.randint(0, vocab, (int(cu_q[-1]),), generator=gen).to(device),
        positions=torch.cat(positions).to(device),
        slots=torch.cat(slots).to(device),
        last=(cu_q[1:].long() - 1).to(device),
        cu_q=cu_q.to(device),
        cu_k=cu_k.to(device),
    )


# An attention kernel: (q (T, heads, D), k_cache, v_cache (slots, kv_heads, D), batch) ->
# (T, heads, D), each new token over its own sequence's cached + new tokens. The candidates
# are in profile_gpu_attention.py.
AttentionFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Batch], torch.Tensor]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_qkv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the fused QKV projection into heads and rotate q and k."""
    n, dim = qkv.shape[0], 2 * cos.shape[-1]
    q_size, kv_size = heads * dim, kv_heads * dim
    q = _rope(qkv[:, :q_size].view(n, heads, dim), cos, sin)
    k = _rope(qkv[:, q_size : q_size + kv_size].view(n, kv_heads, dim), cos, sin)
    return q, k, qkv[:, q_size + kv_size :].reshape(n, kv_heads, dim)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add, then RMSNorm: returns (new residual, normed)."""
    x = x + delta
    return x, F.rms_norm(x, (x.shape[-1],), weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class Ops:
    """The elementwise work between the matrix products and attention.

    Eager, each is several kernels; under ``torch.compile`` each is one fused kernel, as in
    vLLM (which compiles the model and fuses these the same way). Many small kernels cost a
    few microseconds each even inside a CUDA graph, so this matters at small batches.
    """

    rope_qkv: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, int, int],
        tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    ]
    add_rms_norm: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
    ]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]
    fused: str


EAGER_OPS = Ops(rope_qkv, add_rms_norm, silu_mul, fused="eager")


def compiled_ops() -> Ops:
    """The same functions through ``torch.compile`` (dynamic token count; compiled on first use)."""
    # One compile per distinct specialisation (token count 1 vs many, ...), never a silent
    # fall-back to eager because a small default limit was hit.
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 64
    return Ops(
        torch.compile(rope_qkv, dynamic=True, fullgraph=True),
        torch.compile(add_rms_norm, dynamic=True, fullgraph=True),
        torch.compile(silu_mul, dynamic=True, fullgraph=True),
        fused="torch.compile",
    )


def forward(
    shape: Shape, w: Weights, kv: KVCache, b: Batch, attention: AttentionFn, ops: Ops
) -> torch.Tensor:
    """One model step over ``b``; writes the new tokens' K/V and returns the greedy next tokens."""
    s = shape
    n_tok = b.tokens.shape[0]
    x = F.embedding(b.tokens, w.embed)
    h = F.rms_norm(x, (s.hidden,), w.attn_norm[0], s.rms_eps)
    cos = w.rope_cos[b.positions].unsqueeze(1)
    sin = w.rope_sin[b.positions].unsqueeze(1)
    for layer in range(s.layers):
        q, k, v = ops.rope_qkv(F.linear(h, w.wqkv[layer]), cos, sin, s.heads, s.kv_heads)
        kv.k[layer].index_copy_(0, b.slots, k)
        kv.v[layer].index_copy_(0, b.slots, v)
        o = attention(q, kv.k[layer], kv.v[layer], b)
        attn_out = F.linear(o.reshape(n_tok, s.heads * s.head_dim), w.wo[layer])
        x, h = ops.add_rms_norm(x, attn_out, w.mlp_norm[layer], s.rms_eps)
        mlp_out = F.linear(ops.silu_mul(F.linear(h, w.w_gate_up[layer])), w.w_down[layer])
        norm = w.attn_norm[layer + 1] if layer + 1 < s.layers else w.final_norm
        x, h = ops.add_rms_norm(x, mlp_out, norm, s.rms_eps)
    return F.linear(h[b.last], w.lm_head).argmax(dim=-1)
