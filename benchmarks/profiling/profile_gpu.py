"""Measure a timing profile for the simulated engine: prefill and decode step times of a
Llama-shaped model (random weights) in plain PyTorch.

    python3 benchmarks/profiling/profile_gpu.py --out h200-llama8b-bf16.json \
        --details details.json --prefill-kernels cudnn-cascade,sdpa-flash \
        --decode-kernels sdpa-cudnn
    python3 benchmarks/profiling/profile_gpu.py --tiny --out /tmp/tiny.json  # CPU smoke run

Each cell is one full forward pass (``profile_gpu_model``) of one scheduler step: prefill =
one sequence adding ``new`` tokens on top of ``cached`` ones; decode = ``batch`` sequences
adding one token each, holding ``context`` tokens in all (context/batch each, so a 4-D
attention view needs no padding). On CUDA every cell is captured in a CUDA graph and the
graph's replays are timed with CUDA events (vLLM replays graphs too); the median is kept.
Attention kernels are candidates (``profile_gpu_attention``): each is checked against a
float64 reference and the correct ones are raced on a few shapes; each cell is then timed
with the phase's chosen kernels (the race's best of each kernel family, or those named by
--prefill-kernels / --decode-kernels) and the fastest is kept.

The profile's JSON has exactly the keys the mocker's loader reads; ``--details`` writes
everything else (ceilings, kernel checks, eager times, modes) beside it.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make `benchmarks.` and `tools.` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.profiling.profile_gpu_attention import CANDIDATES, FAMILY, flash_varlen_attention
from benchmarks.profiling.profile_gpu_model import (
    LLAMA3_8B,
    TINY,
    AttentionFn,
    Batch,
    KVCache,
    forward,
    make_batch,
    make_weights,
)
from benchmarks.profiling.profile_gpu_timing import (
    Timer,
    check_candidates,
    decode_batch,
    hardware,
    measure_ceilings,
    pick_ops,
    prefill_batch,
    race_candidates,
)


@dataclass(frozen=True)
class Grid:
    new_tokens: list[int]
    cached_tokens: list[int]
    batch_size: list[int]
    context_tokens: list[int]
    # (new, cached) and (batch, context) shapes on which attention kernels are raced.
    prefill_probes: list[tuple[int, int]]
    decode_probes: list[tuple[int, int]]
    eager_prefill_max_new: int

    def kv_slots(self) -> int:
        return max(self.new_tokens[-1] + self.cached_tokens[-1], self.context_tokens[-1])


FULL = Grid(
    new_tokens=[16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
    cached_tokens=[0, 512, 2048, 8192, 32768, 131072],
    batch_size=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
    context_tokens=[1024, 4096, 16384, 65536, 131072, 262144, 524288],
    prefill_probes=[(2048, 0), (2048, 32768)],
    decode_probes=[(1, 131072), (64, 131072)],
    eager_prefill_max_new=1024,
)
TINY_GRID = Grid(
    new_tokens=[4, 32, 256],
    cached_tokens=[0, 64],
    batch_size=[1, 8, 64],
    context_tokens=[64, 16384],
    prefill_probes=[(32, 64)],
    decode_probes=[(8, 16384)],
    eager_prefill_max_new=32,
)


def _table(
    rows: Sequence[int],
    cols: Sequence[int],
    cell: Callable[[int, int], tuple[float, str]],
    label: str,
) -> tuple[list[list[float]], list[list[str]]]:
    seconds: list[list[float]] = []
    modes: list[list[str]] = []
    for r in rows:
        seconds.append([])
        modes.append([])
        for c in cols:
            t, mode = cell(r, c)
            seconds[-1].append(t)
            modes[-1].append(mode)
        print(f"  {label} {r:>6}: " + " ".join(f"{t * 1e3:9.2f}" for t in seconds[-1]), flush=True)
    return seconds, modes


def run(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """Measure everything; returns (profile, details)."""
    started = time.monotonic()
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    shape, grid = (TINY, TINY_GRID) if args.tiny else (LLAMA3_8B, FULL)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    timer = Timer(
        device,
        use_graphs=device == "cuda",
        deadline=started + args.budget_s,
        max_repeats=3 if args.tiny else 20,
    )
    torch.manual_seed(0)
    print(f"{hardware(device)}; model {shape}", flush=True)
    ceilings = measure_ceilings(device)
    print(f"ceilings: {ceilings}", flush=True)
    checks = check_candidates(shape, dtype, device)
    for name, res in checks.items():
        print(f"  check {name}: {res}", flush=True)

    t0 = time.monotonic()
    ops, compile_state = pick_ops(args.compile, shape, dtype, device)
    print(
        f"fused elementwise ops: {ops.fused} (compile {compile_state}, "
        f"{time.monotonic() - t0:.0f} s)",
        flush=True,
    )
    max_pos = grid.kv_slots()
    w = make_weights(shape, max_pos, dtype, device)
    kv = KVCache.random(shape, grid.kv_slots(), dtype, device)
    forced = {"prefill": args.prefill_kernels, "decode": args.decode_kernels}
    race, chosen = race_candidates(
        shape, kv, grid.prefill_probes, grid.decode_probes, checks, timer, forced
    )
    print(f"attention race (s): {race}\nchosen: {chosen}", flush=True)

    def step(b: Batch, attend: AttentionFn) -> Callable[[], object]:
        return lambda: forward(shape, w, kv, b, attend, ops)

    winners: dict[tuple[str, int, int], str] = {}

    def fastest(phase: str, r: int, c: int, b: Batch, graph: bool) -> tuple[float, str]:
        """Graph: the step with each chosen kernel, the fastest kept (and remembered).
        Eager: the step with the cell's graph winner."""
        if not graph:
            name = winners[(phase, r, c)]
            t, mode = timer(step(b, CANDIDATES[name]), False)
            return t, f"{name}, {mode}"
        runs = [(*timer(step(b, CANDIDATES[name]), True), name) for name in chosen[phase]]
        t, mode, name = min(runs)
        winners[(phase, r, c)] = name
        return t, f"{name}, {mode}"

    def prefill_cell(new: int, cached: int, graph: bool = True) -> tuple[float, str]:
        return fastest(
            "prefill", new, cached, prefill_batch(new, cached, shape.vocab, device), graph
        )

    def decode_cell(batch: int, context: int, graph: bool = True) -> tuple[float, str]:
        return fastest(
            "decode", batch, context, decode_batch(batch, context, shape.vocab, device), graph
        )

    print("prefill (ms), rows new_tokens, columns cached_tokens", grid.cached_tokens, flush=True)
    prefill, prefill_modes = _table(grid.new_tokens, grid.cached_tokens, prefill_cell, "new")
    print("decode (ms), rows batch_size, columns context_tokens", grid.context_tokens, flush=True)
    decode, decode_modes = _table(grid.batch_size, grid.context_tokens, decode_cell, "batch")

    details: dict[str, Any] = {
        "hardware": hardware(device),
        "ceilings": ceilings,
        "attention_checks": checks,
        "attention_race_seconds": race,
        "attention_chosen": chosen,
        "elementwise_ops": ops.fused,
        "compile": compile_state,
        "prefill_kernel_and_mode": prefill_modes,
        "decode_kernel_and_mode": decode_modes,
    }
    if device == "cuda" and time.monotonic() < started + 0.6 * args.budget_s:
        # What CUDA graphs buy: the same cells run eagerly (launch-bound at small sizes).
        print("decode eager (ms)", flush=True)
        details["decode_eager_seconds"], _ = _table(
            grid.batch_size,
            grid.context_tokens,
            lambda b, c: decode_cell(b, c, graph=False),
            "batch",
        )
        small = [n for n in grid.new_tokens if n <= grid.eager_prefill_max_new]
        print("prefill eager (ms)", flush=True)
        details["prefill_eager_new_tokens"] = small
        details["prefill_eager_seconds"], _ = _table(
            small, grid.cached_tokens, lambda n, c: prefill_cell(n, c, graph=False), "new"
        )
    unequal_ok = checks["flash-varlen"]["decode-unequal"] == "ok"
    if device == "cuda" and unequal_ok and time.monotonic() < started + 0.8 * args.budget_s:
        # Does a skewed batch cost more than an even one of the same total? (varlen kernel)
        mean, n = 4096, 32
        skewed = [mean // 4 + (mean * 3 // 2) * i // (n - 1) for i in range(n)]
        skewed[-1] += mean * n - sum(skewed)
        even_t, _ = timer(
            step(make_batch([1] * n, [mean] * n, shape.vocab, device), flash_varlen_attention), True
        )
        skew_t, _ = timer(
            step(make_batch([1] * n, skewed, shape.vocab, device), flash_varlen_attention), True
        )
        details["unequal_lengths"] = {
            "batch": n,
            "context": mean * n,
            "even_s": even_t,
            "skewed_s": skew_t,
            "skewed_lengths": skewed,
        }
        print(f"unequal lengths: {details['unequal_lengths']}", flush=True)

    graphs = (
        "captured in CUDA graphs, graph replays timed" if device == "cuda" else "eager, wall clock"
    )
    profile: dict[str, Any] = {
        "name": args.name,
        "description": (
            f"Forward passes of a {'tiny Llama' if args.tiny else 'Llama-3-8B'}-shaped model with "
            f"random {str(dtype).removeprefix('torch.')} "
            f"weights in plain PyTorch {torch.__version__}: fused QKV, RoPE, K/V written to a "
            "contiguous cache, attention per cell the fastest of "
            f"{' / '.join(f'{n} ({FAMILY[n]})' for n in chosen['prefill'])} (prefill) and "
            f"{' / '.join(f'{n} ({FAMILY[n]})' for n in chosen['decode'])} (decode), "
            "fused gate/up SwiGLU, LM head + argmax on each sequence's last token; "
            f"elementwise ops (RoPE, residual+RMSNorm, SiLU*up) {ops.fused}. "
            f"Each cell is one step, {graphs}, median of 3-20 runs after warm-up. Prefill: one "
            "sequence adding new_tokens on top of cached_tokens (lower-right causal). Decode: "
            "batch_size sequences of context_tokens/batch_size tokens each (equal lengths, no "
            "padding), one new token each. No cell is extrapolated."
        ),
        "hardware": hardware(device),
        "measured_with": "python3 " + shlex.join(args.argv),
        "model": {
            "name": "tiny-llama-shape" if args.tiny else "llama-3-8b-shape",
            "hidden_size": shape.hidden,
            "num_layers": shape.layers,
            "num_heads": shape.heads,
            "num_kv_heads": shape.kv_heads,
            "head_dim": shape.head_dim,
            "dtype": str(dtype).removeprefix("torch."),
        },
        "block_size": 16,
        "kv_bytes_per_token": shape.kv_bytes_per_token(dtype),
        "prefill": {
            "new_tokens": grid.new_tokens,
            "cached_tokens": grid.cached_tokens,
            "seconds": prefill,
        },
        "decode": {
            "batch_size": grid.batch_size,
            "context_tokens": grid.context_tokens,
            "seconds": decode,
        },
    }
    details["elapsed_s"] = time.monotonic() - started
    details["timer_modes"] = timer.modes
    return profile, details


def dumps(obj: object) -> str:
    """JSON with every list of numbers on one line, so a table reads row by row."""
    text = json.dumps(obj, indent=1)
    return re.sub(
        r"\[\s*(-?[0-9][-0-9.e+,\s]*?)\s*\]",
        lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]",
        text,
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--out", type=Path, required=True, help="profile JSON to write")
    p.add_argument("--details", type=Path, help="also write checks, ceilings, eager times here")
    p.add_argument("--tiny", action="store_true", help="tiny model and grid on the CPU (smoke run)")
    p.add_argument("--name", help="profile name (default h200-llama8b-bf16, or cpu-tiny-smoke)")
    p.add_argument(
        "--compile",
        choices=["auto", "on", "off"],
        default="auto",
        help="fuse the elementwise ops with torch.compile (auto: on CUDA only)",
    )
    kernels = ", ".join(CANDIDATES)
    for phase in ("prefill", "decode"):
        p.add_argument(
            f"--{phase}-kernels",
            type=lambda v: [k for k in v.split(",") if k],
            default=[],
            help=f"comma-separated {phase} attention kernels to time per cell, fastest kept "
            f"(default: the fastest of each family in the race); of: {kernels}",
        )
    p.add_argument("--budget-s", type=float, default=480.0, help="skip extras past this wall time")
    args = p.parse_args(argv)
    args.argv = ["benchmarks/profiling/profile_gpu.py", *argv]
    if args.name is None:
        args.name = "cpu-tiny-smoke" if args.tiny else "h200-llama8b-bf16"
    threads = torch.get_num_threads()
    if args.tiny:
        torch.set_num_threads(1)  # the smoke run shares a small CPU; spinning threads only hurt
    try:
        profile, details = run(args)
    finally:
        torch.set_num_threads(threads)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(dumps(profile) + "\n")
    if args.details:
        args.details.write_text(dumps(details) + "\n")
    print(f"wrote {args.out} in {details['elapsed_s']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
