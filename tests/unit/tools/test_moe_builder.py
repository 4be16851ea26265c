"""The MoE model is upcycled from the dense one: seeded, complete, loadable names."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tools.moe_builder import MOE_BUILD_FORMAT, MoeSpec, _build_into, upcycle_state_dict


def dense_tensors(layers: int = 2, hidden: int = 8, inter: int = 16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    out = {"model.embed_tokens.weight": torch.randn(32, hidden, generator=g),
           "model.norm.weight": torch.ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = torch.randn(hidden, hidden, generator=g)
        out[p + "mlp.gate_proj.weight"] = torch.randn(inter, hidden, generator=g)
        out[p + "mlp.up_proj.weight"] = torch.randn(inter, hidden, generator=g)
        out[p + "mlp.down_proj.weight"] = torch.randn(hidden, inter, generator=g)
    return {k: v.to(torch.bfloat16) for k, v in out.items()}


def test_experts_are_noisy_copies_of_the_dense_mlp_and_the_rest_is_kept() -> None:
    dense = dense_tensors()
    spec = MoeSpec(num_local_experts=3, expert_noise=0.1)
    moe = upcycle_state_dict(dense, 2, spec, hidden_size=8)
    assert not any(".mlp." in k for k in moe)
    assert torch.equal(moe["model.layers.1.self_attn.q_proj.weight"],
                       dense["model.layers.1.self_attn.q_proj.weight"])
    w1 = [moe[f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight"] for e in range(3)]
    base = dense["model.layers.0.mlp.gate_proj.weight"].float()
    for w in w1:
        rel = (w.float() - base).abs().sum() / base.abs().sum()
        assert 0.02 < rel < 0.2  # close to the dense MLP, not equal to it
    assert not torch.equal(w1[0], w1[1])
    assert moe["model.layers.1.block_sparse_moe.gate.weight"].shape == (3, 8)
    again = upcycle_state_dict(dense, 2, spec, hidden_size=8)
    assert all(torch.equal(moe[k], again[k]) for k in moe)  # seeded


def test_build_writes_a_mixtral_directory(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    dense = tmp_path / "dense"
    dense.mkdir()
    save_file({k: v.contiguous() for k, v in dense_tensors().items()},
              str(dense / "model.safetensors"))
    (dense / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 32, "hidden_size": 8,
        "intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "max_position_embeddings": 64, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": [1],
        "pad_token_id": 2, "head_dim": 4, "rope_parameters": {"rope_theta": 10000.0}}))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json"):
        (dense / name).write_text("{}")
    (dense / "dynagraph_build.json").write_text(json.dumps({"format": 2}))
    out = tmp_path / "moe"
    out.mkdir()
    info = _build_into(out, dense, MoeSpec(num_local_experts=2))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["MixtralForCausalLM"]
    assert (cfg["num_local_experts"], cfg["num_experts_per_tok"]) == (2, 2)
    assert cfg["intermediate_size"] == 16 and cfg["head_dim"] == 4
    assert info["format"] == MOE_BUILD_FORMAT and info["dense_build"] == {"format": 2}
    assert (out / "tokenizer.json").exists()
