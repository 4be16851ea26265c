"""Served graphs for the AFD end-to-end tests: each module serves the monolithic graph
(``graphs.agg``) for reference, then the AFD graph (``graphs.agg_afd``), both with
``dynamo serve`` as users run them, on a private etcd and NATS.

vLLM finds the AFD architectures through this checkout's ``vllm.general_plugins`` entry
point (``pyproject.toml``); where the installed metadata predates it, the graphs get a
shim on ``PYTHONPATH`` that declares it (``tools/entry_points.py``), so the spawned
engine process loads the plugin the way an installed package would.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.greedy import TOP_LOGPROBS, Greedy, assert_agrees
from tests.support.infra import own_infra
from tests.support.serve import ServeProcess, graph_env
from tools.entry_points import shim_path

MAX_TOKENS = 32
PROMPTS = [
    "The Python language reference describes",
    "A function is",
    "In a class definition, the",
    "Exceptions are raised when",
    "The import statement",
    "A generator expression yields",
    "Names are bound to objects by",
    "The with statement",
]


@pytest.fixture(scope="module")
def infra() -> Iterator[tuple[str, str]]:
    with own_infra() as (etcd, nats):
        yield etcd.url, nats.url


@pytest.fixture(scope="module")
def env(infra: tuple[str, str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The served graphs' environment (engines in one process each, the plugin visible)."""
    e = graph_env(*infra, in_process_engines=True)
    shim = shim_path(tmp_path_factory.mktemp("entry-points"))
    if shim is not None:
        e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(shim), e.get("PYTHONPATH")]))
    return e


def _choice(url: str, prompt: str, model: str, max_tokens: int, **extra: object
            ) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/completions", timeout=300, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, **extra})
    assert r.status_code == 200, r.text
    choice: dict[str, Any] = r.json()["choices"][0]
    return choice


def complete(url: str, prompt: str, model: str, max_tokens: int = MAX_TOKENS) -> str:
    return str(_choice(url, prompt, model, max_tokens)["text"])


def reference_of(url: str, prompt: str, model: str, max_tokens: int = MAX_TOKENS) -> Greedy:
    """A greedy reference: the text with each token's lead over the runner-up."""
    return Greedy.of(_choice(url, prompt, model, max_tokens, logprobs=TOP_LOGPROBS))


def complete_all(url: str, model: str, *, concurrent: bool) -> dict[str, str]:
    if not concurrent:
        return {p: complete(url, p, model) for p in PROMPTS}
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(lambda p: complete(url, p, model), PROMPTS))
    return dict(zip(PROMPTS, texts, strict=True))


def references_all(url: str, model: str) -> dict[str, Greedy]:
    return {p: reference_of(url, p, model) for p in PROMPTS}


def assert_all_agree(reference: dict[str, Greedy], got: dict[str, str]) -> None:
    """Every prompt's text is the reference's, up to a near tie (tests.support.greedy)."""
    for prompt, text in got.items():
        assert_agrees(reference[prompt], text, repr(prompt))


def stream_completion(url: str, prompt: str, model: str, max_tokens: int,
                      on_first: object = None) -> str:
    """A streamed completion's text; ``on_first()`` runs once the first text arrived."""
    text: list[str] = []
    with httpx.stream("POST", f"{url}/v1/completions", timeout=300, json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200, r.read().decode()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            text.append(chunk["choices"][0]["text"])
            if on_first is not None and len(text) == 1:
                on_first()  # type: ignore[operator]
    return "".join(text)


def processes(sp: ServeProcess, component: str) -> list[tuple[int, str]]:
    """(pid, metrics address) of each worker of ``component``, by worker index, from the
    ready banner (which lists workers in start-up order)."""
    found: dict[int, tuple[int, str]] = {}
    for line in sp.lines:
        m = re.search(rf"{component}\[(\d+)\] pid=(\d+) .*metrics=(\S+)", line)
        if m:
            found[int(m.group(1))] = (int(m.group(2)), m.group(3))
    return [found[i] for i in sorted(found)]


def model_arg(path: Path) -> str:
    return f"--Common.model={path}"
