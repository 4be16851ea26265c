"""KV compressed on the NIXL wire (``kv-transfer-compression: int8 | fp8``).

vLLM's NixlConnector moves a remote prefill's KV with a NIXL READ of the prefill
engine's cache blocks into the decode engine's. With a codec, both engines keep a
**shadow** of their registered KV memory, registered with NIXL as well, that holds the
blocks encoded: every 64 values (128 bytes of 16-bit floats) become ``E`` bytes (int8 /
fp8 and one float16 scale: 66, a ratio of 1.94; ``dynagraph.llm.kv.codec``). The map is
linear: raw offset ``o`` in a registered region is shadow offset ``o // 128 * E``, so
any 128-byte-aligned range of the cache has one encoded range, whatever descriptors a
READ cuts it into.

1. **Prefill side.** After the forward pass that computed a remote-decode request's
   blocks (vLLM's ``wait_for_save``, with the blocks its scheduler lists for a host
   buffer), :meth:`CodecNixl.encode` writes them into the shadow: before the request's
   output, so before any decode engine can READ them.
2. **The hand-shake.** The shadow's place goes to the peer inside NIXL's agent metadata,
   which vLLM hands over as opaque bytes: :func:`wire_shadow.add_trailer` appends the codec and the
   regions' raw and shadow addresses; :meth:`CodecNixl.add_remote_agent` takes them off
   before NIXL sees the metadata.
3. **Decode side.** :class:`CodecNixl` stands in front of vLLM's NIXL agent. A READ from
   a peer with the same codec becomes a READ of the peer's shadow ranges into this
   engine's shadow (descriptors merged into runs contiguous on both sides) with vLLM's
   notification; when NIXL reports it done, the received ranges are decoded into the
   cache blocks vLLM asked for (:class:`CodecRead`), then vLLM sees ``DONE``.

A peer without the trailer, or with another codec, is read raw, as before (its raw
memory is registered either way); a same-host peer the ``shm_direct`` stand-in maps is
copied raw (a ``memcpy`` is cheaper than the codec). Lossy codecs pass the quality guard
at start-up (``quality_guard``: the engine's cached blocks round-tripped through the
codec in place, ``wire_encode.roundtrip``).

The feature is in three modules, by role:

    wire_shadow   where the encoded bytes live (pure): ``ShadowMap`` (raw addresses to
                  shadow addresses), the metadata trailer that hands it to a peer (2),
                  vLLM's block ranges
    wire_encode   the codec over memory ranges: ``encode_into``, ``decode_into``,
                  ``roundtrip``, ``memory``
    wire_codec    the switch (``ENV``, ``wire_codec``, ``ROUNDTRIP_RPC``) and the stand-in
                  (1, 3): ``CodecNixl``, ``CodecRead``

Pure apart from the memory calls; no vLLM import (``nixl_connector`` does the wiring).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from dynagraph.llm.kv.codec import GROUP, codec
from dynagraph.llm.kv.transfer.nixl_descs import (
    LOCAL_AGENT,
    Telemetry,
    agent_text,
    descriptor_rows,
    merge_ranges,
)
from dynagraph.llm.kv.transfer.switches import KV_WIRE_CODEC
from dynagraph.llm.kv.transfer.wire_encode import decode_into, encode_into, memory, roundtrip
from dynagraph.llm.kv.transfer.wire_shadow import RAW_GROUP, ShadowMap, add_trailer, split_trailer

log = logging.getLogger(__name__)

ENV = KV_WIRE_CODEC

ROUNDTRIP_RPC = "dynagraph_kv_wire_roundtrip"
"""vLLM ``collective_rpc`` method (installed by ``nixl_connector``) that round-trips the
engine's KV through its wire codec in place, for the quality guard."""


def wire_codec(environ: Mapping[str, str] = os.environ) -> str | None:
    name = environ.get(ENV, "").strip()
    return None if name in ("", "none") else name


# ---- the NIXL agent's stand-in -----------------------------------------------------------


