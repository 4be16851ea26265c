"""Attention kernels that ``profile_gpu`` races: each is checked against float64 attention
on the device and the fastest correct one per phase is used.

All take ``(q (T, heads, D), k_cache, v_cache (slots, kv_heads, D), batch)`` and return
``(T, heads, D)``: each new token attends every earlier token of its own sequence (the
cached prefix and the new tokens before it). Sequences sit back to back in the cache
(``profile_gpu_model``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from benchmarks.profiling.profile_gpu_model import AttentionFn, Batch

# (q, k, v as (batch, heads, len, D), causal top-left) -> (out, log-sum-exp (batch, heads, len))
PartFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor]
]


def _views(
    q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, b: Batch
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(batch, heads, len, D) views of a uniform batch: no copy, no padding."""
    if not b.uniform:
        raise ValueError("this kernel needs equal lengths in the batch")
    n, lq, lk = len(b.q_lens), b.q_lens[0], b.k_lens[0]
    dim = q.shape[2]
    q4 = q.view(n, lq, q.shape[1], dim).transpose(1, 2)
    k4 = kc[: n * lk].view(n, lk, kc.shape[1], dim).transpose(1, 2)
    v4 = vc[: n * lk].view(n, lk, vc.shape[1], dim).transpose(1, 2)
    return q4, k4, v4


def _unview(out: torch.Tensor) -> torch.Tensor:
    n, heads, lq, dim = out.shape
    return out.transpose(1, 2).reshape(n * lq, heads, dim)


def sdpa_attention(backends: list[SDPBackend] | None) -> AttentionFn:
    """``scaled_dot_product_attention`` on 4-D views of the cache (uniform batches only).

    Plain causal when there is no cached prefix, lower-right causal (``causal_lower_right``)
    on top of one, no mask for a single new token.
    """

    def attend(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, b: Batch) -> torch.Tensor:
        q4, k4, v4 = _views(q, kc, vc, b)
        lq, lk = q4.shape[2], k4.shape[2]
        lower_right = 1 < lq < lk
        if lower_right and backends and SDPBackend.FLASH_ATTENTION not in backends:
            # torch routes causal_lower_right to flash (else mem-efficient) whatever
            # sdpa_kernel says, so such a candidate would not be what its name says.
            raise ValueError(f"lower-right causal attention is not run on {backends}")
        with sdpa_kernel(backends) if backends else contextlib.nullcontext():
            if not lower_right:
                out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=lq > 1, enable_gqa=True)
            else:
                out = F.scaled_dot_product_attention(
                    q4, k4, v4, attn_mask=causal_lower_right(lq, lk), enable_gqa=True
                )
        return _unview(out)

    return attend


def flash_varlen_attention(
    q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, b: Batch
) -> torch.Tensor:
    """FlashAttention-2's variable-length kernel (torch's vendored copy), as vLLM calls it.

    Packed queries and keys with cumulative lengths; causal is lower-right aligned here, so
    new tokens on a cached prefix see the whole prefix. Any lengths, no padding.
    """
    total = sum(b.k_lens)
    out = torch.ops.aten._flash_attention_forward(
        q, kc[:total], vc[:total], b.cu_q, b.cu_k, b.max_q, b.max_k, 0.0, b.max_q > 1, False,
        scale=1.0 / math.sqrt(q.shape[-1]),
    )[0]  # fmt: skip
    return cast(torch.Tensor, out)


def cascade_attention(part: PartFn) -> AttentionFn:
    """New tokens over (cached prefix, no mask) and over (new tokens, causal), merged by
    log-sum-exp: lower-right causal attention from a kernel that only aligns its causal mask
    top-left (as cascade attention in vLLM/FlashInfer does). Uniform batches only."""

    def attend(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, b: Batch) -> torch.Tensor:
        q4, k4, v4 = _views(q, kc, vc, b)
        lq, lk = q4.shape[2], k4.shape[2]
        if lq == 1 or lq == lk:
            return _unview(part(q4, k4, v4, lq > 1)[0])
        cached = lk - lq
        o1, l1 = part(q4, k4[:, :, :cached], v4[:, :, :cached], False)
        o2, l2 = part(q4, k4[:, :, cached:], v4[:, :, cached:], True)
        l1 = l1.reshape(*o1.shape[:-1], 1).float()
        l2 = l2.reshape(*o2.shape[:-1], 1).float()
        top = torch.maximum(l1, l2)
        w1, w2 = (l1 - top).exp(), (l2 - top).exp()
        out = (o1.float() * w1 + o2.float() * w2) / (w1 + w2)
        return _unview(out.to(q.dtype))

    return attend


def cudnn_part(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's fused attention (what SDPA's cuDNN backend runs), with its log-sum-exp."""
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=1.0 / math.sqrt(q.shape[-1])
    )
    return cast(torch.Tensor, res[0]), cast(torch.Tensor, res[1])


def math_part(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 attention with its log-sum-exp: checks the cascade merge anywhere."""
    group = q.shape[1] // k.shape[1]
    kd = k.double().repeat_interleave(group, 1)
    vd = v.double().repeat_interleave(group, 1)
    scores = q.double() @ kd.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        lq, lk = scores.shape[-2:]
        scores = scores.masked_fill(
            torch.ones(lq, lk, dtype=torch.bool, device=q.device).triu(1), float("-inf")
        )
    lse = scores.logsumexp(-1)
    return ((scores - lse[..., None]).exp() @ vd).to(q.dtype), lse


def reference_attention(
    q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, b: Batch
) -> torch.Tensor:
    """Float64 attention for correctness checks: each new token over its sequence's prefix."""
    group = q.shape[1] // kc.shape[1]
    outs: list[torch.Tensor] = []
    for i, (lq, lk) in enumerate(zip(b.q_lens, b.k_lens, strict=True)):
        qs = q[int(b.cu_q[i]) : int(b.cu_q[i + 1])].double().transpose(0, 1)
        ks = kc[int(b.cu_k[i]) : int(b.cu_k[i + 1])].double().repeat_interleave(group, 1)
        vs = vc[int(b.cu_k[i]) : int(b.cu_k[i + 1])].double().repeat_interleave(group, 1)
        scores = qs @ ks.permute(1, 2, 0) / math.sqrt(q.shape[-1])
        allowed = torch.arange(lk, device=q.device)[None, :] <= (
            torch.arange(lq, device=q.device)[:, None] + (lk - lq)
        )
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append((scores.softmax(-1) @ vs.transpose(0, 1)).transpose(0, 1))
    return torch.cat(outs).to(q.dtype)


CANDIDATES: dict[str, AttentionFn] = {
    "flash-varlen": flash_varlen_attention,
    "cudnn-cascade": cascade_attention(cudnn_part),
    "sdpa-flash": sdpa_attention([SDPBackend.FLASH_ATTENTION]),
    "sdpa-cudnn": sdpa_attention([SDPBackend.CUDNN_ATTENTION]),
    "sdpa-efficient": sdpa_attention([SDPBackend.EFFICIENT_ATTENTION]),
    "sdpa-any": sdpa_attention(None),
}

# The kernel each candidate runs: per cell, the profile keeps the fastest family (an engine
# picks its attention kernel per shape too).
FAMILY: dict[str, str] = {
    "flash-varlen": "FlashAttention-2 varlen",
    "cudnn-cascade": "cuDNN",
    "sdpa-flash": "FlashAttention-2 batched",
    "sdpa-cudnn": "cuDNN",
    "sdpa-efficient": "mem-efficient",
    "sdpa-any": "torch's choice",
}
