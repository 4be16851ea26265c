"""Timing machinery of ``profile_gpu``: a step timer (CUDA-graph replays timed with CUDA
events, or wall clock on the CPU), attention-kernel checks and races, the elementwise-op
choice, and the device's copy and matrix ceilings."""

from __future__ import annotations

import functools
import math
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from benchmarks.profiling.profile_gpu_attention import CANDIDATES, FAMILY, reference_attention
from benchmarks.profiling.profile_gpu_model import (
    EAGER_OPS,
    AttentionFn,
    Batch,
    KVCache,
    Ops,
    Shape,
    compiled_ops,
    make_batch,
)


@dataclass
class Timer:
    """Times a step function: warm-up, then the median of several timed runs."""

    device: str
    use_graphs: bool
    deadline: float
    max_repeats: int = 20
    modes: dict[str, int] = field(default_factory=dict)

    def __call__(self, fn: Callable[[], object], graph: bool) -> tuple[float, str]:
        self._once(fn)  # warm-up (and compilation, for a new shape)
        first = self._once(fn)  # sizes the repeat count
        repeats = 3 if first > 0.2 else 5 if first > 0.05 else 12 if first > 0.01 else 20
        if time.monotonic() > self.deadline:
            repeats = 3
        repeats = min(repeats, self.max_repeats)
        mode = "eager"
        run = fn
        if graph and self.use_graphs:
            try:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    fn()
                run, mode = g.replay, "graph"
            except Exception as e:  # noqa: BLE001 - any capture failure falls back to eager
                mode = f"eager (capture failed: {type(e).__name__})"
                torch.cuda.synchronize()
        self._once(run)
        times = [self._once(run) for _ in range(repeats)]
        self.modes[mode] = self.modes.get(mode, 0) + 1
        return statistics.median(times), mode

    def _once(self, fn: Callable[[], object]) -> float:
        if self.device != "cuda":
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call] # untyped in torch
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call] # untyped in torch
        start.record()
        fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end)) / 1000.0


def prefill_batch(new: int, cached: int, vocab: int, device: str) -> Batch:
    return make_batch([new], [cached + new], vocab, device)


