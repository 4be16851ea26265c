"""The FfnWorker's compute: vLLM's own FFN / MoE modules for some layers or experts.

Exactness contract (``../shared/DESIGN.md``): an FfnWorker computes with the same dtype
and kernels as the monolithic model, so greedy tokens match. So the modules here are
vLLM's own classes (``LlamaMLP``, ``MixtralMoE``), built under a vLLM config made from
the same model directory, loaded through vLLM's weight loaders and post-processed by
vLLM's ``process_weights_after_loading`` (oneDNN / prepacked MoE weights on the CPU),
exactly as the engine would. Only the checkpoint tensors of the layers (and experts)
this worker holds are read.

Expert parallel (``experts`` set): the worker holds some experts of each of its
layers and returns its *partial* sum; the engine adds the partials of all expert
groups. Routing uses vLLM's own gate module and the CPU router's rule (top-k over the
logits, softmax over the chosen ones), and the experts run in vLLM's fused CPU MoE
kernel. A token whose chosen experts all live on one worker gets exactly the monolithic
value; a token whose experts are split gets each worker's bf16 partial, summed in
float32 by the engine: one extra rounding against the kernel's single float32 sum.

Importing this module does not import vLLM; ``VllmFfn(...)`` does.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import torch

from dynagraph.errors import ConfigError
from dynagraph.llm.afd.model_info import read_model_info

log = logging.getLogger(__name__)

def model_dtype(vllm_config: Any) -> torch.dtype:
    """The resolved dtype of a vLLM config's model (a ``torch.dtype`` once built)."""
    dtype = vllm_config.model_config.dtype
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"model dtype {dtype!r} is not resolved")
    return dtype


def softmax_topk(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's CPU routing rule for Mixtral-style renormalised softmax routing: the top-k
    logits (unsorted), softmax over them; float32 weights, int32 expert ids."""
    vals, idx = torch.topk(logits, k=top_k, dim=-1, sorted=False)
    return torch.softmax(vals, dim=-1).to(torch.float32), idx.to(torch.int32)


def _checkpoint_tensors(model_dir: Path, wanted: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint tensors whose name satisfies ``wanted(name)``, nothing else read."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        files = sorted({f for n, f in weight_map.items() if wanted(n)})
    else:
        files = ["model.safetensors"]
    for fname in files:
        with safe_open(str(model_dir / fname), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open is not a mapping
                if wanted(name):
                    yield name, fh.get_tensor(name)


class _VllmContext:
    """A vLLM config made current for this process, with a one-rank process group:
    what vLLM's layers need to be built and run outside an engine."""

    def __init__(self, model_dir: Path, dtype: str, max_model_len: int) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm.config import set_current_vllm_config
        from vllm.distributed import (
            ensure_model_parallel_initialized,
            init_distributed_environment,
        )
        from vllm.engine.arg_utils import EngineArgs

        from dynagraph.runtime.infra import free_port

        args = EngineArgs(model=str(model_dir), dtype=cast(Any, dtype), enforce_eager=True,
                          max_model_len=max_model_len)
        self.config = args.create_engine_config()
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(set_current_vllm_config(self.config))
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}")
        ensure_model_parallel_initialized(1, 1)

    @property
    def dtype(self) -> torch.dtype:
        return model_dtype(self.config)

    def forward_context(self) -> Any:
        from vllm.forward_context import set_forward_context

        return set_forward_context(None, self.config)


