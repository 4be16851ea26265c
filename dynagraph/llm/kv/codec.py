"""KV block codecs: what the host KV pool stores instead of the raw block (``kv-compression``).

A block's page (one layer's K and V for ``block_size`` tokens, as the engine lays it
out) is a flat run of 16-bit floats. The lossy codecs cut it into groups of ``GROUP``
consecutive values (one head's channels of one token in vLLM's layouts) and keep, per
group, one float16 scale and a byte per value:

- ``int8``: symmetric, ``q = round(x / s)`` with ``s = absmax / 127``;
- ``fp8``: ``float8_e4m3fn`` of ``x / s`` with ``s = absmax / 448`` (its largest
  finite value), so small values keep relative precision.

Both store 1 + 2/GROUP bytes per value against 2: a ratio of ~1.94 with ``GROUP`` 64.
``none`` stores the raw bytes. Pure torch on whatever device the tensors are on; no I/O.

A codec is named in the config (``none``, ``int8``, ``fp8``) or, for experiments and
tests, as ``module:Class`` of an importable class with the same methods.
"""

from __future__ import annotations

import importlib
from typing import Protocol

import torch

GROUP = 64
"""Values per scale."""
FP8_MAX = 448.0


class KvCodec(Protocol):
    """Encodes rows of 16-bit floats (``[rows, n]``) into ``[rows, encoded_bytes(n)]``
    bytes and back."""

    name: str

    def encoded_bytes(self, values: int) -> int: ...

    def encode(self, rows: torch.Tensor) -> torch.Tensor: ...

    def decode(self, data: torch.Tensor, values: int, dtype: torch.dtype) -> torch.Tensor: ...


class Raw:
    name = "none"

    def encoded_bytes(self, values: int) -> int:
        return values * 2

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.contiguous().view(torch.uint8)

    def decode(self, data: torch.Tensor, values: int, dtype: torch.dtype) -> torch.Tensor:
        return data.contiguous().view(dtype)


class _Grouped:
    """Groupwise absmax scaling into one byte per value (int8 or fp8 subclasses)."""

    name = ""
    limit = 1.0

    def _groups(self, values: int) -> int:
        if values % GROUP:
            raise ValueError(f"{self.name}: a page of {values} values is not a multiple of "
                             f"{GROUP}")
        return values // GROUP

    def encoded_bytes(self, values: int) -> int:
        return values + 2 * self._groups(values)

    def _quantize(self, scaled: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _dequantize(self, q: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        n_rows, values = rows.shape
        groups = self._groups(values)
        x = rows.reshape(n_rows, groups, GROUP).float()
        scale = x.abs().amax(dim=2, keepdim=True).clamp(min=1e-8) / self.limit
        q = self._quantize(x / scale).reshape(n_rows, values).view(torch.uint8)
        s = scale.reshape(n_rows, groups).to(torch.float16).view(torch.uint8)
        return torch.cat([q, s], dim=1)

    def decode(self, data: torch.Tensor, values: int, dtype: torch.dtype) -> torch.Tensor:
        n_rows = data.shape[0]
        groups = self._groups(values)
        q = data[:, :values].contiguous()
        s = data[:, values:].contiguous().view(torch.float16).float()
        x = self._dequantize(q).reshape(n_rows, groups, GROUP) * s.reshape(n_rows, groups, 1)
        return x.reshape(n_rows, values).to(dtype)


class Int8(_Grouped):
    name = "int8"
    limit = 127.0

    def _quantize(self, scaled: torch.Tensor) -> torch.Tensor:
        return scaled.round().clamp(-127, 127).to(torch.int8)

    def _dequantize(self, q: torch.Tensor) -> torch.Tensor:
        return q.view(torch.int8).float()


class Fp8(_Grouped):
    name = "fp8"
    limit = FP8_MAX

    def _quantize(self, scaled: torch.Tensor) -> torch.Tensor:
        return scaled.to(torch.float8_e4m3fn)

    def _dequantize(self, q: torch.Tensor) -> torch.Tensor:
        return q.view(torch.float8_e4m3fn).float()


BUILTIN: dict[str, type[KvCodec]] = {"none": Raw, "int8": Int8, "fp8": Fp8}


def codec(name: str) -> KvCodec:
    """The codec called ``name`` (a built-in, or ``module:Class``)."""
    if name in BUILTIN:
        return BUILTIN[name]()
    module, _, cls = name.partition(":")
    if not module or not cls:
        raise ValueError(f"unknown KV codec {name!r}: use one of {sorted(BUILTIN)} or "
                         "module:Class")
    found = getattr(importlib.import_module(module), cls, None)
    if found is None:
        raise ValueError(f"KV codec {name!r}: {module} has no {cls}")
    made: KvCodec = found()
    return made
