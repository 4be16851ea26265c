"""Graph and config checks of ``dynamo simulate``: as ``dynamo serve`` resolves them, plus
refusals of what is not simulated (naming the component)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynagraph.errors import ConfigError, GraphError
from dynagraph.simulate.run import load_plan

CONFIG = """
Common:
  model: models/tiny-llama
  max-model-len: 4096
  block-size: 16
Processor:
  common-configs: [model, max-model-len]
  router-mode: kv
Router:
  common-configs: [block-size]
MockerWorker:
  common-configs: [max-model-len, block-size]
  profile: h200-llama8b-bf16
  num-gpu-blocks: 2048
  publish-kv-events: true
  engines-per-process: 3
  ServiceArgs:
    workers: 2
"""


@pytest.fixture
def config(tmp_path: Path) -> str:
    path = tmp_path / "sim.yaml"
    path.write_text(CONFIG)
    return str(path)


def test_the_engine_count_and_keys_come_from_the_served_config(config: str) -> None:
    plan = load_plan("graphs.mocker_router", config, ("--Processor.max-model-len=3000",))
    assert plan.engines == 6  # ServiceArgs.workers x engines-per-process
    assert plan.mode == "kv" and plan.max_model_len == 3000
    assert plan.engine_args.num_gpu_blocks == 2048 and plan.publish_kv_events
    assert plan.router is not None and plan.router.block_size == 16
    assert not plan.notes
    assert load_plan("graphs.mocker_router:Frontend", config).engines == 6


def test_a_bad_key_names_file_component_and_key(config: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_plan("graphs.mocker_router", config, ("--Router.overlap-wieght=2",))
    assert err.value.file == config and err.value.component == "Router"
    assert err.value.key == "overlap-wieght"
    bad = tmp_path / "bad.yaml"
    bad.write_text(CONFIG.replace("router-mode: kv", "router-mode: fastest"))
    with pytest.raises(ConfigError, match=rf"file {bad}, component Processor, key 'router-mode'"):
        load_plan("graphs.mocker_router", str(bad))


def test_a_router_mode_the_processor_overrides_is_noted(config: str) -> None:
    plan = load_plan("graphs.mocker_router", config, ("--Router.mode=round-robin",))
    assert plan.mode == "kv"
    assert any("Router.mode (round-robin) has no effect" in n for n in plan.notes)
    assert load_plan("graphs.mocker_router", config,
                     ("--Processor.router-mode=round-robin",)).mode == "round-robin"


def test_unsimulated_features_are_refused(config: str) -> None:
    with pytest.raises(ConfigError, match="component MockerWorker, key 'remote-prefill'"):
        load_plan("graphs.mocker_router", config, ("--MockerWorker.remote-prefill=true",))


@pytest.mark.parametrize(("target", "says"), [
    ("graphs.agg", "component VllmWorker runs a real engine (vLLM)"),
    ("graphs.mocker_disagg", "component MockerPrefillWorker (disaggregated prefill) is not "
                             "simulated yet"),
    ("graphs.no_such_graph", "cannot import 'graphs.no_such_graph'"),
])
def test_graphs_it_does_not_run_are_refused_by_name(target: str, says: str) -> None:
    with pytest.raises(GraphError, match=says.replace("(", r"\(").replace(")", r"\)")):
        load_plan(target, None)


def test_the_frontends_admission_keys_and_too_few_kv_blocks(config: str) -> None:
    plan = load_plan("graphs.mocker_router", config, ("--Frontend.max-inflight-requests=8",
                                                      "--Frontend.queue-timeout=2"))
    assert (plan.max_inflight, plan.max_queued, plan.queue_timeout_s) == (8, 512, 2.0)
    with pytest.raises(ConfigError) as err:
        load_plan("graphs.mocker_router", config, ("--MockerWorker.num-gpu-blocks=100",))
    assert (err.value.component, err.value.key) == ("MockerWorker", "num-gpu-blocks")
    assert "cannot hold one request of max-model-len 4096" in str(err.value)


def test_the_agg_graph_routes_round_robin_as_its_processor_does(tmp_path: Path) -> None:
    path = tmp_path / "agg.yaml"
    path.write_text("Processor: {model: m, router-mode: kv}\n"
                    "MockerWorker: {profile: h200-llama8b-bf16, num-gpu-blocks: 4096}\n")
    plan = load_plan("graphs.mocker_agg", str(path))
    assert plan.mode == "round-robin" and plan.router is None and plan.engines == 1
    assert any("has no Router" in n for n in plan.notes)
