"""The vLLM version check: an engine starts only on the vLLM releases the adapter supports."""

from __future__ import annotations

from pathlib import Path

import pytest

from dynagraph.errors import EngineError
from dynagraph.llm.engines.vllm import adapter
from dynagraph.llm.engines.vllm.adapter import SUPPORTED_VLLM, version_error


@pytest.mark.parametrize("found", ["0.32.0", "0.32.0+cpu", "0.32.1", "0.32.5.post1", "v0.32.2"])
def test_supported_releases_pass(found: str) -> None:
    assert version_error(found) is None


@pytest.mark.parametrize("found", ["0.31.9", "0.33.0", "0.33.0rc1", "1.0.0", "0.3.20", "main"])
def test_other_releases_are_named_with_the_supported_range(found: str) -> None:
    error = version_error(found)
    assert error is not None
    assert f"vLLM {found} is installed" in error
    assert SUPPORTED_VLLM in error


def test_a_missing_vllm_is_named() -> None:
    error = version_error(None)
    assert error is not None and "not installed" in error and SUPPORTED_VLLM in error


def test_require_raises_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(adapter, "installed_vllm", lambda: "0.40.1")
    with pytest.raises(EngineError, match=r"0\.40\.1.*>=0\.32\.0,<0\.33"):
        adapter.require_supported_vllm()
    monkeypatch.setattr(adapter, "installed_vllm", lambda: "0.32.0")
    adapter.require_supported_vllm()


def test_engine_start_refuses_another_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio

    from dynagraph.llm.engines.vllm.args import VllmEngineArgs
    from dynagraph.llm.engines.vllm.engine import VllmEngine

    monkeypatch.setattr(adapter, "installed_vllm", lambda: "0.31.0")
    engine = VllmEngine(VllmEngineArgs(model="m"))
    with pytest.raises(EngineError, match="0.31.0"):
        asyncio.run(engine.start())
    assert not engine.started


def test_cpu_preload_adds_what_vllms_cpu_platform_adds(tmp_path: Path) -> None:
    torch_dir, vllm_dir = tmp_path / "torch", tmp_path / "vllm"
    (torch_dir / "lib").mkdir(parents=True)
    (vllm_dir / "libs").mkdir(parents=True)
    gomp = torch_dir / "lib" / "libgomp.so.1"
    gomp.touch()
    assert adapter.cpu_preload("", str(torch_dir), str(vllm_dir)) == str(gomp)
    tcmalloc = vllm_dir / "libs" / "libtcmalloc_minimal.so.4"
    tcmalloc.touch()
    assert (adapter.cpu_preload("/x/libjemalloc.so", str(torch_dir), str(vllm_dir))
            == f"{tcmalloc}:/x/libjemalloc.so:{gomp}")
    already = f"/y/libiomp5.so:{tcmalloc}"  # an OpenMP and a tcmalloc preloaded: as is
    assert adapter.cpu_preload(already, str(torch_dir), str(vllm_dir)) == already
