"""Which models live workers serve, from their discovery metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dynagraph.llm.engines.vllm.args import VllmEngineArgs
from dynagraph.llm.models import ModelDirectory, served_model_metadata, served_models


@dataclass
class Inst:
    instance_id: int
    metadata: dict[str, Any] = field(default_factory=dict)


def test_worker_metadata() -> None:
    meta = served_model_metadata(VllmEngineArgs(model="models/tiny-llama/"), 4096)
    assert meta == {"model": "tiny-llama", "model_path": "models/tiny-llama/",
                    "max_model_len": 4096, "max_logprobs": 20, "structured_outputs": True}
    named = served_model_metadata(VllmEngineArgs(
        model="m", served_model_name="x", structured_outputs_backend="none"), 10)
    assert named["model"] == "x" and named["structured_outputs"] is False


def test_grouping_and_strictest_limits() -> None:
    a = {"model": "a", "model_path": "/a", "max_model_len": 4096, "max_logprobs": 20,
         "structured_outputs": True}
    models = served_models([Inst(1, a), Inst(2, {**a, "max_model_len": 1024,
                                                  "max_logprobs": -1}),
                            Inst(3, {"model": "b", "max_logprobs": 5}), Inst(4, {})],
                           default_name="legacy")
    assert list(models) == ["a", "b", "legacy"]
    assert models["a"].instance_ids == (1, 2) and models["a"].max_model_len == 1024
    assert models["a"].max_logprobs == 20 and models["a"].structured_outputs
    assert models["b"].path is None and not models["b"].structured_outputs
    assert models["legacy"].max_logprobs is None  # a worker that says nothing: no logprobs
    assert served_models([Inst(4, {})]) == {}


def test_directory_recomputes_only_when_the_instances_change() -> None:
    d = ModelDirectory("legacy")
    one = [Inst(1, {"model": "a"})]
    first = d.models(one)
    assert d.models(list(one)) is first  # same records: the same answer
    two = [*one, Inst(2, {"model": "b"})]
    assert list(d.models(two)) == ["a", "b"]
    assert list(d.models([Inst(1, {"model": "c"})])) == ["c"]  # a record replaced


async def test_a_cached_preprocessor_follows_the_model_s_live_workers(
        tiny_tokenizer_dir: Path) -> None:
    from dynagraph.llm.model_tokenizers import PreprocessorCache
    from dynagraph.llm.models import ServedModel

    cache = PreprocessorCache(str(tiny_tokenizer_dir))
    before = ServedModel("m", None, None, None, False, instance_ids=(1, 2))
    after = ServedModel("m", None, None, None, False, instance_ids=(2, 3))  # 1 died, 3 joined
    first, second = await cache.get(before), await cache.get(after)
    assert second.preprocessor is first.preprocessor  # built once
    assert second.model.instance_ids == (2, 3)
