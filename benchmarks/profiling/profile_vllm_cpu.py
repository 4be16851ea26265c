"""Measure the mocker's ``cpu-tiny`` timing profile from vLLM on this machine.

Run from the repository root::

    python -m benchmarks.profiling.profile_vllm_cpu --boost --quiet-wait 0  # cpu-tiny.json
    python -m benchmarks.profiling.profile_vllm_cpu --quick --out /tmp/p.json
    python -m benchmarks.profiling.profile_vllm_cpu --as-served graph \
        --out /tmp/cpu-tiny-served.json

``--as-served`` times what a client of the served engine sees instead of one engine
step (``benchmarks/profiling/profile_served.py`` says how and why); the rest of this
docstring is about the default, in-process measurement.

What is timed is one ``LLMEngine.step()`` of vLLM v1 with the engine core in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): scheduling, the forward pass, sampling
and output processing, as the mocker's step stands for all of them, on the wall clock.
Nothing is subtracted. Each point is repeated on fresh random token ids (so no repeat
hits the prefix cache by accident), all repeats of all points in one shuffled order (a
slow spell of the machine then spreads over the grid instead of spoiling one corner),
and summarised by ``--stat``: ``median`` (default) or ``min``.

- prefill ``(n, c)``: send a ``c``-token prefix (``max_tokens=1``) and run it to the
  end, then send the prefix plus ``n`` new tokens and time the one step that prefills
  them (checked: ``num_cached_tokens == c`` and the request finishes in that step);
- decode ``(B, C)``: start ``B`` requests of ``L`` prompt tokens, run until every one
  has its first token, then time ``k`` pure decode steps (each gives all ``B`` one
  token); ``L`` is chosen so the mean total context over the ``k`` steps is ``C``;
  each repeat is a fresh batch, and the statistic is over all ``k x repeats`` steps;
- mixed: ``B`` decoding requests plus one new ``n``-token prompt in the same step, to
  check the mocker's pricing rule for chunked-prefill steps (``Profile.mixed``).

The engine: block size 32, ``enforce_eager``, prefix caching on,
``VLLM_CPU_KVCACHE_SPACE=1``, ``max_num_batched_tokens`` 4096 (so every prefill point
runs in one step), ``max_num_seqs`` 256.

The machine is shared, and that matters more than anything else here: vLLM on the CPU
runs its model with OpenMP threads bound to the cores, and when other jobs take a core,
a step's thread waits at the other's barrier, so one step can take many times longer.
So:

- ``--boost`` (root) gives the run the CPU first (``tools.cpu_priority``: its own
  session and autogroup at nice -20), so other jobs yield the cores while it measures
  (the description records the median/fastest ratio of the repeats).
- Without root, ``--stat min`` (noise only ever adds time) and the quiet gate help:
  before each point the tool waits (``--quiet-wait`` seconds at most) for a moment when
  the rest of the machine uses less than ``--quiet-below`` of its CPUs (``/proc/stat``
  over 0.2 s while the engine is idle).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import random
import re
import statistics
import sys
import time
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from dynagraph.llm.engines.mocker.profile import Profile
from tools.cpu_priority import boost

log = logging.getLogger("profile_vllm_cpu")

REPO = Path(__file__).resolve().parents[2]
PROFILES_DIR = REPO / "dynagraph" / "llm" / "engines" / "mocker" / "profiles"
FIRST_TOKEN_ID = 5  # tiny-llama's special tokens are 0..4

PREFILL_NEW = [1, 32, 128, 512, 1024, 2048, 4000]
PREFILL_CACHED = [0, 512, 1024, 2048, 4096]
DECODE_BATCH = [1, 2, 4, 8, 16, 32, 64, 128]
DECODE_CONTEXT = [512, 1024, 2048, 4096, 8000, 16000]
"""Total context of a decode batch: up to 16 requests of ~1k tokens, what
``benchmarks/mocker_fidelity.py`` serves (beyond the grid the mocker extrapolates the
last two columns, which amplifies their noise)."""
MIXED = [  # (decode batch, decode context, prefill new tokens)
    (4, 512, 2048), (8, 2048, 256), (16, 1024, 1024), (32, 4096, 512),
    (64, 8000, 128), (128, 4096, 64),
]
QUICK_PREFILL_NEW = [1, 128, 1024]
QUICK_PREFILL_CACHED = [0, 1024]
QUICK_DECODE_BATCH = [1, 8, 64]
QUICK_DECODE_CONTEXT = [512, 4096]
MAX_MODEL_LEN = 16384  # one request of the largest decode context


def _set_env() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ.setdefault("VLLM_DO_NOT_TRACK", "1")


def build_engine(model: str, block_size: int, max_model_len: int) -> Any:
    _set_env()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

    args = EngineArgs(
        model=model, block_size=block_size, enforce_eager=True, enable_prefix_caching=True,
        max_model_len=max_model_len, max_num_batched_tokens=4096, max_num_seqs=256,
        seed=0, disable_log_stats=True,
    )
    return LLMEngine.from_engine_args(args)


class Prober:
    """Drives one in-process vLLM engine and times single steps."""

    def __init__(self, engine: Any, vocab_size: int, seed: int = 0) -> None:
        from vllm import SamplingParams

        self.engine = engine
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        self._n = 0
        self._params = SamplingParams

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(FIRST_TOKEN_ID, self.vocab_size) for _ in range(n)]

    def add(self, ids: list[int], max_tokens: int) -> str:
        self._n += 1
        rid = f"p{self._n}"
        params = self._params(max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                              detokenize=False)
        self.engine.add_request(rid, {"prompt_token_ids": ids}, params)
        return rid

    def step(self) -> tuple[float, dict[str, Any]]:
        """One engine step: its wall time and its outputs by request id."""
        began = time.perf_counter()
        outs = self.engine.step()
        return time.perf_counter() - began, {o.request_id: o for o in outs}

    def drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.engine.step()

    def abort(self, rids: Iterable[str]) -> None:
        self.engine.abort_request(list(rids))
        self.drain()

    def prefill(self, new: int, cached: int) -> float:
        prefix = self.tokens(cached)
        if cached:
            self.add(prefix, 1)
            self.drain()
        rid = self.add(prefix + self.tokens(new), 1)
        seconds, outs = self.step()
        out = outs.get(rid)
        if out is None or not out.finished:
            raise RuntimeError(f"prefill ({new}, {cached}) did not finish in one step")
        if (out.num_cached_tokens or 0) != cached:
            raise RuntimeError(f"prefill ({new}, {cached}): vLLM reused "
                               f"{out.num_cached_tokens} cached tokens, expected {cached}")
        return seconds

    def _start_decoders(self, batch: int, prompt_len: int, max_tokens: int) -> list[str]:
        rids = [self.add(self.tokens(prompt_len), max_tokens) for _ in range(batch)]
        pending = set(rids)
        while pending:
            _, outs = self.step()
            pending -= {rid for rid, o in outs.items() if o.outputs[0].token_ids}
        return rids

    def decode(self, batch: int, context: int, steps: int) -> tuple[list[float], float]:
        """Times of ``steps`` decode steps and their mean total context."""
        prompt_len = max(1, round(context / batch - 1 - (steps - 1) / 2))
        rids = self._start_decoders(batch, prompt_len, steps + 2)
        times: list[float] = []
        for _ in range(steps):
            seconds, outs = self.step()
            if len(outs) != batch:
                raise RuntimeError(f"decode ({batch}, {context}): {len(outs)} outputs")
            times.append(seconds)
        self.abort(rids)
        mean_context = batch * (prompt_len + 1 + (steps - 1) / 2)
        return times, mean_context

    def mixed(self, batch: int, context: int, new: int) -> tuple[float, int]:
        """One step of ``batch`` decodes plus a ``new``-token prefill; its time and the
        decodes' total context."""
        prompt_len = max(1, round(context / batch - 1))
        rids = self._start_decoders(batch, prompt_len, 4)
        rid = self.add(self.tokens(new), 1)
        seconds, outs = self.step()
        if rid not in outs or not outs[rid].finished or len(outs) != batch + 1:
            raise RuntimeError(f"mixed ({batch}, {context}, {new}) was not one mixed step")
        self.abort(rids)
        return seconds, batch * (prompt_len + 1)


