"""``AfdMixtralForCausalLM``: vLLM's Mixtral with every layer's MoE block on FfnWorkers.

The engine holds attention, norms, embedding and LM head; router and experts live on
the FfnWorkers (whole layers, or expert groups in expert parallel: the connector adds
the groups' partial sums). Selected by ``hf_overrides={"architectures":
["AfdMixtralForCausalLM"], "afd_config_path": ...}``; loads the same checkpoint minus
the ``.block_sparse_moe.`` tensors. No pipeline parallel, LoRA or quantisation.
"""

from __future__ import annotations

from typing import Any

from vllm.config import VllmConfig
from vllm.model_executor.models.mixtral import MixtralAttention, MixtralModel

from dynagraph.llm.afd.models.base import AfdCausalLM, AfdDecoderModel, DecoderBlock


class AfdMixtralBlock(DecoderBlock):
    """``MixtralDecoderLayer`` without its ``block_sparse_moe`` (same submodule names)."""

    def __init__(self, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__(vllm_config)
        config: Any = vllm_config.model_config.hf_config
        self.self_attn = MixtralAttention(
            config=config, hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            max_position=config.max_position_embeddings,
            num_kv_heads=config.num_key_value_heads, cache_config=vllm_config.cache_config,
            quant_config=None, prefix=f"{prefix}.self_attn")


class AfdMixtralModel(AfdDecoderModel):
    BLOCK = AfdMixtralBlock
    FFN_PART = ".block_sparse_moe."
    HF_MAPPER = MixtralModel.hf_to_vllm_mapper

    @staticmethod
    def num_experts(config: Any) -> int:
        return int(config.num_local_experts)


class AfdMixtralForCausalLM(AfdCausalLM):
    """Mixtral for vLLM with attention-FFN disaggregation (see module doc)."""

    MODEL = AfdMixtralModel
