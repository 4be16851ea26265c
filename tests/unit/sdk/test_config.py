from __future__ import annotations

from pathlib import Path

import pytest

from dynagraph.errors import ConfigError
from dynagraph.sdk import resolve_config
from dynagraph.sdk._config import build_config, embedded_in, parse_overrides
from tests.unit.sdk.example_components import Back, BackConfig, pipeline


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "graph.yaml"
    p.write_text(text)
    return p


def test_common_merge_service_args_and_overrides(tmp_path: Path) -> None:
    p = write(tmp_path, """
Common:
  scale: 3
  unused: 1
Back:
  common-configs: [scale]
  label-text: hello
  ServiceArgs:
    workers: 3
    env: {A: "1"}
""")
    cfgs = resolve_config(pipeline, p, ["--Back.label-text=world", "--Back.ServiceArgs.workers=4"])
    back = cfgs["Back"]
    assert back.service_args.workers == 4 and back.service_args.env == {"A": "1"}
    assert back.values == {"scale": 3, "label-text": "world"}
    cfg = build_config(Back, back.values)
    assert isinstance(cfg, BackConfig) and cfg.scale == 3 and cfg.label == "world"
    # defaults from @service when the file is silent
    assert cfgs["Middle"].service_args.workers == 1 and cfgs["Middle"].values == {}
    # a Common override reaches the components that pull the key; their own key still wins
    assert resolve_config(pipeline, p, ["--Common.scale=5"])["Back"].values["scale"] == 5
    both = resolve_config(pipeline, p, ["--Common.scale=5", "--Back.scale=7"])
    assert both["Back"].values["scale"] == 7


def test_no_file_gives_defaults() -> None:
    cfgs = resolve_config(pipeline, None)
    assert cfgs["Back"].service_args.workers == 2
    assert cfgs["Back"].values == {"scale": 1, "label-text": "back"}


@pytest.mark.parametrize(
    ("text", "overrides", "component", "key", "message"),
    [
        ("Back:\n  scael: 2\n", [], "Back", "scael", "unknown key"),
        ("Back:\n  scale: lots\n", [], "Back", "scale", "integer"),
        ("Nope:\n  a: 1\n", [], "Nope", None, "unknown component"),
        ("Back:\n  ServiceArgs:\n    workers: 0\n", [], "Back", "ServiceArgs.workers", "greater"),
        ("Back:\n  ServiceArgs:\n    gpus: 1\n", [], "Back", "ServiceArgs.gpus", "Extra inputs"),
        ("Back:\n  common-configs: [scale]\n", [], "Back", "scale", "missing from Common"),
        ("Middle:\n  x: 1\n", [], "Middle", "x", "takes no settings"),
        ("", ["--Back.scale=abc"], "Back", "scale", "integer"),
        ("", ["--Ghost.x=1"], "Ghost", None, "unknown component"),
    ],
)
def test_errors_name_file_component_and_key(
    tmp_path: Path, text: str, overrides: list[str], component: str, key: str | None, message: str
) -> None:
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        resolve_config(pipeline, p, overrides)
    err = info.value
    assert err.file == str(p) and err.component == component and err.key == key
    assert message in str(err) and str(p) in str(err)


def test_broken_yaml_and_missing_file(tmp_path: Path) -> None:
    p = write(tmp_path, "Back: [unclosed\n")
    with pytest.raises(ConfigError, match="broken YAML"):
        resolve_config(pipeline, p)
    with pytest.raises(ConfigError, match="cannot read config"):
        resolve_config(pipeline, tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        resolve_config(pipeline, write(tmp_path, "- a\n- b\n"))


def test_parse_overrides() -> None:
    assert parse_overrides(["--A.b=1", "--A.c=[1, 2]", "--B.d=x"]) == {
        "A": {"b": 1, "c": [1, 2]},
        "B": {"d": "x"},
    }
    with pytest.raises(ConfigError, match="must look like"):
        parse_overrides(["--nodot=1"])


def test_an_embedded_component_runs_once_per_host_process(tmp_path: Path) -> None:
    p = write(tmp_path, """
Front:
  ServiceArgs: {workers: 3}
Middle:
  ServiceArgs: {embed-in: Front}
""")
    cfgs = resolve_config(pipeline, p)
    assert cfgs["Middle"].service_args.embed_in == "Front"
    assert cfgs["Middle"].service_args.workers == 3  # the host's
    assert cfgs["Middle"].service_args.model_dump()["embed-in"] == "Front"  # as the spec has it
    assert embedded_in(cfgs, "Front") == ["Middle"] and embedded_in(cfgs, "Back") == []


def test_a_component_called_through_an_embedded_one_may_be_embedded_too(tmp_path: Path
                                                                       ) -> None:
    """The whole chain in the host's processes (the agg graph in the Frontend's, as
    vLLM's own server runs)."""
    cfgs = resolve_config(pipeline, write(tmp_path, """
Front:
  ServiceArgs: {workers: 2}
Middle:
  ServiceArgs: {embed-in: Front}
Back:
  ServiceArgs: {embed-in: Front}
"""))
    assert embedded_in(cfgs, "Front") == ["Middle", "Back"]
    assert cfgs["Back"].service_args.workers == 2


@pytest.mark.parametrize(("section", "match"), [
    ("Middle:\n  ServiceArgs: {embed-in: Nope}", "'Nope' is not another component"),
    ("Middle:\n  ServiceArgs: {embed-in: Middle}", "'Middle' is not another component"),
    ("Middle:\n  ServiceArgs: {embed-in: Back}", "Back does not call Middle"),
    ("Back:\n  ServiceArgs: {embed-in: Middle}\nMiddle:\n  ServiceArgs: {embed-in: Front}",
     "Middle is itself embedded"),
    ("Middle:\n  ServiceArgs: {embed-in: Front, workers: 2}", "set Front's workers instead"),
    ("Back:\n  ServiceArgs: {embed-in: Front}",  # Front calls Back only through Middle
     "Front does not call Back"),
    ("Middle:\n  ServiceArgs: {embed-in: Front, env: {A: '1'}}", "set Front's env instead"),
    ("Middle:\n  ServiceArgs: {embed-in: Front, resources: {gpu: 1}}",  # devices per process
     "set Front's resources instead"),
])
def test_embedding_is_refused_naming_the_key(tmp_path: Path, section: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        resolve_config(pipeline, write(tmp_path, section))
    assert info.value.key in ("ServiceArgs.embed-in", "ServiceArgs.workers", "ServiceArgs.env",
                              "ServiceArgs.resources")
    assert "graph.yaml" in str(info.value)
