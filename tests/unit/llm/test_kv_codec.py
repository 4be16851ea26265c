"""KV block codecs (pure torch) and the quality guard's verdict (pure)."""

from __future__ import annotations

import pytest
import torch

from dynagraph.errors import ConfigError
from dynagraph.llm.kv.codec import GROUP, codec
from dynagraph.llm.kv.quality_guard import Sample, check, judge


@pytest.mark.parametrize("name, tolerance", [("none", 0.0), ("int8", 0.01), ("fp8", 0.07)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_codecs_restore_rows_within_their_precision(name: str, tolerance: float,
                                                    dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    rows = (torch.randn(5, 4 * GROUP) * torch.logspace(-3, 1, 4 * GROUP)).to(dtype)
    c = codec(name)
    data = c.encode(rows)
    assert data.dtype == torch.uint8 and data.shape == (5, c.encoded_bytes(4 * GROUP))
    back = c.decode(data, 4 * GROUP, dtype)
    assert back.dtype == dtype and back.shape == rows.shape
    # the error of each value is relative to its group's largest value
    err = (back.float() - rows.float()).abs().reshape(5, 4, GROUP)
    scale = rows.float().abs().reshape(5, 4, GROUP).amax(dim=2, keepdim=True)
    assert (err <= tolerance * scale + 1e-6).all()
    if name != "none":
        assert 1.9 < rows.numel() * 2 / data.numel() < 2.0


def test_codec_names_are_checked() -> None:
    assert codec("dynagraph.llm.kv.codec:Int8").name == "int8"
    with pytest.raises(ValueError, match="unknown KV codec 'zstd'"):
        codec("zstd")
    with pytest.raises(ValueError, match="has no Nope"):
        codec("dynagraph.llm.kv.codec:Nope")
    with pytest.raises(ValueError, match="not a multiple of 64"):
        codec("int8").encode(torch.zeros(1, 100, dtype=torch.bfloat16))


def test_judge_compares_tokens_and_their_logprobs_up_to_where_runs_part() -> None:
    computed = [Sample([1, 2, 3], [-0.1, -0.2, -0.3]), Sample([4, 5], [-1.0, -1.0])]
    pooled = [Sample([1, 2, 3], [-0.1, -0.25, -0.3]), Sample([4, 6], [-1.1, -9.0])]
    r = judge("int8", computed, pooled, restored_tokens=64)
    assert r.agreement == 0.5 and r.compared_tokens == 4
    assert r.divergence == pytest.approx(0.15 / 4) and r.max_divergence == pytest.approx(0.1)
    check(r, max_divergence=0.05, min_agreement=0.5)
    with pytest.raises(ConfigError, match="divergence 0.0375 > kv-compression-max-divergence"):
        check(r, max_divergence=0.01, min_agreement=0.5)
    with pytest.raises(ConfigError, match="agreement 50% < kv-compression-min-agreement 75%"):
        check(r, max_divergence=0.05, min_agreement=0.75)
    nothing = judge("int8", computed, computed, restored_tokens=0)
    with pytest.raises(ConfigError, match="no prompt token.s KV came through the codec"):
        check(nothing, max_divergence=1.0, min_agreement=0.0)
