"""Build a tiny Mixtral-style MoE model by upcycling the tiny dense Llama.

    python -m tools.model_builder --moe [--out models/tiny-moe] [--force]

Training an MoE from scratch on two CPU cores gets nowhere in minutes (Hugging Face's
Mixtral ran ~10 s per step here), so the MoE model is *sparse-upcycled* from the trained
dense model (``tools.model_builder``, built first if missing): embeddings, attention
and norms are copied; every expert starts as the dense MLP with a seeded multiplicative
noise (``MoeSpec.expert_noise``), and the router is a seeded random projection. With
two experts per token and weights that sum to one, each layer's output stays close to
the dense MLP's, so the model writes the same kind of text as the dense one, while the
experts differ enough that routing and the expert split change the numbers (which is
what attention-FFN disaggregation with expert parallelism has to get right).

The directory has the dense build's files (tokenizer copied from the dense model) with
``architectures: ["MixtralForCausalLM"]``; ``dynagraph_build.json`` records the spec,
the dense build it came from (sha256 of its weights) and ``MOE_BUILD_FORMAT``. Same
atomic write and file lock as the dense build. vLLM loads it with its own Mixtral code.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tools.model_builder import (
    DEFAULT_OUT,
    BuildSpec,
    build_atomically,
    ensure_model,
    is_complete,
    locked,
)

log = logging.getLogger(__name__)

DEFAULT_MOE_OUT = Path("models/tiny-moe")
MOE_BUILD_FORMAT = 1
"""Bumped when the MoE output changes; older MoE builds are rebuilt."""

_COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json")


@dataclass(frozen=True)
class MoeSpec:
    """Everything that determines the MoE model beyond the dense build it comes from.

    Hidden (256) and intermediate (the dense 512) sizes are multiples of 32, which vLLM's
    CPU MoE kernel needs."""

    num_local_experts: int = 4
    num_experts_per_tok: int = 2
    expert_noise: float = 0.2
    """Each expert weight is the dense weight times (1 + expert_noise * N(0, 1))."""
    router_std: float = 0.05
    """Standard deviation of the random router weights."""
    seed: int = 0


def _mixtral_config(dense: dict[str, Any], moe: MoeSpec) -> Any:
    from transformers import MixtralConfig

    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
            "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "eos_token_id",
            "pad_token_id", "head_dim")
    settings: dict[str, Any] = {k: dense[k] for k in keep if k in dense}
    settings.update(
        num_local_experts=moe.num_local_experts,
        num_experts_per_tok=moe.num_experts_per_tok,
        rope_theta=float((dense.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
        dtype="bfloat16",
    )
    return MixtralConfig(**settings)


def upcycle_state_dict(dense: dict[str, Any], num_layers: int, moe: MoeSpec,
                       hidden_size: int) -> dict[str, Any]:
    """The Mixtral checkpoint tensors (Hugging Face names) made from a dense Llama's.

    Pure tensor arithmetic (seeded), so the same dense weights and spec give the same
    MoE weights."""
    import torch

    gen = torch.Generator().manual_seed(moe.seed)
    out: dict[str, Any] = {}
    for name, tensor in dense.items():
        if ".mlp." not in name:
            out[name] = tensor.clone()
    for layer in range(num_layers):
        src = f"model.layers.{layer}.mlp."
        dst = f"model.layers.{layer}.block_sparse_moe."
        parts = {"w1": dense[src + "gate_proj.weight"], "w3": dense[src + "up_proj.weight"],
                 "w2": dense[src + "down_proj.weight"]}
        for expert in range(moe.num_local_experts):
            for wname, weight in parts.items():
                w = weight.float()
                noise = torch.randn(w.shape, generator=gen) * moe.expert_noise
                out[f"{dst}experts.{expert}.{wname}.weight"] = (w * (1 + noise)).to(weight.dtype)
        gate = torch.randn((moe.num_local_experts, hidden_size), generator=gen) * moe.router_std
        out[f"{dst}gate.weight"] = gate.to(parts["w1"].dtype)
    return out


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _build_into(tmp: Path, dense_dir: Path, moe: MoeSpec) -> dict[str, Any]:
    from safetensors.torch import load_file, save_file

    dense_cfg = json.loads((dense_dir / "config.json").read_text())
    config = _mixtral_config(dense_cfg, moe)
    dense = load_file(str(dense_dir / "model.safetensors"))
    tensors = upcycle_state_dict(dense, int(dense_cfg["num_hidden_layers"]), moe,
                                 int(dense_cfg["hidden_size"]))
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"),
              metadata={"format": "pt"})
    config.architectures = ["MixtralForCausalLM"]
    config.save_pretrained(tmp)
    for name in _COPIED_FILES:
        shutil.copyfile(dense_dir / name, tmp / name)
    info = {
        "format": MOE_BUILD_FORMAT,
        "moe": asdict(moe),
        "upcycled_from": str(dense_dir),
        "dense_weights_sha256": _sha256(dense_dir / "model.safetensors"),
        "dense_build": json.loads((dense_dir / "dynagraph_build.json").read_text()),
    }
    (tmp / "dynagraph_build.json").write_text(json.dumps(info, indent=2) + "\n")
    return info


def ensure_moe_model(
    out: Path | str = DEFAULT_MOE_OUT, moe: MoeSpec | None = None, *, force: bool = False,
    dense_dir: Path | str | None = None, dense_spec: BuildSpec | None = None,
) -> Path:
    """Build the MoE model into ``out`` unless a complete build is already there.

    The dense model comes from ``dense_dir`` (default: ``models/tiny-llama`` next to
    ``out``), built with ``dense_spec`` if missing. Safe to call from several processes
    at once; returns the absolute path."""
    moe = moe or MoeSpec()
    out = Path(out).resolve()
    dense = Path(dense_dir) if dense_dir is not None else out.parent / DEFAULT_OUT.name
    dense = ensure_model(dense, dense_spec)
    out.parent.mkdir(parents=True, exist_ok=True)
    with locked(out):
        if is_complete(out, MOE_BUILD_FORMAT) and not force:
            log.debug("MoE model already built at %s", out)
            return out
        start = time.monotonic()
        build_atomically(out, lambda tmp: _build_into(tmp, dense, moe))
        log.info("built %s from %s in %.1fs", out, dense, time.monotonic() - start)
        return out
