"""Calibrate a served CPU profile so the mocker graph, served, matches the vLLM graph.

    python -m benchmarks.profiling.calibrate_profile --profile cpu-tiny-avx512-served \\
        --name cpu-tiny-avx512-calibrated [--iterations 1] [--out PATH]

Why. A profile measured with ``benchmarks.profiling.profile_vllm_cpu --as-served graph``
holds what a client of ``graphs.agg`` reads: the engine's step *plus* the graph's own time
(Frontend, Processor, worker, and their competition with the engine for the cores). The
mocker graph waits out the profile and then does the graph's work again, so it counts the
graph's time twice; the faster the engine, the larger that share of the total.

How. The served profile ``S`` is the target. Serve ``graphs.mocker_agg`` with profile
``P_k`` (``P_0 = S``) at the grid's engine settings, measure the same grid the same way
(``benchmarks.profiling.profile_served.GraphProber``, the prober that measured ``S``) to
get ``M_k``, and correct each point by its error: ``P_{k+1} = P_k - (M_k - S)``
(:func:`corrected`); a table whose mean error is under ``--min-error`` (5%) is left alone,
its errors being noise. What is subtracted is the mocker graph's own time at that point, under the same pacing and CPU
competition as the real one, not an idle-graph guess. A point never drops below
``--floor`` x its target (the graph's time can exceed a fast engine's; a step is never
free). Each iteration serves and measures the whole grid once, as measuring ``S`` did.

The output is a normal profile (``Profile`` validates it); its description records the
source profile, the iterations and the mean absolute error of each pass.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.profiling.profile_vllm_cpu import (
    MAX_MODEL_LEN,
    REPO,
    SERVED_ENGINE,
    QuietGate,
    Summary,
    _hf_config,
    format_json,
    measure,
)
from dynagraph.llm.engines.mocker.profile import Profile, load_profile

log = logging.getLogger("calibrate_profile")

Tables = dict[str, Any]
"""A profile's ``prefill``, ``decode`` and ``mixed`` (as ``measure`` returns them)."""


def _cell(target: float, current: float, measured: float, floor: float) -> float:
    return round(max(current - (measured - target), floor * target), 6)


def corrected(target: Tables, current: Tables, measured: Tables, floor: float,
              min_error: float = 0.0) -> Tables:
    """``current`` with every point moved by its error ``measured - target`` (pure). A
    table whose mean relative error is below ``min_error`` is kept as it is: its points'
    errors are noise, and moving them would only copy that noise into the profile."""
    errors = relative_errors(target, measured)

    def table(kind: str) -> list[list[float]]:
        if errors[kind] < min_error:
            return [list(row) for row in current[kind]["seconds"]]
        return [[_cell(t, c, m, floor) for t, c, m in zip(tr, cr, mr, strict=True)]
                for tr, cr, mr in zip(target[kind]["seconds"], current[kind]["seconds"],
                                      measured[kind]["seconds"], strict=True)]

    out: Tables = {kind: {**target[kind], "seconds": table(kind)}
                   for kind in ("prefill", "decode")}
    keep_mixed = errors.get("mixed", 0.0) < min_error
    out["mixed"] = [{**t, "seconds": c["seconds"] if keep_mixed else
                     _cell(t["seconds"], c["seconds"], m["seconds"], floor)}
                    for t, c, m in zip(target.get("mixed", []), current.get("mixed", []),
                                       measured.get("mixed", []), strict=True)]
    return out


def relative_errors(target: Tables, measured: Tables) -> dict[str, float]:
    """Mean of ``|measured / target - 1|`` per table (pure)."""
    def errs(kind: str) -> list[float]:
        return [abs(m / t - 1) for tr, mr in zip(target[kind]["seconds"],
                                                 measured[kind]["seconds"], strict=True)
                for t, m in zip(tr, mr, strict=True)]

    out = {kind: round(statistics.mean(errs(kind)), 4) for kind in ("prefill", "decode")}
    mixed = [abs(m["seconds"] / t["seconds"] - 1)
             for t, m in zip(target.get("mixed", []), measured.get("mixed", []), strict=True)]
    if mixed:
        out["mixed"] = round(statistics.mean(mixed), 4)
    return out


def tables_of(profile: Profile) -> Tables:
    data = profile.model_dump(mode="json")
    return {"prefill": data["prefill"], "decode": data["decode"],
            "mixed": data.get("mixed") or []}