class CodecRead:
    """A READ of a peer's shadow; decoded into the cache when NIXL reports it done."""

    __slots__ = ("inner", "raw", "shadow", "raw_lens", "shadow_lens", "state", "decode_us")

    def __init__(self, inner: Any, raw: np.ndarray, shadow: np.ndarray, raw_lens: np.ndarray,
                 shadow_lens: np.ndarray) -> None:
        self.inner = inner
        self.raw, self.shadow = raw, shadow
        self.raw_lens, self.shadow_lens = raw_lens, shadow_lens
        self.state = "PROC"
        self.decode_us = 0.0

    def __repr__(self) -> str:
        return f"CodecRead({len(self.raw)} runs, {int(self.shadow_lens.sum())} bytes, {self.state})"


class CodecNixl:
    """vLLM's NIXL agent (or the ``shm_direct`` stand-in) with READs from peers of the same
    codec moved encoded (module doc)."""

    def __init__(self, agent: Any, codec_name: str) -> None:
        self._agent = agent
        self.codec_name = codec_name
        self.codec = codec(codec_name)
        self.encoded = self.codec.encoded_bytes(GROUP)
        self.dtype: torch.dtype | None = None  # the KV cache's, set before registration
        self.local: ShadowMap | None = None
        self._regions: list[tuple[int, int, int]] = []  # (raw base, bytes, shadow base)
        self._raw_views: list[tuple[int, torch.Tensor]] = []  # (base, view) per region
        self._shadows: list[torch.Tensor] = []
        self._reg_ranges: dict[int, list[tuple[int, int, int]]] = {}
        self._arrays: dict[int, tuple[Any, np.ndarray]] = {}
        self._lists: dict[int, tuple[Any, Any, np.ndarray]] = {}
        self._peers: dict[str, ShadowMap] = {}
        self.reads = 0
        self.encoded_bytes = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)

    # registration: a shadow for every DRAM region vLLM registers
    def get_reg_descs(self, descs: Any, mem_type: str = "DRAM", *args: Any, **kwargs: Any
                      ) -> Any:
        out = self._agent.get_reg_descs(descs, mem_type, *args, **kwargs)
        if mem_type == "DRAM" and isinstance(descs, list):
            self._reg_ranges[id(out)] = [(int(d[0]), int(d[1]), int(d[2])) for d in descs]
        return out

    def register_memory(self, descs: Any, *args: Any, **kwargs: Any) -> Any:
        out = self._agent.register_memory(descs, *args, **kwargs)
        ranges = self._reg_ranges.pop(id(descs), None)
        if ranges and self.dtype is not None and self.dtype.itemsize == 2:
            self._add_shadows(ranges, *args, **kwargs)
        elif ranges:
            log.warning("kv-transfer-compression %s needs a 16-bit KV cache, not %s: KV "
                        "crosses the wire raw", self.codec_name, self.dtype)
        return out

    def _add_shadows(self, ranges: list[tuple[int, int, int]], *args: Any, **kwargs: Any
                     ) -> None:
        for base, nbytes, _dev in ranges:
            if nbytes % RAW_GROUP:
                log.warning("KV region at %#x (%d bytes) is not a whole number of %d-byte groups: it "
                            "crosses the wire raw", base, nbytes, RAW_GROUP)
                continue
            shadow = torch.zeros(nbytes // RAW_GROUP * self.encoded, dtype=torch.uint8)
            self._shadows.append(shadow)
            self._raw_views.append((base, memory(base, nbytes)))
            reg = self._agent.get_reg_descs([(shadow.data_ptr(), shadow.numel(), 0, "")],
                                            "DRAM")
            self._agent.register_memory(reg, *args, **kwargs)
            self._regions.append((base, nbytes, shadow.data_ptr()))
        self.local = ShadowMap.of(self._regions, self.encoded) if self._regions else None
        if self.local is not None:
            log.info("KV crosses the NIXL wire as %s: %.2f GiB of shadow memory",
                     self.codec_name, sum(s.numel() for s in self._shadows) / 2**30)

    def get_agent_metadata(self, *args: Any, **kwargs: Any) -> bytes:
        metadata = bytes(self._agent.get_agent_metadata(*args, **kwargs))
        if self.local is None:
            return metadata
        return add_trailer(metadata, self.local.info(self.codec_name))

    def add_remote_agent(self, metadata: bytes, *args: Any, **kwargs: Any) -> Any:
        metadata, info = split_trailer(bytes(metadata))
        name = self._agent.add_remote_agent(metadata, *args, **kwargs)
        if info is None:
            return name
        if self.local is None or info.get("codec") != self.codec_name \
                or int(info.get("encoded", -1)) != self.encoded:
            log.warning("NIXL agent %s sends KV as %s, this engine reads %s: its READs are "
                        "raw", agent_text(name), info.get("codec"),
                        self.codec_name if self.local is not None else "raw")
            return name
        self._peers[agent_text(name)] = ShadowMap.from_info(info)
        return name

    def remove_remote_agent(self, agent: str | bytes) -> Any:
        self._peers.pop(agent_text(agent), None)
        return self._agent.remove_remote_agent(agent)

    # descriptor lists (as shm_direct notes them)
    def get_xfer_descs(self, descs: Any, *args: Any, **kwargs: Any) -> Any:
        out = self._agent.get_xfer_descs(descs, *args, **kwargs)
        rows = descriptor_rows(descs)
        if rows is not None:
            self._arrays[id(out)] = (out, rows)
            while len(self._arrays) > 16:
                del self._arrays[next(iter(self._arrays))]
        return out

    def prep_xfer_dlist(self, agent_name: str | bytes, xfer_list: Any, *args: Any,
                        **kwargs: Any) -> Any:
        handle = self._agent.prep_xfer_dlist(agent_name, xfer_list, *args, **kwargs)
        held = self._arrays.pop(id(xfer_list), None)
        if held is not None and held[0] is xfer_list:
            self._lists[id(handle)] = (handle, agent_name, held[1])
        return handle

    def release_dlist_handle(self, handle: Any) -> Any:
        self._lists.pop(id(handle), None)
        return self._agent.release_dlist_handle(handle)

    # the prefill side
    def encode(self, addrs: np.ndarray, lens: np.ndarray) -> int:
        """Encode the raw ranges (this engine's blocks) into the shadow; returns the raw
        bytes encoded (0 when the ranges are not all in registered regions)."""
        if self.local is None or self.dtype is None or len(addrs) == 0:
            return 0
        mapped = self.local.to_shadow(addrs, lens)
        if mapped is None:
            return 0
        raw, shadow, raw_lens, shadow_lens = merge_ranges(addrs, mapped[0], lens=lens,
                                                          other_lens=mapped[1])
        for a, s, n, m in zip(raw.tolist(), shadow.tolist(), raw_lens.tolist(),
                              shadow_lens.tolist(), strict=True):
            encode_into(self.codec, self.dtype, memory(a, n), memory(s, m))
        self.encoded_bytes += int(raw_lens.sum())
        return int(raw_lens.sum())

    def roundtrip_all(self) -> int:
        """Every registered region replaced by its codec round trip (the quality guard)."""
        if self.dtype is None:
            return 0
        for _base, view in self._raw_views:
            roundtrip(self.codec, self.dtype, view)
        return sum(v.numel() for _, v in self._raw_views)

    # the decode side
    def _copied_raw(self, agent: Any) -> bool:
        """Whether the stand-in under this one copies ``agent``'s READs (same host)."""
        peer = getattr(self._agent, "peer", None)
        return bool(callable(peer) and peer(agent) is not None)

    def make_prepped_xfer(self, operation: str, local_xfer_side: Any, local_indices: Any,
                          remote_xfer_side: Any, remote_indices: Any, notif_msg: bytes = b"",
                          *args: Any, **kwargs: Any) -> Any:
        read = None
        if operation == "READ" and self.local is not None and self._peers:
            try:
                read = self._encoded_read(local_xfer_side, local_indices, remote_xfer_side,
                                          remote_indices, notif_msg)
            except Exception:  # never worse than a raw READ
                log.exception("encoded KV READ not set up: this one goes raw")
        if read is not None:
            return read
        return self._agent.make_prepped_xfer(operation, local_xfer_side, local_indices,
                                             remote_xfer_side, remote_indices, notif_msg,
                                             *args, **kwargs)

    def _encoded_read(self, local_side: Any, local_indices: Any, remote_side: Any,
                      remote_indices: Any, notif_msg: bytes) -> CodecRead | None:
        local = self._lists.get(id(local_side))
        remote = self._lists.get(id(remote_side))
        if local is None or remote is None or local[0] is not local_side \
                or remote[0] is not remote_side or remote[1] in (LOCAL_AGENT, ""):
            return None
        peer = self._peers.get(agent_text(remote[1]))
        if peer is None or self._copied_raw(remote[1]) or self.local is None:
            return None
        li = np.asarray(local_indices, np.int64)
        ri = np.asarray(remote_indices, np.int64)
        lrows, rrows = local[2][li], remote[2][ri]
        if len(li) != len(ri) or not np.array_equal(lrows[:, 1], rrows[:, 1]):
            return None
        here = self.local.to_shadow(lrows[:, 0], lrows[:, 1])
        there = peer.to_shadow(rrows[:, 0], rrows[:, 1])
        if here is None or there is None:
            return None
        raw, dst, src, raw_lens, lens = merge_ranges(lrows[:, 0], here[0], there[0],
                                                     lens=lrows[:, 1], other_lens=here[1])
        dev_here = np.full(len(dst), lrows[0, 2] if len(lrows) else 0, np.uint64)
        dev_there = np.full(len(src), rrows[0, 2] if len(rrows) else 0, np.uint64)
        local_descs = self._agent.get_xfer_descs(np.stack([dst, lens, dev_here], 1), "DRAM")
        remote_descs = self._agent.get_xfer_descs(np.stack([src, lens, dev_there], 1), "DRAM")
        inner = self._agent.initialize_xfer("READ", local_descs, remote_descs, remote[1],
                                            notif_msg)
        return CodecRead(inner, raw, dst, raw_lens, lens)

    def transfer(self, handle: Any, notif_msg: bytes = b"") -> str:
        if isinstance(handle, CodecRead):
            state = str(self._agent.transfer(handle.inner, notif_msg))
            if state == "ERR":
                handle.state = "ERR"
            return state
        return str(self._agent.transfer(handle, notif_msg))

    def check_xfer_state(self, handle: Any) -> str:
        if not isinstance(handle, CodecRead):
            return str(self._agent.check_xfer_state(handle))
        if handle.state != "PROC":
            return handle.state
        state = str(self._agent.check_xfer_state(handle.inner))
        if state != "DONE":
            if state != "PROC":
                handle.state = state
            return state
        start = time.perf_counter()
        try:
            assert self.dtype is not None
            for a, s, n, m in zip(handle.raw.tolist(), handle.shadow.tolist(),
                                  handle.raw_lens.tolist(), handle.shadow_lens.tolist(),
                                  strict=True):
                decode_into(self.codec, self.dtype, memory(s, m), memory(a, n))
        except Exception:
            log.exception("KV received as %s could not be decoded", self.codec_name)
            handle.state = "ERR"
            return "ERR"
        handle.decode_us = (time.perf_counter() - start) * 1e6
        handle.state = "DONE"
        self.reads += 1
        return "DONE"

    def get_xfer_telemetry(self, handle: Any) -> Any:
        """NIXL's, for an encoded READ with its decode added to the transfer's time (its
        bytes are the encoded ones: what crossed the wire)."""
        if not isinstance(handle, CodecRead):
            return self._agent.get_xfer_telemetry(handle)
        t = self._agent.get_xfer_telemetry(handle.inner)
        if not hasattr(t, "xferDuration"):
            return t
        return Telemetry(startTime=t.startTime, postDuration=t.postDuration,
                         xferDuration=t.xferDuration + handle.decode_us,
                         totalBytes=t.totalBytes, descCount=t.descCount)

    def release_xfer_handle(self, handle: Any) -> Any:
        inner = handle.inner if isinstance(handle, CodecRead) else handle
        return self._agent.release_xfer_handle(inner)
