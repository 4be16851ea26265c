"""The model builder's machine-wide cache: a finished build of the same spec by the same
builder is copied into a new checkout instead of being trained again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools import model_builder as mb


def fake_build(path: Path, marker: str) -> None:
    path.mkdir(parents=True)
    for name in mb.REQUIRED_FILES:
        (path / name).write_text(marker)
    (path / "dynagraph_build.json").write_text(json.dumps({"format": mb.BUILD_FORMAT}))


def test_a_cached_build_is_copied_and_a_new_one_kept(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(mb.CACHE_ENV, str(tmp_path / "cache"))
    spec = mb.BuildSpec()
    entry = mb.cache_entry(spec)
    assert entry is not None and entry.parent == tmp_path / "cache"
    assert mb.cache_entry(mb.BuildSpec(seed=1)) != entry  # another spec, another entry

    def no_training(tmp: Path, s: mb.BuildSpec) -> dict[str, object]:
        raise AssertionError("trained although the cache had the build")

    fake_build(entry, "cached")
    monkeypatch.setattr(mb, "_build_into", no_training)
    out = mb.ensure_model(tmp_path / "checkout" / "tiny-llama", spec)
    assert (out / "config.json").read_text() == "cached"

    def training(tmp: Path, s: mb.BuildSpec) -> dict[str, object]:
        for name in mb.REQUIRED_FILES:
            (tmp / name).write_text("trained")
        (tmp / "dynagraph_build.json").write_text(json.dumps({"format": mb.BUILD_FORMAT}))
        return {"steps_done": 1, "final_loss": None}

    monkeypatch.setattr(mb, "_build_into", training)
    other = mb.BuildSpec(seed=7)
    built = mb.ensure_model(tmp_path / "other" / "tiny-llama", other)
    kept = mb.cache_entry(other)
    assert kept is not None and (kept / "model.safetensors").read_text() == "trained"
    assert (built / "model.safetensors").read_text() == "trained"


def test_the_cache_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(mb.CACHE_ENV, "off")
    assert mb.cache_entry(mb.BuildSpec()) is None