@contextlib.contextmanager
def _mocker_prober(model: str, profile_path: Path, block_size: int) -> Iterator[Any]:
    """``graphs.mocker_agg`` served with ``profile_path`` at the grid's engine settings
    (those ``benchmarks.profiling.profile_vllm_cpu --as-served`` gives vLLM), with a prober
    on it."""
    from benchmarks._mocker import exit_on_sigterm, serve_graph
    from benchmarks.profiling.profile_served import GraphProber

    overrides = [f"--Common.model={model}", f"--Common.max-model-len={MAX_MODEL_LEN}",
                 f"--MockerWorker.profile={profile_path}",
                 f"--MockerWorker.block-size={block_size}",
                 f"--MockerWorker.max-num-seqs={SERVED_ENGINE['max_num_seqs']}",
                 f"--MockerWorker.max-num-batched-tokens={SERVED_ENGINE['max_num_batched_tokens']}",
                 f"--MockerWorker.kv-cache-space-gib={SERVED_ENGINE['kv_cache_space_gib']}"]
    exit_on_sigterm()
    with serve_graph("graphs.mocker_agg:Frontend", str(REPO / "configs" / "mocker_agg.yaml"),
                     overrides) as served:
        prober = GraphProber(served.url, "tiny-llama", int(_hf_config(model)["vocab_size"]))
        try:
            yield prober
        finally:
            prober.close()


def measure_mocker(model: str, profile_path: Path, *, block_size: int, repeats: int,
                   decode_steps: int, seed: int) -> Tables:
    with _mocker_prober(model, profile_path, block_size) as prober:
        return measure(prober, Summary("median"), QuietGate(0.3, 0), quick=False,
                       repeats=repeats, decode_steps=decode_steps, seed=seed)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True,
                    help="the served profile to match (a shipped name or a JSON path)")
    ap.add_argument("--name", required=True, help="the calibrated profile's name")
    ap.add_argument("--out", type=Path,
                    help="where to write it (default: the shipped profiles, NAME.json)")
    ap.add_argument("--model", default=str(REPO / "models" / "tiny-llama"))
    ap.add_argument("--iterations", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=16,
                    help="as the served profile was measured with")
    ap.add_argument("--floor", type=float, default=0.1,
                    help="no point drops below this fraction of its target")
    ap.add_argument("--min-error", type=float, default=0.05,
                    help="a table whose mean error is below this is left as it is (noise)")
    ns = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")

    source = load_profile(ns.profile)
    out = ns.out or (REPO / "dynagraph" / "llm" / "engines" / "mocker" / "profiles"
                     / f"{ns.name}.json")
    target = tables_of(source)
    current = target
    began = time.monotonic()
    passes: list[str] = []
    work = out.with_suffix(".calibrating.json")
    try:
        for k in range(ns.iterations):
            work.write_text(format_json({**source.model_dump(mode="json", exclude_none=True),
                                         **current, "name": f"{ns.name}-pass{k}"}))
            log.info("pass %d: serving the mocker graph on %s", k + 1, work.name)
            measured = measure_mocker(ns.model, work, block_size=source.block_size,
                                      repeats=ns.repeats, decode_steps=ns.decode_steps,
                                      seed=k + 1)
            errors = relative_errors(target, measured)
            log.info("pass %d: mean |mocker / target - 1| %s", k + 1, errors)
            passes.append(f"pass {k + 1} served error {json.dumps(errors)}")
            current = corrected(target, current, measured, ns.floor, ns.min_error)
    finally:
        work.unlink(missing_ok=True)
    elapsed = time.monotonic() - began
    profile = {
        **source.model_dump(mode="json", exclude_none=True), **current, "name": ns.name,
        "description": (
            f"{source.name} calibrated for the mocker graph: each point moved by the served "
            f"mocker graph's error against it (benchmarks/profiling/calibrate_profile.py: "
            f"{ns.iterations} iteration(s), {ns.repeats} repeats, floor {ns.floor}, tables "
            f"with a mean error under {ns.min_error} kept; "
            f"{'; '.join(passes)}; {elapsed:.0f} s). Source: {source.description}"),
        "measured_with": "python -m benchmarks.profiling.calibrate_profile "
                         + " ".join(sys.argv[1:]),
    }
    Profile.model_validate(profile)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(format_json(profile))
    log.info("wrote %s in %.0f s", out, elapsed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
