"""The shim that makes this checkout's entry points visible before a reinstall."""

from __future__ import annotations

from importlib.metadata import entry_points
from pathlib import Path

import pytest

from tools import entry_points as ep


def test_pyproject_declares_the_vllm_plugins() -> None:
    assert ep.declared()["vllm.general_plugins"] == {
        "dynagraph_afd": "dynagraph.llm.afd.plugin:register",
        "dynagraph_amx": "dynagraph.llm.engines.vllm.cpu_amx:register",
        "dynagraph_engine_cores": "dynagraph.llm.engines.vllm.engine_cores:register",
        "dynagraph_engine_spin": "dynagraph.llm.engines.vllm.engine_spin:register"}


def test_shim_declares_what_is_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ep, "declared", lambda: {"dynagraph.test_group": {"x": "mod:fn"}})
    path = ep.shim_path(tmp_path)
    assert path == tmp_path
    monkeypatch.syspath_prepend(str(tmp_path))
    found = {(e.name, e.value) for e in entry_points(group="dynagraph.test_group")}
    assert found == {("x", "mod:fn")}
    assert ep.missing({"dynagraph.test_group": {"x": "mod:fn"}}) == {}
    assert ep.shim_path(tmp_path / "again") is None  # nothing missing any more
