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

import functools
import importlib
import math
import threading
from typing import Protocol

import torch

GROUP = 64
"""Values per scale."""
FP8_MAX = 448.0
CHUNK_VALUES = 1 << 18
"""Values a grouped codec works on at a time (a 1 MiB float32 work area)."""


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


class _Work:
    """A thread's work area on one device for decoding: float32 values and scales and
    int32 indices for ``CHUNK_VALUES`` values, allocated once, so a decode makes no
    temporary of its own."""

    def __init__(self, device: torch.device) -> None:
        self._values = torch.empty(CHUNK_VALUES, dtype=torch.float32, device=device)
        self._index = torch.empty(CHUNK_VALUES, dtype=torch.int32, device=device)
        self._scales = torch.empty(CHUNK_VALUES // GROUP, dtype=torch.float32, device=device)

    def _view(self, flat: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        n = math.prod(shape)
        if n > flat.numel():
            raise ValueError(f"KV codec: {n} values at a time, more than {flat.numel()}")
        return flat[:n].view(shape)

    def values(self, shape: torch.Size) -> torch.Tensor:
        return self._view(self._values, shape)

    def index(self, shape: torch.Size) -> torch.Tensor:
        return self._view(self._index, shape)

    def scales(self, shape: torch.Size) -> torch.Tensor:
        return self._view(self._scales, shape)


_WORK = threading.local()


def _work(device: torch.device) -> _Work:
    areas: dict[torch.device, _Work] | None = getattr(_WORK, "areas", None)
    if areas is None:
        areas = _WORK.areas = {}
    work = areas.get(device)
    if work is None:
        work = areas[device] = _Work(device)
    return work


class Grouped:
    """Groupwise absmax scaling into one byte per value (int8 or fp8 subclasses).

    Decoding is done by ``decode_groups`` on tensors of groups (``[..., GROUP]`` bytes,
    ``[..., 1]`` float16 scales) written into a view of the caller's memory, at most
    ``CHUNK_VALUES`` values at a time in a per-thread work area: the float32 values stay in
    the CPU's cache and nothing the size of the input is allocated. Encoding keeps its
    whole-input passes (the chunked scheme made a prefill engine's prefills slower)."""

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

    def _from_bytes(self, q: torch.Tensor, out: torch.Tensor) -> None:
        """``q`` (uint8) as float32 into ``out`` (contiguous, same shape)."""
        raise NotImplementedError

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        n_rows, values = rows.shape
        groups = self._groups(values)
        x = rows.reshape(n_rows, groups, GROUP).float()
        scale = x.abs().amax(dim=2, keepdim=True).clamp(min=1e-8) / self.limit
        q = self._quantize(x / scale).reshape(n_rows, values).view(torch.uint8)
        s = scale.reshape(n_rows, groups).to(torch.float16).view(torch.uint8)
        return torch.cat([q, s], dim=1)

    def decode_groups(self, q: torch.Tensor, s: torch.Tensor, out: torch.Tensor) -> None:
        """Decode ``q`` (``[..., GROUP]`` uint8, at most ``CHUNK_VALUES``) and ``s``
        (``[..., 1]`` float16) into ``out`` (same shape as ``q``); any strides."""
        work = _work(q.device)
        xf = work.values(q.shape)
        self._from_bytes(q, xf)
        xf.mul_(work.scales(s.shape).copy_(s))
        out.copy_(xf)

    def decode(self, data: torch.Tensor, values: int, dtype: torch.dtype) -> torch.Tensor:
        n_rows = data.shape[0]
        groups = self._groups(values)
        out = torch.empty(n_rows, values, dtype=dtype, device=data.device)
        q = data[:, :values].reshape(n_rows, groups, GROUP)
        s = data[:, values:].contiguous().view(torch.float16).unsqueeze(-1)
        x = out.view(n_rows, groups, GROUP)
        per_chunk = CHUNK_VALUES // GROUP
        k, m = (max(1, per_chunk // groups), groups) if groups <= per_chunk else (1, per_chunk)
        for r in range(0, n_rows, k):
            for g in range(0, groups, m):
                rows, cols = slice(r, min(r + k, n_rows)), slice(g, min(g + m, groups))
                self.decode_groups(q[rows, cols], s[rows, cols], x[rows, cols])
        return out


class Int8(Grouped):
    name = "int8"
    limit = 127.0

    def _quantize(self, scaled: torch.Tensor) -> torch.Tensor:
        return scaled.round().clamp(-127, 127).to(torch.int8)

    def _from_bytes(self, q: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(q.view(torch.int8))


@functools.cache
def _fp8_table(device: torch.device) -> torch.Tensor:
    """The float32 value of each float8_e4m3fn byte."""
    return torch.arange(256, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn).float()


class Fp8(Grouped):
    """float8_e4m3fn bytes are decoded through a 256-entry table (torch's own fp8 to
    float conversion on the CPU is ~5x slower than the table's ``index_select``)."""

    name = "fp8"
    limit = FP8_MAX

    def _quantize(self, scaled: torch.Tensor) -> torch.Tensor:
        return scaled.to(torch.float8_e4m3fn)

    def _from_bytes(self, q: torch.Tensor, out: torch.Tensor) -> None:
        index = _work(q.device).index(q.shape).copy_(q)
        torch.index_select(_fp8_table(q.device), 0, index.view(-1), out=out.view(-1))


def group_decoder(kv: KvCodec) -> Grouped | None:
    """``kv`` if its ``decode_groups`` does what its ``decode`` does (a grouped codec that
    does not override ``decode``), else None."""
    if isinstance(kv, Grouped) and type(kv).decode is Grouped.decode:
        return kv
    return None


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
