"""The wire codec over memory ranges: a range of 16-bit KV values encoded into its shadow
bytes (:func:`encode_into`), shadow bytes decoded back into the range (:func:`decode_into`),
and a range replaced by its round trip through the codec (:func:`roundtrip`, the quality
guard's view of a transfer).

Ranges are whole groups (``wire_shadow.RAW_GROUP`` bytes) and are worked ``CHUNK_GROUPS``
at a time, which bounds the temporaries; :func:`memory` views this process's memory at an
address as a tensor, without a copy. Used by ``wire_codec.CodecNixl``; no NIXL or vLLM
import.
"""

from __future__ import annotations

import ctypes

import torch

from dynagraph.llm.kv.codec import CHUNK_VALUES, GROUP, KvCodec, group_decoder
from dynagraph.llm.kv.transfer.wire_shadow import RAW_GROUP

CHUNK_GROUPS = 1 << 16
"""Groups encoded (or decoded, by a ``module:Class`` codec) at a time (8 MiB of raw KV):
bounds the temporaries. The built-in codecs decode ``CHUNK_VALUES`` at a time."""


def memory(addr: int, nbytes: int) -> torch.Tensor:
    """``nbytes`` of this process's memory at ``addr`` as a uint8 tensor (no copy)."""
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(addr), dtype=torch.uint8)


def encode_into(kv: KvCodec, dtype: torch.dtype, raw: torch.Tensor, out: torch.Tensor) -> None:
    """Encode ``raw`` (bytes of 16-bit values) into ``out`` (its encoded bytes)."""
    enc = kv.encoded_bytes(GROUP)
    groups = raw.numel() // RAW_GROUP
    for g in range(0, groups, CHUNK_GROUPS):
        n = min(CHUNK_GROUPS, groups - g)
        rows = raw[g * RAW_GROUP:(g + n) * RAW_GROUP].view(dtype).view(n, GROUP)
        out[g * enc:(g + n) * enc].copy_(kv.encode(rows).view(-1))


def decode_into(kv: KvCodec, dtype: torch.dtype, data: torch.Tensor, raw: torch.Tensor) -> None:
    """Decode ``data`` (encoded groups) into ``raw``: a built-in codec straight into it,
    ``CHUNK_VALUES`` at a time (``Grouped.decode_groups``)."""
    enc = kv.encoded_bytes(GROUP)
    groups = data.numel() // enc
    grouped = group_decoder(kv)
    step = CHUNK_VALUES // GROUP if grouped is not None else CHUNK_GROUPS
    for g in range(0, groups, step):
        n = min(step, groups - g)
        d = data[g * enc:(g + n) * enc].view(n, enc)
        dst = raw[g * RAW_GROUP:(g + n) * RAW_GROUP].view(dtype).view(n, GROUP)
        if grouped is not None:
            grouped.decode_groups(d[:, :GROUP], d[:, GROUP:].view(torch.float16), dst)
        else:
            dst.copy_(kv.decode(d, GROUP, dtype))


def roundtrip(kv: KvCodec, dtype: torch.dtype, raw: torch.Tensor) -> None:
    """``raw`` replaced by what it becomes through the codec (the quality guard's view of
    a transfer)."""
    enc = kv.encoded_bytes(GROUP)
    groups = raw.numel() // RAW_GROUP
    scratch = torch.empty(min(groups, CHUNK_GROUPS) * enc, dtype=torch.uint8)
    for g in range(0, groups, CHUNK_GROUPS):
        n = min(CHUNK_GROUPS, groups - g)
        part = raw[g * RAW_GROUP:(g + n) * RAW_GROUP]
        encode_into(kv, dtype, part, scratch[:n * enc])
        decode_into(kv, dtype, scratch[:n * enc], part)
