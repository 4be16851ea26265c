"""What each FfnWorker of a component holds, from its config and worker index."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from components.ffn_worker import FfnWorker, FfnWorkerConfig
from dynagraph.errors import ConfigError
from dynagraph.sdk import RuntimeContext


def model(tmp_path: Path, arch: str = "MixtralForCausalLM") -> str:
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": [arch], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_local_experts": 4, "num_experts_per_tok": 2}))
    return str(tmp_path)


def worker(cfg: dict[str, object], index: int) -> FfnWorker:
    runtime = RuntimeContext.standalone("dynamo", "FfnWorker")
    runtime.worker_index = index
    return FfnWorker(FfnWorkerConfig.model_validate(cfg), runtime=runtime)


def test_workers_split_experts_by_index(tmp_path: Path) -> None:
    cfg = {"model": model(tmp_path), "split": "experts", "shards": 2}
    held = [(w.layers, w.experts) for w in (worker(cfg, i) for i in range(3))]
    assert held == [([0, 1, 2, 3], [0, 1]), ([0, 1, 2, 3], [2, 3]), ([0, 1, 2, 3], [0, 1])]


def test_workers_split_layers_by_index(tmp_path: Path) -> None:
    cfg = {"model": model(tmp_path, "LlamaForCausalLM"), "split": "layers", "shards": 2,
           "layers": "1-3"}
    assert [worker(cfg, i).layers for i in range(2)] == [[1, 2], [3]]


def test_impossible_holdings_are_config_errors(tmp_path: Path) -> None:
    dense = model(tmp_path, "LlamaForCausalLM")
    with pytest.raises(ConfigError, match="dense"):
        worker({"model": dense, "split": "experts", "shards": 2}, 0)
    with pytest.raises(ConfigError, match="layers"):
        worker({"model": dense, "layers": "4-5"}, 0)
    with pytest.raises(ConfigError, match="not split by AFD"):
        worker({"model": model(tmp_path / ".." / tmp_path.name, "GPT2LMHeadModel")}, 0)
