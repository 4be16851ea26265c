"""Where a KV region's wire-encoded bytes live: its **shadow**, and how a peer learns it.

Every group of ``GROUP`` 16-bit values (``RAW_GROUP`` bytes) of a registered region is
``encoded`` bytes in its shadow, so the map is linear: raw offset ``o`` is shadow offset
``o // RAW_GROUP * encoded`` (:class:`ShadowMap`; a raw range not aligned to a group, or
outside every region, has none). :func:`add_trailer` / :func:`split_trailer` carry a
``ShadowMap``'s ``info`` on NIXL's agent metadata (opaque bytes to vLLM); a peer without
the trailer is told apart. :func:`block_ranges` gives the raw ranges of vLLM's blocks.

Pure: addresses and bytes only, no memory is touched (``wire_codec`` does that).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from dynagraph.llm.kv.codec import GROUP

RAW_GROUP = GROUP * 2
"""Bytes of one group of 16-bit values."""
MAGIC = b"DGWC1"
_TRAILER = struct.Struct("<I")


@dataclass(frozen=True, eq=False)
class ShadowMap:
    """Registered raw regions and their shadows, in one process's addresses."""

    raw: np.ndarray  # region bases, ascending
    ends: np.ndarray
    shadow: np.ndarray  # each region's shadow base
    encoded: int  # bytes per group, encoded

    @classmethod
    def of(cls, regions: Iterable[tuple[int, int, int]], encoded: int) -> ShadowMap:
        """From ``(raw base, raw bytes, shadow base)`` rows."""
        rows = sorted(regions)
        return cls(np.array([r[0] for r in rows], np.uint64),
                   np.array([r[0] + r[1] for r in rows], np.uint64),
                   np.array([r[2] for r in rows], np.uint64), int(encoded))

    def to_shadow(self, addrs: np.ndarray, lens: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray] | None:
        """The shadow ranges of raw ranges (None if one is outside every region or not
        aligned to a group)."""
        addrs = np.asarray(addrs, np.uint64)
        lens = np.asarray(lens, np.uint64)
        if len(addrs) == 0 or len(self.raw) == 0:
            return None
        idx = np.searchsorted(self.raw, addrs, side="right").astype(np.int64) - 1
        if idx.min() < 0 or np.any(addrs + lens > self.ends[np.maximum(idx, 0)]):
            return None
        offsets = addrs - self.raw[idx]
        if np.any(offsets % RAW_GROUP) or np.any(lens % RAW_GROUP):
            return None
        enc = np.uint64(self.encoded)
        return (self.shadow[idx] + offsets // np.uint64(RAW_GROUP) * enc,
                lens // np.uint64(RAW_GROUP) * enc)

    def info(self, codec_name: str) -> dict[str, Any]:
        return {"codec": codec_name, "encoded": self.encoded,
                "regions": [[int(b), int(e - b), int(s)]
                            for b, e, s in zip(self.raw, self.ends, self.shadow, strict=True)]}

    @classmethod
    def from_info(cls, info: Mapping[str, Any]) -> ShadowMap:
        return cls.of((tuple(r) for r in info["regions"]), int(info["encoded"]))


def add_trailer(metadata: bytes, info: Mapping[str, Any]) -> bytes:
    """NIXL agent metadata with ``info`` appended (taken off by :func:`split_trailer`)."""
    body = json.dumps(info).encode()
    return metadata + body + _TRAILER.pack(len(body)) + MAGIC


def split_trailer(metadata: bytes) -> tuple[bytes, dict[str, Any] | None]:
    """NIXL's own metadata and our trailer's info (None: a peer without one)."""
    if not metadata.endswith(MAGIC) or len(metadata) < len(MAGIC) + _TRAILER.size:
        return metadata, None
    end = len(metadata) - len(MAGIC)
    (size,) = _TRAILER.unpack(metadata[end - _TRAILER.size:end])
    start = end - _TRAILER.size - size
    if start < 0:
        return metadata, None
    try:
        info = json.loads(metadata[start:end - _TRAILER.size])
    except ValueError:
        return metadata, None
    return metadata[:start], info if isinstance(info, dict) else None


def block_ranges(bases: Iterable[int], block_lens: Iterable[int], strides: Iterable[int],
                 block_ids: Iterable[int]) -> tuple[np.ndarray, np.ndarray]:
    """The raw ranges of ``block_ids`` in every region (vLLM's layout: block ``b`` of a
    region at ``base + b * stride``, ``block_len`` bytes), region by region."""
    ids = np.asarray(list(block_ids), np.uint64)
    addrs, lens = [], []
    for base, n, stride in zip(bases, block_lens, strides, strict=True):
        addrs.append(np.uint64(base) + ids * np.uint64(stride))
        lens.append(np.full(len(ids), n, np.uint64))
    if not addrs:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    return np.concatenate(addrs), np.concatenate(lens)