def decode_batch(batch: int, context: int, vocab: int, device: str) -> Batch:
    if context % batch:
        raise ValueError(f"context {context} is not a multiple of batch {batch}")
    return make_batch([1] * batch, [context // batch] * batch, vocab, device)


def check_candidates(shape: Shape, dtype: torch.dtype, device: str) -> dict[str, dict[str, str]]:
    """Each candidate against float64 attention on small cases: 'ok', 'wrong: ...' or the error."""
    cases = {
        "prefill": make_batch([24], [24], 16, device),
        "prefill+cached": make_batch([24], [200], 16, device),
        "decode": make_batch([1] * 4, [77] * 4, 16, device),
        "decode-unequal": make_batch([1] * 3, [5, 130, 60], 16, device),
    }
    gen = torch.Generator(device=device).manual_seed(1)
    report: dict[str, dict[str, str]] = {}
    for name, attend in CANDIDATES.items():
        report[name] = {}
        for case, b in cases.items():
            n_tok, slots = b.tokens.shape[0], sum(b.k_lens)
            q = torch.randn(n_tok, shape.heads, shape.head_dim, generator=gen, device=device).to(
                dtype
            )
            kc, vc = (
                torch.randn(slots, shape.kv_heads, shape.head_dim, generator=gen, device=device).to(
                    dtype
                )
                for _ in range(2)
            )
            try:
                out = attend(q, kc, vc, b)
                ref = reference_attention(q, kc, vc, b).double()
                err = float((out.double() - ref).norm() / ref.norm())
                tol = 2e-2 if dtype == torch.bfloat16 else 1e-3
                report[name][case] = "ok" if err < tol else f"wrong: rel err {err:.2e}"
            except Exception as e:  # noqa: BLE001 - an unsupported kernel is a finding, not a crash
                report[name][case] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return report


def race_candidates(
    shape: Shape,
    kv: KVCache,
    prefill_probes: list[tuple[int, int]],
    decode_probes: list[tuple[int, int]],
    checks: dict[str, dict[str, str]],
    timer: Timer,
    forced: dict[str, list[str]],
) -> tuple[dict[str, dict[str, float]], dict[str, list[str]]]:
    """Time attention alone (one layer) for each candidate on each probe shape it passed the
    check for. Per phase, of the candidates that passed all that phase's checks, keep the
    fastest of each kernel family (fastest first; "torch's choice" only if nothing else),
    unless ``forced`` names the phase's kernels (each must have passed its checks)."""
    device, dtype = timer.device, kv.k.dtype
    probes: dict[str, list[tuple[str, str, Batch]]] = {
        "prefill": [
            (
                f"prefill new={n} cached={c}",
                "prefill+cached" if c else "prefill",
                prefill_batch(n, c, 16, device),
            )
            for n, c in prefill_probes
        ],
        "decode": [
            (f"decode batch={b} context={c}", "decode", decode_batch(b, c, 16, device))
            for b, c in decode_probes
        ],
    }
    needs = {"prefill": ("prefill", "prefill+cached"), "decode": ("decode",)}
    times: dict[str, dict[str, float]] = {}
    chosen: dict[str, list[str]] = {}
    for phase, cases in probes.items():
        totals: dict[str, float] = {}
        for name, attend in CANDIDATES.items():
            total = 0.0
            for label, case, b in cases:
                if checks[name][case] != "ok":
                    total = math.inf
                    continue
                q = torch.randn(b.tokens.shape[0], shape.heads, shape.head_dim, device=device)
                q = q.to(dtype)

                def probe(q: torch.Tensor = q, b: Batch = b, f: AttentionFn = attend) -> object:
                    return f(q, kv.k[0], kv.v[0], b)

                try:
                    t, _ = timer(probe, graph=True)
                except Exception as e:  # noqa: BLE001 - e.g. out of memory on the long probe
                    print(f"  {name} on {label}: {type(e).__name__}: {e}", flush=True)
                    total = math.inf
                    continue
                times.setdefault(name, {})[label] = t
                total += t
            if total < math.inf and all(checks[name][c] == "ok" for c in needs[phase]):
                totals[name] = total
        if not totals:
            raise RuntimeError(f"no attention kernel passed the {phase} checks: {checks}")
        if forced.get(phase):
            failed = [n for n in forced[phase] if n not in totals]
            if failed:
                raise RuntimeError(f"{failed} failed the {phase} checks or probes: {checks}")
            chosen[phase] = forced[phase]
            continue
        best_of_family: dict[str, str] = {}
        for name in sorted(totals, key=totals.__getitem__):
            best_of_family.setdefault(FAMILY[name], name)
        named = [n for f, n in best_of_family.items() if f != "torch's choice"]
        chosen[phase] = named or list(best_of_family.values())
    return times, chosen


def measure_ceilings(device: str) -> dict[str, float]:
    """Copy bandwidth and bf16 matrix rate measured here, to judge the profile against."""
    if device != "cuda":
        return {}
    timer = Timer(device, use_graphs=False, deadline=math.inf)
    bufs = [torch.empty(2**31, dtype=torch.bfloat16, device=device).normal_() for _ in range(2)]
    t_copy, _ = timer(lambda: bufs[1].copy_(bufs[0]), graph=False)
    bufs.clear()
    a, b = (torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) for _ in range(2))
    t_mm, _ = timer(lambda: a @ b, graph=False)
    return {
        "copy_TBps_read_plus_write": 2 * 2**32 / t_copy / 1e12,
        "bf16_matmul_8192_TFLOPs": 2 * 8192**3 / t_mm / 1e12,
    }


@functools.cache
def hardware(device: str) -> str:
    if device != "cuda":
        return "CPU (smoke run)"
    props = torch.cuda.get_device_properties(0)
    text = f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs"
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        )
        text += f", driver {smi.stdout.strip()}"
    except (OSError, subprocess.SubprocessError):
        pass
    return f"{text}; torch {torch.__version__}, CUDA {torch.version.cuda}"


def check_ops(ops: Ops, shape: Shape, dtype: torch.dtype, device: str) -> None:
    """Raise unless each of ``ops`` agrees with the eager version (at a few token counts)."""

    def rand(*dims: int) -> torch.Tensor:
        return torch.randn(*dims, device=device).to(dtype)

    for n in (1, 3, 17):
        qkv = rand(n, (shape.heads + 2 * shape.kv_heads) * shape.head_dim)
        cos, sin = rand(n, 1, shape.head_dim // 2), rand(n, 1, shape.head_dim // 2)
        x, d, nw = rand(n, shape.hidden), rand(n, shape.hidden), rand(shape.hidden)
        pairs = [
            (
                ops.rope_qkv(qkv, cos, sin, shape.heads, shape.kv_heads),
                EAGER_OPS.rope_qkv(qkv, cos, sin, shape.heads, shape.kv_heads),
            ),
            (ops.add_rms_norm(x, d, nw, 1e-5), EAGER_OPS.add_rms_norm(x, d, nw, 1e-5)),
            ((ops.silu_mul(qkv),), (EAGER_OPS.silu_mul(qkv),)),
        ]
        for got, want in pairs:
            for g, e in zip(got, want, strict=True):
                err = float((g.double() - e.double()).norm() / e.double().norm())
                if not err < 2e-2:
                    raise ValueError(f"a compiled op disagrees with eager: rel err {err:.2e}")


def pick_ops(want: str, shape: Shape, dtype: torch.dtype, device: str) -> tuple[Ops, str]:
    """Compiled (fused) elementwise ops if asked and they compile and agree with eager."""
    if want == "off" or (want == "auto" and device != "cuda"):
        return EAGER_OPS, "off"
    try:
        ops = compiled_ops()
        check_ops(ops, shape, dtype, device)
        return ops, "on"
    except Exception as e:  # noqa: BLE001 - no working compiler: time the eager ops, say so
        msg = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        print(f"torch.compile unavailable, eager elementwise ops: {msg}", flush=True)
        return EAGER_OPS, f"failed ({msg})"
