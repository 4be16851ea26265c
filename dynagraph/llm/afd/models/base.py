"""What the AFD models share: a decoder layer without its FFN, the layer stack that sends
each layer's FFN to the FfnWorkers, and the causal-LM wrapper vLLM loads. A model module
names its attention block, the checkpoint's FFN tensors and vLLM's name mapper."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.models.utils import AutoWeightsLoader, make_layers, maybe_prefix

from dynagraph.llm.afd.ffn import model_dtype
from dynagraph.llm.afd.models.common import AfdLayerLoop, make_connector, without_ffn


class DecoderBlock(nn.Module):
    """A decoder layer without its FFN (vLLM's submodule names): the subclass sets
    ``self_attn``; ``attend`` is the part of the layer before the FFN."""

    self_attn: nn.Module

    def __init__(self, vllm_config: VllmConfig) -> None:
        super().__init__()
        config: Any = vllm_config.model_config.hf_config
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def attend(self, positions: torch.Tensor, hidden: torch.Tensor,
               residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions=positions, hidden_states=hidden)
        return self.post_attention_layernorm(hidden, residual)  # type: ignore[no-any-return]


class AfdDecoderModel(nn.Module):
    """Embedding, the FFN-less layers run by ``AfdLayerLoop``, final norm."""

    BLOCK: ClassVar[type[DecoderBlock]]
    FFN_PART: ClassVar[str]
    """The checkpoint tensors that live on the FfnWorkers (``.mlp.``)."""
    HF_MAPPER: ClassVar[Any]

    @staticmethod
    def num_experts(config: Any) -> int:
        return 0

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config: Any = vllm_config.model_config.hf_config
        self.config = config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        block = self.BLOCK
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: block(vllm_config, prefix=prefix),  # type: ignore[call-arg]
            prefix=f"{prefix}.layers")
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.afd = AfdLayerLoop(
            make_connector(vllm_config, num_experts=self.num_experts(config)),
            model_dtype(vllm_config))

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        hidden = inputs_embeds if inputs_embeds is not None else self.embed_tokens(input_ids)
        blocks: list[Any] = list(self.layers)[self.start_layer:self.end_layer]
        hidden, residual = self.afd.run(blocks, self.start_layer, positions, hidden)
        out, _ = self.norm(hidden, residual)
        return out  # type: ignore[no-any-return]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loader = AutoWeightsLoader(self)
        return loader.load_weights(without_ffn(weights, self.FFN_PART), mapper=self.HF_MAPPER)


class AfdCausalLM(nn.Module):
    """The model plus vLLM's LM head and logits; no pipeline parallel."""

    MODEL: ClassVar[type[AfdDecoderModel]]

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config: Any = vllm_config.model_config.hf_config
        self.config = config
        self.model = self.MODEL(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=None,
                                      prefix=maybe_prefix(prefix, "lm_head"))
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size,
                                                scale=getattr(config, "logit_scale", 1.0))

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)  # type: ignore[no-any-return]

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor,
                intermediate_tensors: Any = None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        if intermediate_tensors is not None:
            raise NotImplementedError("AFD models do not support pipeline parallel")
        return self.model(input_ids, positions, inputs_embeds)  # type: ignore[no-any-return]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)  # type: ignore[no-any-return]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        tied = self.config.tie_word_embeddings
        loader = AutoWeightsLoader(self, ignore_unexpected_prefixes=["lm_head."] if tied else None)
        return loader.load_weights(weights)