class VllmFfn:
    """``FfnCompute`` over vLLM's modules for ``layers`` (and ``experts``) of a model."""

    def __init__(self, model_dir: str | Path, layers: list[int], experts: list[int] | None = None,
                 *, threads: int | None = None, dtype: str = "auto",
                 max_model_len: int = 2048) -> None:
        self.model_dir = Path(model_dir)
        self.info = read_model_info(self.model_dir)
        bad = [layer for layer in layers if not 0 <= layer < self.info.num_layers]
        if bad or not layers:
            raise ConfigError(f"layers {layers} are not layers of {self.info.name} "
                              f"(0..{self.info.num_layers - 1})", key="layers")
        if experts is not None:
            if not self.info.is_moe:
                raise ConfigError(f"{self.info.name} is dense: it has no experts to split",
                                  key="experts")
            if not experts or any(not 0 <= e < self.info.num_experts for e in experts):
                raise ConfigError(f"experts {experts} are not experts of {self.info.name} "
                                  f"(0..{self.info.num_experts - 1})", key="experts")
            if sorted(set(experts)) == list(range(self.info.num_experts)):
                experts = None  # every expert: the plain (exact) MoE module
        self.model = self.info.name
        self.hidden_size = self.info.hidden_size
        self.layers = sorted(set(layers))
        self.experts = None if experts is None else sorted(set(experts))
        self.threads = threads
        self._threaded: set[int] = set()
        self._apply_threads()
        self._ctx = _VllmContext(self.model_dir, dtype, max_model_len)
        self.dtype = self._ctx.dtype
        self._modules: dict[int, torch.nn.Module] = {}
        self._ep: dict[int, _ExpertShard] = {}
        if self.experts is None:
            self._build_whole()
        else:
            self._build_expert_shards(self.experts)

    # ------------------------------------------------------------------ building

    def _build_whole(self) -> None:
        from vllm.model_executor.model_loader.utils import process_weights_after_loading
        from vllm.model_executor.models.utils import AutoWeightsLoader
        from vllm.utils.torch_utils import set_default_torch_dtype

        info = self.info
        root = torch.nn.Module()
        model = torch.nn.Module()
        layers = torch.nn.ModuleDict()
        with set_default_torch_dtype(self.dtype), torch.device("cpu"):
            for layer in self.layers:
                holder = torch.nn.Module()
                prefix = info.ffn_prefix(layer).rstrip(".")
                if info.arch == "llama":
                    from vllm.model_executor.models.llama import LlamaMLP

                    holder.mlp = LlamaMLP(info.hidden_size, info.intermediate_size, "silu",
                                          quant_config=None, prefix=prefix)
                    self._modules[layer] = holder.mlp
                else:
                    from vllm.model_executor.models.mixtral import MixtralMoE

                    holder.block_sparse_moe = MixtralMoE(
                        num_experts=info.num_experts, top_k=info.top_k,
                        hidden_size=info.hidden_size, intermediate_size=info.intermediate_size,
                        quant_config=None, prefix=prefix)
                    self._modules[layer] = holder.block_sparse_moe
                layers[str(layer)] = holder
        model.layers = layers
        root.model = model
        prefixes = tuple(info.ffn_prefix(layer) for layer in self.layers)
        mapper = self._mapper()
        loaded = AutoWeightsLoader(root).load_weights(
            _checkpoint_tensors(self.model_dir, lambda n: n.startswith(prefixes)), mapper=mapper)
        missing = {n for n, _ in root.named_parameters()} - set(loaded)
        if missing:
            raise ConfigError(f"{self.model_dir}: checkpoint lacks {sorted(missing)[:4]}",
                              key="model")
        process_weights_after_loading(root, self._ctx.config.model_config, torch.device("cpu"))
        self._root = root
        log.info("loaded the FFN of layers %s of %s (%s, %d tensors)", self.layers, info.name,
                 self.dtype, len(loaded))

    def _mapper(self) -> Any:
        if self.info.arch == "llama":
            from vllm.model_executor.models.llama import LlamaModel

            return LlamaModel.hf_to_vllm_mapper
        from vllm.model_executor.models.mixtral import MixtralModel

        return MixtralModel.hf_to_vllm_mapper

    def _build_expert_shards(self, experts: list[int]) -> None:
        for layer in self.layers:
            self._ep[layer] = _ExpertShard(self, layer, experts)
        log.info("loaded experts %s of layers %s of %s (%s)", experts, self.layers,
                 self.info.name, self.dtype)

    # ------------------------------------------------------------------ compute

    def _apply_threads(self) -> None:
        """OpenMP's thread count is per calling thread: a server thread would run
        oneDNN's kernels with the machine's core count (oversubscribing the cores, or a
        ``cpus`` affinity) unless set there too."""
        ident = threading.get_ident()
        if self.threads and ident not in self._threaded:
            torch.set_num_threads(self.threads)
            self._threaded.add(ident)

    def forward(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """This worker's FFN output for ``layer`` (a partial sum under expert parallel)."""
        self._apply_threads()
        with torch.inference_mode(), self._ctx.forward_context():
            if self.experts is None:
                module = self._modules.get(layer)
                if module is None:
                    raise ValueError(f"layer {layer} is not served here (layers {self.layers})")
                out: torch.Tensor = module(hidden)
                return out
            shard = self._ep.get(layer)
            if shard is None:
                raise ValueError(f"layer {layer} is not served here (layers {self.layers})")
            return shard.forward(hidden)


class _ExpertShard:
    """Some experts of one MoE layer: vLLM's gate, the CPU router rule, and vLLM's
    fused CPU MoE kernel over this shard's prepacked expert weights."""

    def __init__(self, ffn: VllmFfn, layer: int, experts: list[int]) -> None:
        from vllm._custom_ops import cpu_prepack_moe_weight
        from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
        from vllm.model_executor.model_loader.utils import process_weights_after_loading
        from vllm.utils.torch_utils import set_default_torch_dtype

        info = ffn.info
        if info.intermediate_size % 32 or info.hidden_size % 32:
            raise ConfigError("expert parallel needs hidden and intermediate sizes that are "
                              "multiples of 32 (vLLM's CPU MoE kernel)", key="experts")
        prefix = info.ffn_prefix(layer)
        local = {e: i for i, e in enumerate(experts)}
        tensors = dict(_checkpoint_tensors(
            ffn.model_dir,
            lambda n: n == prefix + "gate.weight" or any(
                n.startswith(f"{prefix}experts.{e}.") for e in experts)))
        with set_default_torch_dtype(ffn.dtype), torch.device("cpu"):
            gate: Any = GateLinear(info.hidden_size, info.num_experts, prefix=prefix + "gate")
        gate.weight.data.copy_(tensors[prefix + "gate.weight"])
        process_weights_after_loading(gate, ffn._ctx.config.model_config, torch.device("cpu"))
        self.gate = gate
        w13 = torch.stack([torch.cat([tensors[f"{prefix}experts.{e}.w1.weight"],
                                      tensors[f"{prefix}experts.{e}.w3.weight"]])
                           for e in experts]).to(ffn.dtype).contiguous()
        w2 = torch.stack([tensors[f"{prefix}experts.{e}.w2.weight"]
                          for e in experts]).to(ffn.dtype).contiguous()
        self.isa = ("amx" if torch.cpu._is_amx_tile_supported() and ffn.dtype == torch.bfloat16
                    else "vec")
        self.w13 = cpu_prepack_moe_weight(w13, self.isa)
        self.w2 = cpu_prepack_moe_weight(w2, self.isa)
        self.top_k = info.top_k
        self.local_of = torch.full((info.num_experts,), -1, dtype=torch.int32)
        for e, i in local.items():
            self.local_of[e] = i

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from vllm._custom_ops import cpu_fused_moe

        logits, _ = self.gate(hidden)
        weights, ids = softmax_topk(logits, self.top_k)
        local = self.local_of[ids.long()]
        mine = local >= 0
        count = mine.sum(dim=1)
        out = torch.zeros_like(hidden)
        for k in range(1, self.top_k + 1):
            rows = (count == k).nonzero().flatten()
            if rows.numel() == 0:
                continue
            sel = mine[rows]
            ids_k = local[rows][sel].view(-1, k).to(torch.int32).contiguous()
            w_k = weights[rows][sel].view(-1, k).to(torch.float32).contiguous()
            x = hidden[rows].contiguous()
            y = torch.empty_like(x)
            cpu_fused_moe(y, x, self.w13, self.w2, None, None, w_k, ids_k, "silu", self.isa,
                          False)
            out[rows] = y
        return out
