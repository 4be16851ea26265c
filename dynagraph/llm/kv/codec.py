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


class Grouped:
    """Groupwise absmax scaling into one byte per value (int8 or fp8 subclasses).

    The work is done by ``encode_groups`` / ``decode_groups`` on tensors of groups
    (``[..., GROUP]`` values, ``[..., 1]`` float16 scales), written into views of the
    caller's memory and at most ``CHUNK_VALUES`` values at a time: the float32 work area
    stays in the CPU's cache and no temporary the size of the whole input is made (on
    the CPU the first version, one pass per operation over the whole input, decoded 2 MiB
    in ~3.8 ms on one core; this ~0.4 ms, with the same bytes out)."""

    name = ""
    limit = 1.0

    def _groups(self, values: int) -> int:
        if values % GROUP:
            raise ValueError(f"{self.name}: a page of {values} values is not a multiple of "
                             f"{GROUP}")
        return values // GROUP

    def encoded_bytes(self, values: int) -> int:
        return values + 2 * self._groups(values)

    def _to_bytes(self, scaled: torch.Tensor, q: torch.Tensor) -> None:
        """Write the quantised ``scaled`` (float32, modified) into ``q`` (uint8)."""
        raise NotImplementedError

    def _from_bytes(self, q: torch.Tensor) -> torch.Tensor:
        """``q`` (uint8) as a fresh contiguous float32 tensor of the same shape."""
        raise NotImplementedError

    def encode_groups(self, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> None:
        """Encode ``x`` (``[..., GROUP]`` 16-bit floats) into ``q`` (uint8, same shape)
        and ``s`` (``[..., 1]`` float16 scales); any strides."""
        xf = x.float()
        scale = xf.abs().amax(dim=-1, keepdim=True).clamp_(min=1e-8).div_(self.limit)
        xf.div_(scale)
        self._to_bytes(xf, q)
        s.copy_(scale)

    def decode_groups(self, q: torch.Tensor, s: torch.Tensor, out: torch.Tensor) -> None:
        """Decode ``q`` and ``s`` (as ``encode_groups`` wrote them) into ``out``."""
        xf = self._from_bytes(q)
        xf.mul_(s.float())
        out.copy_(xf)

    def _row_chunks(self, n_rows: int, values: int) -> range:
        return range(0, n_rows, max(1, CHUNK_VALUES // values))

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        n_rows, values = rows.shape
        groups = self._groups(values)
        out = torch.empty(n_rows, values + 2 * groups, dtype=torch.uint8, device=rows.device)
        q, s = out[:, :values], out[:, values:].view(torch.float16)
        step = self._row_chunks(n_rows, values).step
        for r in self._row_chunks(n_rows, values):
            k = min(step, n_rows - r)
            self.encode_groups(rows[r:r + k].reshape(k, groups, GROUP),
                               q[r:r + k].view(k, groups, GROUP), s[r:r + k].unsqueeze(-1))
        return out

    def decode(self, data: torch.Tensor, values: int, dtype: torch.dtype) -> torch.Tensor:
        n_rows = data.shape[0]
        groups = self._groups(values)
        out = torch.empty(n_rows, values, dtype=dtype, device=data.device)
        q, s = data[:, :values], data[:, values:].contiguous().view(torch.float16)
        step = self._row_chunks(n_rows, values).step
        for r in self._row_chunks(n_rows, values):
            k = min(step, n_rows - r)
            self.decode_groups(q[r:r + k].reshape(k, groups, GROUP), s[r:r + k].unsqueeze(-1),
                               out[r:r + k].view(k, groups, GROUP))
        return out


class Int8(Grouped):
    name = "int8"
    limit = 127.0

    def _to_bytes(self, scaled: torch.Tensor, q: torch.Tensor) -> None:
        q.view(torch.int8).copy_(scaled.round_().clamp_(-127, 127))

    def _from_bytes(self, q: torch.Tensor) -> torch.Tensor:
        return q.view(torch.int8).float()


class Fp8(Grouped):
    """float8_e4m3fn bytes are decoded through a 256-entry table (torch's own fp8 to
    float conversion on the CPU is ~5x slower than the table's ``index_select``)."""

    name = "fp8"
    limit = FP8_MAX

    def __init__(self) -> None:
        self._tables: dict[torch.device, torch.Tensor] = {}

    def _to_bytes(self, scaled: torch.Tensor, q: torch.Tensor) -> None:
        q.view(torch.float8_e4m3fn).copy_(scaled)

    def _from_bytes(self, q: torch.Tensor) -> torch.Tensor:
        table = self._tables.get(q.device)
        if table is None:
            table = self._tables[q.device] = torch.arange(
                256, dtype=torch.uint8, device=q.device).view(torch.float8_e4m3fn).float()
        index = q.to(torch.int32)
        return torch.index_select(table, 0, index.view(-1)).view(q.shape)


def group_kernels(kv: KvCodec) -> Grouped | None:
    """``kv`` if its ``encode_groups`` / ``decode_groups`` do what its ``encode`` /
    ``decode`` do (a grouped codec that does not override those), else None."""
    if isinstance(kv, Grouped) and type(kv).encode is Grouped.encode \
            and type(kv).decode is Grouped.decode:
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