def cpu_busy(window: float = 0.2) -> float:
    """Fraction of all CPUs busy over ``window`` seconds (``/proc/stat``)."""
    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields), idle

    total0, idle0 = sample()
    time.sleep(window)
    total1, idle1 = sample()
    return 1.0 - (idle1 - idle0) / max(total1 - total0, 1)


class QuietGate:
    """Waits for a quiet moment on a shared machine (see the module docstring)."""

    def __init__(self, below: float, wait: float) -> None:
        self.below, self.wait = below, wait
        self.waited = 0.0
        self.missed = 0

    def __call__(self) -> None:
        if self.wait <= 0:
            return
        deadline = time.monotonic() + self.wait
        began = time.monotonic()
        while cpu_busy() >= self.below:
            if time.monotonic() > deadline:
                self.missed += 1
                break
        self.waited += time.monotonic() - began


class Summary:
    """Reduces a point's repeats to one number; remembers how spread they were."""

    def __init__(self, stat: str) -> None:
        self.stat = stat
        self.ratios: list[float] = []

    def __call__(self, values: list[float]) -> float:
        self.ratios.append(statistics.median(values) / min(values))
        return round(min(values) if self.stat == "min" else statistics.median(values), 6)

    def noise(self) -> float:
        """The median over points of (median repeat / fastest repeat)."""
        return statistics.median(self.ratios) if self.ratios else 1.0


