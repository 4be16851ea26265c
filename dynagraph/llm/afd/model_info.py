"""What the AFD pieces need to know about a model, from its ``config.json`` (no torch:
a decode worker reads it at import-light start-up)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from dynagraph.errors import ConfigError

Arch = Literal["llama", "mixtral"]
_ARCHS: dict[str, Arch] = {"LlamaForCausalLM": "llama", "MixtralForCausalLM": "mixtral",
                           "AfdLlamaForCausalLM": "llama", "AfdMixtralForCausalLM": "mixtral"}


@dataclass(frozen=True)
class FfnModelInfo:
    """What the AFD pieces need to know about a model (from its ``config.json``)."""

    name: str
    """The model directory's name: both sides of a connection must agree on it."""
    arch: Arch
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_experts: int
    """0 for a dense model."""
    top_k: int
    dtype: str

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def ffn_prefix(self, layer: int) -> str:
        """Checkpoint name prefix of one layer's FFN."""
        part = "block_sparse_moe" if self.arch == "mixtral" else "mlp"
        return f"model.layers.{layer}.{part}."


def read_model_info(model_dir: str | Path) -> FfnModelInfo:
    """Read ``config.json``; ConfigError for an architecture AFD does not split."""
    path = Path(model_dir)
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path / 'config.json'}: {exc}", key="model") from exc
    archs = [a for a in cfg.get("architectures") or [] if a in _ARCHS]
    if not archs:
        raise ConfigError(f"{path}: architectures {cfg.get('architectures')} are not split by "
                          f"AFD (known: {sorted(_ARCHS)})", key="model")
    arch = _ARCHS[archs[0]]
    dtype = str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
    return FfnModelInfo(
        name=path.resolve().name, arch=arch, hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_experts=int(cfg.get("num_local_experts", 0)) if arch == "mixtral" else 0,
        top_k=int(cfg.get("num_experts_per_tok", 0)) if arch == "mixtral" else 0,
        dtype=dtype,
    )


__all__ = ["Arch", "FfnModelInfo", "read_model_info"]
