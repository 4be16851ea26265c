"""What the AFD model variants share: the connector set-up and the layer loop.

An AFD model keeps vLLM's embedding, attention (and so its KV cache and scheduling),
norms and LM head, and has no FFN weights at all: after each layer's
``post_attention_layernorm`` the hidden states go to the FfnWorkers through the
``AfdConnector`` and their FFN output comes back as that layer's output, exactly where
vLLM's decoder layer would have called its MLP / MoE block.

``AfdLayerLoop.run`` drives the layers, as one batch or as two micro-batches in
ping-pong (``microbatch``). Blocks provide ``attend(positions, hidden, residual) ->
(ffn_input, residual)``, i.e. the decoder layer up to the FFN.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from dynagraph.llm.afd.connector import AfdConnector, LayerCall
from dynagraph.llm.afd.ffn import model_dtype
from dynagraph.llm.afd.microbatch import MicroBatch, cpu_attention_split

log = logging.getLogger(__name__)

CONFIG_ATTR = "afd_config_path"
"""The ``hf_overrides`` key carrying the AFD file's path into the engine process."""


class AttentionBlock(Protocol):
    def attend(self, positions: torch.Tensor, hidden: torch.Tensor,
               residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]: ...


def make_connector(vllm_config: Any, num_experts: int) -> AfdConnector:
    """The engine's connector, from the model's ``hf_overrides`` (see ``CONFIG_ATTR``)."""
    hf = vllm_config.model_config.hf_config
    path = getattr(hf, CONFIG_ATTR, None)
    if not path:
        raise ValueError(
            f"{type(hf).__name__} has no {CONFIG_ATTR}: an AFD model needs the FfnWorkers' "
            f"addresses; serve it with graphs/agg_afd.py (VllmWorker with an FfnWorker "
            f"linked), which sets hf_overrides {{'{CONFIG_ATTR}': ...}}")
    return AfdConnector(
        path, num_layers=int(hf.num_hidden_layers), num_experts=num_experts,
        hidden_size=int(hf.hidden_size), dtype=model_dtype(vllm_config),
        max_rows=int(vllm_config.scheduler_config.max_num_batched_tokens))


def without_ffn(weights: Any, ffn_part: str) -> Any:
    """The checkpoint minus the FFN tensors (``.mlp.`` / ``.block_sparse_moe.``): the
    engine side never loads them."""
    for name, tensor in weights:
        if ffn_part not in name:
            yield name, tensor


class AfdLayerLoop:
    """Runs attention blocks with remote FFNs (one batch, or two in ping-pong)."""

    def __init__(self, connector: AfdConnector, dtype: torch.dtype) -> None:
        self.connector = connector
        self.dtype = dtype

    def _split(self, num_tokens: int) -> tuple[Any, list[MicroBatch] | None]:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if not self.connector.ping_pong or not is_forward_context_available():
            return None, None
        fc = get_forward_context()
        return fc, cpu_attention_split(fc, num_tokens, self.dtype,
                                       self.connector.microbatch_min_tokens)

    def run(self, layers: Sequence[AttentionBlock], first: int, positions: torch.Tensor,
            hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer's attention here and FFN remote; returns (hidden, residual) for
        the final norm. ``first`` is the index of ``layers[0]`` in the model."""
        conn = self.connector
        conn.refresh()
        fc, halves = self._split(int(hidden.shape[0]))
        conn.stats.forwards += 1
        if not halves:
            residual: torch.Tensor | None = None
            for i, block in enumerate(layers, start=first):
                h, residual = block.attend(positions, hidden, residual)
                hidden = conn.collect(conn.submit(i, h))
            assert residual is not None
            return hidden, residual
        conn.stats.microbatched_forwards += 1
        states: list[tuple[torch.Tensor, torch.Tensor | None]] = [
            (hidden[mb.start:mb.end], None) for mb in halves]
        calls: list[LayerCall | None] = [None] * len(halves)
        for i, block in enumerate(layers, start=first):
            for m, mb in enumerate(halves):
                h, res = states[m]
                prev = calls[m]
                if prev is not None:
                    h = conn.collect(prev)
                with mb.installed(fc):
                    h, res = block.attend(positions[mb.start:mb.end], h, res)
                calls[m] = conn.submit(i, h)
                states[m] = (h, res)
        outs: list[torch.Tensor] = []
        residuals: list[torch.Tensor] = []
        for m in range(len(halves)):
            call = calls[m]
            res = states[m][1]
            assert call is not None and res is not None
            outs.append(conn.collect(call))
            residuals.append(res)
        return torch.cat(outs), torch.cat(residuals)
