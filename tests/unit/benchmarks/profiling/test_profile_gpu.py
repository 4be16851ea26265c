"""Smoke run of benchmarks/profiling/profile_gpu.py with a tiny model on the CPU (keeps the
script from rotting).

The real profile is measured on a GPU; the smoke run checks the JSON the mocker's loader
reads. Importing torch dominates its time, so it is marked `bench`. torch is imported
inside the tests, so runs that deselect them do not pay for it; the committed-profile test
needs no torch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

PROFILE_KEYS = {
    "name", "description", "hardware", "measured_with", "model", "block_size",
    "kv_bytes_per_token", "prefill", "decode",
}  # fmt: skip


@pytest.mark.bench
@pytest.mark.timeout(120)
def test_tiny_profile_has_the_loader_shape_and_sane_times(tmp_path: Path) -> None:
    from benchmarks.profiling.profile_gpu import main

    out, details = tmp_path / "tiny.json", tmp_path / "details.json"
    assert main(["--tiny", "--out", str(out), "--details", str(details)]) == 0
    p = json.loads(out.read_text())

    assert set(p) == PROFILE_KEYS
    m = p["model"]
    assert p["kv_bytes_per_token"] == 2 * m["num_layers"] * m["num_kv_heads"] * m["head_dim"] * 4
    assert m["dtype"] == "float32" and p["block_size"] == 16
    assert p["measured_with"].startswith("python3 benchmarks/profiling/profile_gpu.py --tiny")
    for table, rows, cols in (
        ("prefill", "new_tokens", "cached_tokens"),
        ("decode", "batch_size", "context_tokens"),
    ):
        t = p[table]
        assert t[rows] == sorted(set(t[rows])) and t[cols] == sorted(set(t[cols]))
        assert len(t["seconds"]) == len(t[rows])
        assert all(len(row) == len(t[cols]) for row in t["seconds"])
        assert all(0 < s < 10 for row in t["seconds"] for s in row)
    # More work takes longer: 64x the new tokens, and 64x the sequences over 256x the context.
    assert p["prefill"]["seconds"][-1][0] > p["prefill"]["seconds"][0][0]
    assert p["decode"]["seconds"][-1][-1] > p["decode"]["seconds"][0][0]

    d = json.loads(details.read_text())
    # On the CPU the varlen flash kernel is unavailable; an SDPA candidate must pass and win.
    assert d["attention_checks"]["flash-varlen"]["decode"] != "ok"
    assert d["attention_chosen"]["decode"] and all(
        n.startswith("sdpa") for n in d["attention_chosen"]["decode"]
    )
    assert all(
        d["attention_checks"][n]["prefill+cached"] == "ok" for n in d["attention_chosen"]["prefill"]
    )


def test_cascade_merge_equals_lower_right_causal_attention() -> None:
    """The cuDNN candidate's log-sum-exp merge, with float64 parts: exact up to rounding."""
    import torch

    from benchmarks.profiling.profile_gpu_attention import (
        cascade_attention,
        math_part,
        reference_attention,
    )
    from benchmarks.profiling.profile_gpu_model import make_batch

    attend = cascade_attention(math_part)
    gen = torch.Generator().manual_seed(3)
    for q_lens, k_lens in (([5], [40]), ([7, 7], [7, 7]), ([1] * 3, [30] * 3), ([6] * 2, [9] * 2)):
        b = make_batch(q_lens, k_lens, 16, "cpu")
        q = torch.randn(sum(q_lens), 4, 8, generator=gen)
        kc, vc = torch.randn(2, sum(k_lens), 2, 8, generator=gen)
        out, ref = attend(q, kc, vc, b), reference_attention(q, kc, vc, b)
        assert out.shape == ref.shape
        assert float((out - ref).norm() / ref.norm()) < 1e-5


def test_committed_h200_profile_is_complete_and_consistent() -> None:
    """The profile measured on the H200 (data in the repo, read by the mocker)."""
    root = Path(__file__).resolve().parents[4]
    p = json.loads(
        (root / "dynagraph/llm/engines/mocker/profiles/h200-llama8b-bf16.json").read_text()
    )
    assert set(p) == PROFILE_KEYS
    m = p["model"]
    assert (m["hidden_size"], m["num_layers"], m["num_heads"], m["num_kv_heads"]) == (
        4096, 32, 32, 8,
    )  # fmt: skip
    assert p["kv_bytes_per_token"] == 2 * 32 * 8 * 128 * 2 == 131072
    pre, dec = p["prefill"], p["decode"]
    for t, rows, cols in (
        (pre, "new_tokens", "cached_tokens"),
        (dec, "batch_size", "context_tokens"),
    ):
        assert t[rows] == sorted(set(t[rows])) and t[cols] == sorted(set(t[cols]))
        assert [len(r) for r in t["seconds"]] == [len(t[cols])] * len(t[rows])
        assert all(0.001 < s < 10 for r in t["seconds"] for s in r)
        assert all(r[-1] > r[0] for r in t["seconds"])  # more context costs more
    s = pre["seconds"]
    assert all(s[i][j] < s[i + 1][j] for i in range(len(s) - 1) for j in range(len(s[0])))
    # A decode step at batch 1 cannot beat reading the weights once at the copy bandwidth.
    assert dec["seconds"][0][0] > 15.0e9 / 4.8e12
