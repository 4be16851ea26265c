"""The AMX tile permission vLLM's CPU attention kernel needs (a fresh process each)."""

from __future__ import annotations

import subprocess
import sys

from dynagraph.llm.engines.vllm.cpu_amx import _has_amx


def _in_a_fresh_process(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    return out.stdout.strip()


def test_the_plugin_gets_the_tiles_exactly_where_the_cpu_has_them() -> None:
    got = _in_a_fresh_process(
        "from dynagraph.llm.engines.vllm import cpu_amx as a\n"
        "before = a.amx_permitted(); a.register(); print(before, a.amx_permitted())")
    assert got == ("False True" if _has_amx() else "False False")


def test_vllm_loads_it_as_a_general_plugin() -> None:
    from importlib.metadata import entry_points

    names = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert names.get("dynagraph_amx") == "dynagraph.llm.engines.vllm.cpu_amx:register"
