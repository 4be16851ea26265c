"""Throughput of the KV block codecs (``dynagraph.llm.kv.codec``) on the CPU or a GPU.

    python benchmarks/kv_codec.py [--device cpu|cuda] [--blocks 64] [--page-values 8192]
        [--threads N] [--compile] [--name kv_codec_cpu]

Encodes and decodes ``--blocks`` rows of ``--page-values`` bfloat16 values (one layer's
K+V page of a block: the tiny model's 32-token page is 8192 values; Llama-3-8B's
16-token page is 16 x 8 KV heads x 128 x 2 = 32768) and reports GB/s of raw KV in and
out, the compression ratio and the error relative to each group's largest value.
The ``wire`` rows time the same bytes through ``wire_encode.encode_into`` /
``decode_into`` (a scale after each group, written into preallocated memory: what a
prefill engine does before a READ and a decode engine after it); ``--threads`` sets
torch's CPU threads (a vLLM CPU engine gives its process one per bound core).
``--compile`` also times each codec under ``torch.compile`` (fused kernels; on a GPU an
order of magnitude faster than eager; int8 may round a few values differently). ``none``
is a view of the same bytes, no work: its rates only show the timing floor.
``codec(row) -> wire -> decode`` pays off on a link when the link moves raw KV slower
than the codec's combined rate: compare the numbers with the link's bytes per second.
Writes benchmarks/results/<name>.json and .md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from dynagraph.llm.kv.codec import GROUP, codec  # noqa: E402
from dynagraph.llm.kv.transfer import wire_encode  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Any, device: str, reps: int) -> float:
    fn()
    _sync(device)
    began = time.perf_counter()
    for _ in range(reps):
        fn()
    _sync(device)
    return (time.perf_counter() - began) / reps


def result(label: str, rows: torch.Tensor, back: torch.Tensor, encoded_bytes: int,
           enc: float, dec: float) -> dict[str, Any]:
    """One table row: rates of raw bytes, and the largest error of a restored value
    relative to its group's largest value."""
    groups = rows.float().reshape(-1, GROUP)
    err = (back.float().reshape(-1, GROUP) - groups).abs()
    scale = groups.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    raw = rows.numel() * rows.element_size()
    return {"codec": label, "raw_bytes": raw, "encoded_bytes": encoded_bytes,
            "ratio": raw / encoded_bytes, "encode_ms": enc * 1e3, "decode_ms": dec * 1e3,
            "encode_gbps": raw / enc / 1e9, "decode_gbps": raw / dec / 1e9,
            "max_rel_error": float((err / scale).max())}


def measure(name: str, rows: torch.Tensor, reps: int, compiled: bool = False) -> dict[str, Any]:
    c = codec(name)
    device = str(rows.device)
    values = rows.shape[1]
    encode, decode = c.encode, c.decode
    if compiled:
        encode = torch.compile(c.encode)
        decode = torch.compile(c.decode)
    data = encode(rows)
    back = decode(data, values, rows.dtype)
    enc = timed(lambda: encode(rows), device, reps)
    dec = timed(lambda: decode(data, values, rows.dtype), device, reps)
    return result(name + (" (compiled)" if compiled else ""), rows, back, data.numel(), enc, dec)


def measure_wire(name: str, rows: torch.Tensor, reps: int) -> dict[str, Any]:
    c = codec(name)
    device = str(rows.device)
    raw = rows.reshape(-1).view(torch.uint8)
    shadow = torch.empty(raw.numel() // (2 * GROUP) * c.encoded_bytes(GROUP),
                         dtype=torch.uint8, device=rows.device)
    back = torch.empty_like(raw)
    enc = timed(lambda: wire_encode.encode_into(c, rows.dtype, raw, shadow), device, reps)
    dec = timed(lambda: wire_encode.decode_into(c, rows.dtype, shadow, back), device, reps)
    return result(f"{name} (wire)", rows, back.view(rows.dtype), shadow.numel(), enc, dec)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--page-values", type=int, default=8192)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's)")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--name", default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = (torch.randn(args.blocks, args.page_values, device=args.device) * 0.5).to(
        torch.bfloat16)
    results = [measure(n, rows, args.reps) for n in ("none", "int8", "fp8")]
    results += [measure_wire(n, rows, args.reps) for n in ("int8", "fp8")]
    if args.compile:
        results += [measure(n, rows, args.reps, compiled=True) for n in ("int8", "fp8")]
    where = (torch.cuda.get_device_name() if args.device.startswith("cuda")
             else f"CPU, {torch.get_num_threads()} thread(s)")
    lines = [f"# KV codec throughput ({where})", "",
             f"`python benchmarks/kv_codec.py --device {args.device} --blocks {args.blocks} "
             f"--page-values {args.page_values}"
             f"{f' --threads {args.threads}' if args.threads else ''}"
             f"{' --compile' if args.compile else ''}` at "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, torch {torch.__version__}: "
             f"{args.blocks} rows of {args.page_values} bfloat16 values "
             f"({rows.numel() * 2 / 2**20:.1f} MiB raw), mean of {args.reps} runs each.", "",
             "| codec | ratio | encode ms (GB/s raw) | decode ms (GB/s raw) | max error / group max |",
             "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['codec']} | {r['ratio']:.2f} | {r['encode_ms']:.3f} "
                     f"({r['encode_gbps']:.1f}) | {r['decode_ms']:.3f} ({r['decode_gbps']:.1f}) "
                     f"| {r['max_rel_error']:.4f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.name:
        import json

        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"{args.name}.json").write_text(json.dumps(
            {"args": vars(args), "device": where, "results": results}, indent=2) + "\n")
        (RESULTS / f"{args.name}.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
