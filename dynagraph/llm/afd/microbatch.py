"""Micro-batch ping-pong: split one forward batch in two so attention and FFN overlap.

With two micro-batches A and B, per layer: A's attention, send A's FFN input; B's
attention (while an FfnWorker computes A's FFN), send B; collect A, A's next attention
(while B's FFN runs) ... The split is at a request boundary (attention of one request
never spans both halves), as near the middle of the tokens as possible.

``split_point`` is the pure choice; ``CpuAttentionSplit`` makes each half's attention
metadata for vLLM's CPU attention backend (``CPUAttentionMetadata``) and installs it
into vLLM's forward context while that half's attention runs. Other backends, an
encoder, a dynamic causal mask or a batch with one request run as one micro-batch.
Per-request attention and per-row linear layers do not depend on the other rows of
the batch (checked by the greedy-equality tests with ping-pong on), so splitting
keeps the tokens exact.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch


def split_point(query_start_loc: Sequence[int], min_tokens: int) -> int | None:
    """The request index r splitting requests ``[0, r)`` / ``[r, n)`` with the token
    counts closest to equal, or None when a half would have fewer than ``min_tokens``
    tokens (or there is only one request)."""
    n = len(query_start_loc) - 1
    if n < 2:
        return None
    total = query_start_loc[-1] - query_start_loc[0]
    best: int | None = None
    best_gap = total + 1
    for r in range(1, n):
        left = query_start_loc[r] - query_start_loc[0]
        gap = abs(total - 2 * left)
        if gap < best_gap:
            best, best_gap = r, gap
    assert best is not None
    left = query_start_loc[best] - query_start_loc[0]
    if left < min_tokens or total - left < min_tokens:
        return None
    return best


@dataclass
class MicroBatch:
    """Tokens ``[start, end)`` of the batch and the forward-context entries to install
    while their attention runs (None: the batch's own)."""

    start: int
    end: int
    attn_metadata: dict[str, Any] | None = None
    slot_mapping: dict[str, torch.Tensor] | None = None

    @contextlib.contextmanager
    def installed(self, forward_context: Any) -> Iterator[None]:
        if self.attn_metadata is None:
            yield
            return
        saved = forward_context.attn_metadata, forward_context.slot_mapping
        forward_context.attn_metadata = self.attn_metadata
        forward_context.slot_mapping = self.slot_mapping
        try:
            yield
        finally:
            forward_context.attn_metadata, forward_context.slot_mapping = saved


def _slice_cpu_metadata(meta: Any, layer: Any, dtype: torch.dtype, req: slice,
                        tokens: tuple[int, int], enable_kv_split: bool) -> Any:
    from vllm._custom_ops import cpu_attn_get_scheduler_metadata

    qsl = meta.query_start_loc[req.start:req.stop + 1]
    qsl = qsl - qsl[0]
    seq_lens = meta.seq_lens[req]
    num_reqs = int(seq_lens.shape[0])
    lens = (qsl[1:] - qsl[:-1])
    sched = cpu_attn_get_scheduler_metadata(
        num_reqs=num_reqs, num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads,
        head_dim=layer.head_size, seq_lens=seq_lens, dtype=dtype, query_start_loc=qsl,
        causal=True, sliding_window_size=layer.impl.sliding_window, isa=layer.isa,
        enable_kv_split=enable_kv_split, kv_cache_dtype=layer.impl.kv_cache_dtype)
    return dataclasses.replace(
        meta, num_actual_tokens=tokens[1] - tokens[0], max_query_len=int(lens.max()),
        query_start_loc=qsl, max_seq_len=int(seq_lens.max()), seq_lens=seq_lens,
        block_table=meta.block_table[req], slot_mapping=meta.slot_mapping[tokens[0]:tokens[1]],
        scheduler_metadata=sched)


def cpu_attention_split(forward_context: Any, num_tokens: int, dtype: torch.dtype,
                        min_tokens: int) -> list[MicroBatch] | None:
    """Two micro-batches of this forward pass for vLLM's CPU attention, or None when it
    cannot or should not be split (see module doc)."""
    import vllm.envs as envs
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

    metas = getattr(forward_context, "attn_metadata", None)
    slots = getattr(forward_context, "slot_mapping", None)
    if not isinstance(metas, dict) or not metas or not isinstance(slots, dict):
        return None
    unique: dict[int, tuple[Any, str]] = {}
    for name, meta in metas.items():
        if (not isinstance(meta, CPUAttentionMetadata) or meta.causal is not True
                or meta.dynamic_causal is not None or meta.encoder_cache is not None
                or meta.use_sdpa_prefill):
            return None
        unique.setdefault(id(meta), (meta, name))
    first = next(iter(unique.values()))[0]
    qsl = first.query_start_loc.tolist()
    if any(m.query_start_loc.tolist() != qsl for m, _ in unique.values()):
        return None
    r = split_point(qsl, min_tokens)
    if r is None:
        return None
    cut, actual = qsl[r], qsl[-1]
    halves = ((slice(0, r), (0, cut)), (slice(r, len(qsl) - 1), (cut, actual)))
    out: list[MicroBatch] = []
    for req, tokens in halves:
        sliced = {key: _slice_cpu_metadata(meta, forward_context.no_compile_layers[name],
                                           dtype, req, tokens, envs.VLLM_CPU_ATTN_SPLIT_KV)
                  for key, (meta, name) in unique.items()}
        out.append(MicroBatch(
            start=tokens[0], end=tokens[1],
            attn_metadata={name: sliced[id(meta)] for name, meta in metas.items()},
            slot_mapping={name: s[tokens[0]:tokens[1]] for name, s in slots.items()}))
    out[-1].end = num_tokens  # padding rows (if any) ride with the last half
    return out
