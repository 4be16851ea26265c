"""KV block codecs (pure torch) and the quality guard's verdict (pure)."""

from __future__ import annotations

import pytest
import torch

from dynagraph.errors import ConfigError
from dynagraph.llm.kv.codec import CHUNK_VALUES, GROUP, codec, group_decoder
from dynagraph.llm.kv.quality_guard import Sample, check, judge
from dynagraph.llm.kv.transfer import wire_encode as we
from tests.support.bad_codec import SignOnly


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


def _first_encode(name: str, rows: torch.Tensor) -> torch.Tensor:
    """The codecs' first implementation (whole-input passes): the reference bytes, and
    with ``_first_decode`` the values the chunked decode must give."""
    c = codec(name)
    n_rows, values = rows.shape
    x = rows.reshape(n_rows, values // GROUP, GROUP).float()
    scale = x.abs().amax(dim=2, keepdim=True).clamp(min=1e-8) / c.limit  # type: ignore[attr-defined]
    y = x / scale
    q = y.round().clamp(-127, 127).to(torch.int8) if name == "int8" \
        else y.to(torch.float8_e4m3fn)
    s = scale.reshape(n_rows, values // GROUP).to(torch.float16).view(torch.uint8)
    return torch.cat([q.reshape(n_rows, values).view(torch.uint8), s], dim=1)


def _first_decode(name: str, data: torch.Tensor, values: int, dtype: torch.dtype) -> torch.Tensor:
    n_rows, groups = data.shape[0], values // GROUP
    q = data[:, :values].contiguous().view(torch.int8 if name == "int8"
                                           else torch.float8_e4m3fn).float()
    s = data[:, values:].contiguous().view(torch.float16).float()
    x = q.reshape(n_rows, groups, GROUP) * s.reshape(n_rows, groups, 1)
    return x.reshape(n_rows, values).to(dtype)


@pytest.mark.parametrize("name", ["int8", "fp8"])
@pytest.mark.parametrize("shape", [(3, 2 * GROUP), (37, 8192), (1, CHUNK_VALUES * 2 + GROUP)])
def test_chunked_decode_restores_the_first_implementations_values(
        name: str, shape: tuple[int, int]) -> None:
    torch.manual_seed(1)
    rows = (torch.randn(*shape) * torch.logspace(-4, 2, shape[1])).to(torch.bfloat16)
    rows[0, :GROUP] = 0  # an all-zero group: the scale's floor
    c = codec(name)
    data = c.encode(rows)
    assert torch.equal(data, _first_encode(name, rows))
    back = c.decode(data, shape[1], torch.bfloat16)
    assert torch.equal(back, _first_decode(name, data, shape[1], torch.bfloat16))
    # the wire's layout (a scale after each group) over flat memory, same numbers
    raw = rows.reshape(-1).view(torch.uint8)
    shadow = torch.empty(raw.numel() // (2 * GROUP) * c.encoded_bytes(GROUP), dtype=torch.uint8)
    we.encode_into(c, torch.bfloat16, raw, shadow)
    per_group = _first_encode(name, rows.reshape(-1, GROUP))
    assert torch.equal(shadow, per_group.reshape(-1))
    restored = torch.empty_like(rows)
    we.decode_into(c, torch.bfloat16, shadow, restored.view(-1).view(torch.uint8))
    assert torch.equal(restored.reshape(-1, GROUP),
                       _first_decode(name, per_group, GROUP, torch.bfloat16))


class ShiftedDecode(SignOnly):
    """A codec overriding ``decode``: the wire must use it, not the built-in kernel."""

    def decode(self, data: torch.Tensor, values: int, dtype: torch.dtype) -> torch.Tensor:
        return super().decode(data, values, dtype) + 1


def test_a_codec_overriding_decode_is_not_bypassed_on_the_wire() -> None:
    odd = ShiftedDecode()
    assert group_decoder(odd) is None and group_decoder(SignOnly()) is not None
    rows = torch.randn(4, GROUP, dtype=torch.bfloat16)
    shadow = torch.empty(4 * odd.encoded_bytes(GROUP), dtype=torch.uint8)
    we.encode_into(odd, torch.bfloat16, rows.view(-1).view(torch.uint8), shadow)
    back = torch.empty_like(rows)
    we.decode_into(odd, torch.bfloat16, shadow, back.view(-1).view(torch.uint8))
    assert torch.equal(back, odd.decode(shadow.view(4, -1), GROUP, torch.bfloat16))

