"""The AFD pieces that run inside vLLM: the plugin as vLLM loads it, the routing rule,
and the FfnWorker's expert-parallel compute against its whole-layer compute."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.paths import REPO
from tools.entry_points import shim_path

pytestmark = pytest.mark.vllm

PROBE = """
import json, sys
from vllm.plugins import load_general_plugins
from vllm import ModelRegistry
load_general_plugins()
archs = set(ModelRegistry.get_supported_archs())
print(json.dumps({
    "afd": sorted(a for a in archs if a.startswith("Afd")),
    "llama_still_there": "LlamaForCausalLM" in archs,
    "models_imported": [m for m in sys.modules if m.startswith("dynagraph.llm.afd.models")],
}))
"""


def test_vllm_loads_the_plugin_from_the_entry_point(tmp_path: Path) -> None:
    env = {**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"}
    shim = shim_path(tmp_path)
    if shim is not None:  # this checkout's entry point is not installed yet
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim), env.get("PYTHONPATH")]))
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=300, check=True)
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert found == {"afd": ["AfdLlamaForCausalLM", "AfdMixtralForCausalLM"],
                     "llama_still_there": True, "models_imported": []}  # lazy, inert


def test_routing_rule_is_vllms_cpu_router() -> None:
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    from dynagraph.llm.afd.ffn import softmax_topk

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 8, generator=g).to(torch.bfloat16)
    router = CPURouter(top_k=2, global_num_experts=8, renormalize=True)
    want_w, want_ids = router._compute_routing(torch.empty(0), logits, None)
    got_w, got_ids = softmax_topk(logits, 2)
    assert torch.equal(got_ids, want_ids.to(torch.int32)) and torch.equal(got_w, want_w)


def test_expert_groups_add_up_to_the_whole_layer(model_dir: Path) -> None:
    from dynagraph.llm.afd.ffn import VllmFfn, softmax_topk
    from tools.moe_builder import ensure_moe_model

    moe = ensure_moe_model(model_dir.parent / "tiny-moe", dense_dir=model_dir)
    whole = VllmFfn(moe, [1])
    low, high = VllmFfn(moe, [1], experts=[0, 1]), VllmFfn(moe, [1], experts=[2, 3])
    assert (whole.experts, low.experts, high.experts) == (None, [0, 1], [2, 3])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, whole.hidden_size, generator=g).to(whole.dtype)
    ref = whole.forward(1, x)
    a, b = low.forward(1, x).float(), high.forward(1, x).float()
    summed = (a + b).to(whole.dtype)
    logits, _ = low._ep[1].gate(x)
    _, ids = softmax_topk(logits, 2)
    together = (ids < 2).all(dim=1) | (ids >= 2).all(dim=1)
    assert together.any() and (~together).any()
    # a token whose two experts live on one worker gets exactly the monolithic value
    assert torch.equal(summed[together], ref[together])
    # a split token: each worker's partial is rounded to bfloat16 before the sum (half a
    # unit in the last place of each partial), against the kernel's single rounding
    split = ~together
    diff = (summed[split].float() - ref[split].float()).abs()
    bound = (a[split].abs() + b[split].abs() + ref[split].float().abs()) * 2**-8 + 2**-30
    assert (diff <= bound).all() and diff.max() > 0