def measure(prober: Any, summary: Summary, quiet: QuietGate, *, quick: bool,
            repeats: int, decode_steps: int, seed: int = 0) -> dict[str, Any]:
    """Every repeat of every point, in a shuffled order (so a slow spell of the machine
    spreads over the grid instead of spoiling one corner of it), then summarised."""
    new_axis = QUICK_PREFILL_NEW if quick else PREFILL_NEW
    cached_axis = QUICK_PREFILL_CACHED if quick else PREFILL_CACHED
    batch_axis = QUICK_DECODE_BATCH if quick else DECODE_BATCH
    context_axis = QUICK_DECODE_CONTEXT if quick else DECODE_CONTEXT
    mixed_points = [] if quick else MIXED

    log.info("warming up")
    for _ in range(3):
        prober.prefill(512, 512)
        prober.decode(8, 1024, 3)

    points: list[tuple[str, tuple[int, ...]]] = []
    points += [("prefill", (n, c)) for n in new_axis for c in cached_axis]
    points += [("decode", (b, x)) for b in batch_axis for x in context_axis]
    points += [("mixed", point) for point in mixed_points]
    tasks = points * repeats
    random.Random(seed).shuffle(tasks)
    samples: dict[tuple[str, tuple[int, ...]], list[float]] = {}
    mixed_context: dict[tuple[int, ...], int] = {}
    for i, (kind, point) in enumerate(tasks):
        quiet()
        if kind == "prefill":
            got = [prober.prefill(*point)]
        elif kind == "decode":
            got, _ = prober.decode(point[0], point[1], decode_steps)
        else:
            seconds, mixed_context[point] = prober.mixed(*point)
            got = [seconds]
        samples.setdefault((kind, point), []).extend(got)
        if (i + 1) % max(1, len(tasks) // 10) == 0:
            log.info("%d/%d measurements", i + 1, len(tasks))

    prefill = [[summary(samples[("prefill", (n, c))]) for c in cached_axis] for n in new_axis]
    decode = [[summary(samples[("decode", (b, x))]) for x in context_axis] for b in batch_axis]
    mixed = [{"prefill_new_tokens": n, "prefill_cached_tokens": 0, "decode_batch_size": b,
              "decode_context_tokens": mixed_context[(b, x, n)],
              "seconds": summary(samples[("mixed", (b, x, n))])}
             for b, x, n in mixed_points]
    return {
        "prefill": {"new_tokens": new_axis, "cached_tokens": cached_axis, "seconds": prefill},
        "decode": {"batch_size": batch_axis, "context_tokens": context_axis, "seconds": decode},
        "mixed": mixed,
    }


def format_json(data: dict[str, Any]) -> str:
    """JSON with every list of numbers on one line (a table row per line)."""
    text = json.dumps(data, indent=1)
    return re.sub(r"\[\s*([-0-9.e+,\s]+?)\s*\]",
                  lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]",
                  text) + "\n"


