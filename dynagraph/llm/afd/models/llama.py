"""``AfdLlamaForCausalLM``: vLLM's Llama with every layer's MLP on FfnWorkers.

Registered by the plugin (``dynagraph.llm.afd.plugin``) and selected by
``hf_overrides={"architectures": ["AfdLlamaForCausalLM"], "afd_config_path": ...}``.
Attention, KV cache, norms, embedding and LM head are vLLM's own classes with vLLM's
parameter names, so the same checkpoint loads (minus the ``.mlp.`` tensors).
Pipeline parallel, LoRA and quantisation are not supported.
"""

from __future__ import annotations

from typing import Any

from vllm.config import VllmConfig
from vllm.model_executor.models.llama import LlamaAttention, LlamaModel
from vllm.v1.attention.backend import AttentionType

from dynagraph.llm.afd.models.base import AfdCausalLM, AfdDecoderModel, DecoderBlock


class AfdLlamaBlock(DecoderBlock):
    """``LlamaDecoderLayer`` without its MLP (same submodule names)."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config)
        config: Any = vllm_config.model_config.hf_config
        bias = getattr(config, "attention_bias", False) or getattr(config, "bias", False)
        self.self_attn = LlamaAttention(
            config=config, hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", config.num_attention_heads),
            max_position_embeddings=getattr(config, "max_position_embeddings", 8192),
            quant_config=None, bias=getattr(config, "qkv_bias", bias), bias_o_proj=bias,
            cache_config=vllm_config.cache_config, prefix=f"{prefix}.self_attn",
            attn_type=AttentionType.DECODER)


class AfdLlamaModel(AfdDecoderModel):
    BLOCK = AfdLlamaBlock
    FFN_PART = ".mlp."
    HF_MAPPER = LlamaModel.hf_to_vllm_mapper


class AfdLlamaForCausalLM(AfdCausalLM):
    """Llama for vLLM with attention-FFN disaggregation (see module doc)."""

    MODEL = AfdLlamaModel