def _cpu_name() -> str:
    """The CPU's model name and its widest vector extension: vLLM's CPU kernels are
    ~20x faster with AVX-512 than with AVX2 on the tiny model (prefill of 1024 tokens:
    ~0.04 s against ~0.85 s on two "AMD EPYC" machines of this workplace), so a CPU
    profile holds only on the kind of machine it was measured on."""
    name, flags = platform.processor() or "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    isa = next((f for f in ("amx_bf16", "avx512f", "avx2") if f in flags), None)
    return f"{name} ({isa})" if isa else name


def _hf_config(model: str) -> dict[str, Any]:
    return dict(json.loads((Path(model) / "config.json").read_text()))


def _model_shape(model: str) -> tuple[dict[str, Any], int]:
    """The model's shape (from its ``config.json``) and its KV bytes per token."""
    hf = _hf_config(model)
    num_heads = int(hf["num_attention_heads"])
    head_dim = int(hf.get("head_dim") or hf["hidden_size"] // num_heads)
    kv_heads = int(hf.get("num_key_value_heads") or num_heads)
    dtype = str(hf.get("torch_dtype") or hf.get("dtype") or "bfloat16")
    itemsize = 4 if dtype == "float32" else 2
    kv_bytes = 2 * int(hf["num_hidden_layers"]) * kv_heads * head_dim * itemsize
    shape = {
        "name": Path(model).name, "hidden_size": int(hf["hidden_size"]),
        "num_layers": int(hf["num_hidden_layers"]), "num_heads": num_heads,
        "num_kv_heads": kv_heads, "head_dim": head_dim, "dtype": dtype,
    }
    return shape, kv_bytes


SERVED_ENGINE: dict[str, Any] = {"max_model_len": MAX_MODEL_LEN, "max_num_batched_tokens": 4096,
                                 "max_num_seqs": 256,
                                 "kv_cache_space_gib": 1}
"""The engine settings of the grid (as ``build_engine``'s) for ``--as-served``."""


def _served_args(model: str, block_size: int) -> Any:
    from dynagraph.llm.engines.vllm.args import VllmEngineArgs

    return VllmEngineArgs(model=model, block_size=block_size, **SERVED_ENGINE)


@contextlib.contextmanager
def _graph_prober(model: str, block_size: int) -> Iterator[Any]:
    """``graphs.agg`` served on its own etcd and NATS, with a :class:`GraphProber` on it."""
    from benchmarks._mocker import exit_on_sigterm, serve_graph
    from benchmarks.mocker_fidelity import engine_env
    from benchmarks.profiling.profile_served import GraphProber

    overrides = [f"--Common.model={model}", f"--VllmWorker.block-size={block_size}",
                 *(f"--{'Common' if k == 'max_model_len' else 'VllmWorker'}."
                   f"{k.replace('_', '-')}={v}" for k, v in SERVED_ENGINE.items())]
    exit_on_sigterm()  # so a stopped run still stops its graph, etcd and NATS
    with serve_graph("graphs.agg:Frontend", str(REPO / "configs" / "agg.yaml"), overrides,
                     env=engine_env()) as served:
        vocab = int(_hf_config(model)["vocab_size"])
        prober = GraphProber(served.url, "tiny-llama", vocab)
        try:
            yield prober
        finally:
            prober.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(REPO / "models" / "tiny-llama"))
    ap.add_argument("--name", default="cpu-tiny")
    ap.add_argument("--out", type=Path,
                    help="where to write it (default: the shipped profiles, NAME.json)")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=4)
    ap.add_argument("--stat", choices=["median", "min"], default="median")
    ap.add_argument("--boost", action="store_true",
                    help="run at the highest CPU priority (root; see the docstring)")
    ap.add_argument("--quiet-below", type=float, default=0.3,
                    help="wait for the machine's CPU use to fall below this fraction")
    ap.add_argument("--quiet-wait", type=float, default=5.0,
                    help="seconds to wait for that before each point (0: never wait)")
    ap.add_argument("--quick", action="store_true", help="a small grid (a smoke test)")
    ap.add_argument("--as-served", choices=("engine", "graph"),
                    help="time vLLM as served (benchmarks/profiling/profile_served.py): our "
                         "VllmEngine in this process, or a served graphs.agg over HTTP")
    ns = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")

    # the largest decode context is one request longer than tiny-llama's 8192 positions;
    # its default RoPE has no limit, and only the step's time is used, not its output
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    boosted = boost() if ns.boost else "no"
    began = time.monotonic()
    load_before = os.getloadavg()
    prober: Any
    with contextlib.ExitStack() as stack:
        if ns.as_served == "graph":
            prober = stack.enter_context(_graph_prober(ns.model, ns.block_size))
            what = ("graphs.agg served with dynamo serve (Frontend, Processor, VllmWorker in "
                    "processes of their own), streamed /v1/completions as a client reads it")
        elif ns.as_served == "engine":
            from benchmarks.profiling.profile_served import EngineProber

            prober = stack.enter_context(contextlib.closing(EngineProber(_served_args(ns.model, ns.block_size))))
            what = ("our VllmEngine as the VllmWorker runs it (AsyncLLM, engine core in its "
                    "own process, vLLM's CPU binding)")
        else:
            engine = build_engine(ns.model, ns.block_size, max_model_len=MAX_MODEL_LEN)
            prober = Prober(engine, int(engine.vllm_config.model_config.get_vocab_size()))
            what = "one LLMEngine.step() with the engine core in-process"
        summary = Summary(ns.stat)
        quiet = QuietGate(ns.quiet_below, ns.quiet_wait)
        tables = measure(prober, summary, quiet, quick=ns.quick,
                         repeats=ns.repeats, decode_steps=ns.decode_steps)
        if not ns.as_served:
            blocks = engine.vllm_config.cache_config.num_gpu_blocks
        load_after = os.getloadavg()
    import vllm

    shape, kv_bytes = _model_shape(ns.model)
    kv = f"{blocks} KV blocks" if not ns.as_served else "KV cache of 1 GiB"

    elapsed = time.monotonic() - began
    profile = {
        "name": ns.name,
        "description": (
            f"vLLM {vllm.__version__} (CPU) on {Path(ns.model).name}: {what}, "
            f"enforce_eager, block size {ns.block_size}, "
            f"{kv}, prefix caching on; {ns.stat} of {ns.repeats} repeats per point (median/min "
            f"ratio of the repeats: {summary.noise():.2f}; priority boost: {boosted}; waited "
            f"{quiet.waited:.0f} s for "
            f"quiet moments, {quiet.missed} points measured without one). 1-min load average "
            f"{load_before[0]:.2f} before, {load_after[0]:.2f} after ({elapsed:.0f} s run)."
        ),
        "hardware": f"{_cpu_name()}, {os.cpu_count()} cores, {platform.machine()}",
        "measured_with": "python -m benchmarks.profiling.profile_vllm_cpu "
                         + " ".join(sys.argv[1:]),
        "model": shape,
        "block_size": ns.block_size,
        "kv_bytes_per_token": kv_bytes,
        **tables,
    }
    Profile.model_validate(profile)  # refuse to write a profile the mocker cannot load
    out = ns.out or PROFILES_DIR / f"{ns.name}.json"  # --name alone once overwrote cpu-tiny
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(format_json(profile))
    log.info("wrote %s in %.0f s", out, elapsed)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
