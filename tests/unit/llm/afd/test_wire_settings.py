"""Frames on a real socket pair (with a file descriptor), and the AFD file."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch

from dynagraph.llm.afd.errors import ChannelError
from dynagraph.llm.afd.settings import (
    AfdEngineConfig,
    AfdOptions,
    PeerInfo,
    read_engine_config,
    write_engine_config,
)
from dynagraph.llm.afd.wire import (
    FfnCall,
    FfnResult,
    Hello,
    dtype_name,
    recv_header,
    recv_tensor,
    send_frame,
    tensor_bytes,
)


def test_frames_carry_headers_payloads_and_descriptors() -> None:
    a, b = socket.socketpair(socket.AF_UNIX)
    with a, b:
        x = torch.arange(12, dtype=torch.float32).view(3, 4).to(torch.bfloat16)
        send_frame(a, FfnCall(seq=7, layer=2, rows=3, nbytes=24), tensor_bytes(x))
        msg, _ = recv_header(b)
        assert msg == FfnCall(seq=7, layer=2, rows=3, nbytes=24)
        assert torch.equal(recv_tensor(b, 3, 4, torch.bfloat16, 24), x)
        r, w = os.pipe()
        try:
            send_frame(a, Hello(version=1, model="m", hidden_size=4, dtype="bfloat16",
                                client="c", shm_bytes=8), fds=[r])
            msg, fds = recv_header(b, with_fds=True)
            assert isinstance(msg, Hello) and msg.shm_bytes == 8 and len(fds) == 1
            os.write(w, b"ok")
            assert os.read(fds[0], 2) == b"ok"
            os.close(fds[0])
        finally:
            os.close(r)
            os.close(w)
        send_frame(a, FfnResult(seq=1, rows=0, error="boom"))
        msg, _ = recv_header(b)
        assert isinstance(msg, FfnResult) and msg.error == "boom"
        a.sendall(b"\x00\x00\x00\x03abc")  # not msgpack of a known frame
        with pytest.raises(ChannelError, match="malformed"):
            recv_header(b)
        a.close()
        with pytest.raises(ChannelError, match="closed"):
            recv_header(b)


def test_payload_size_must_match() -> None:
    a, b = socket.socketpair()
    with a, b:
        with pytest.raises(ChannelError, match="does not hold"):
            recv_tensor(b, 2, 4, torch.bfloat16, 10)


def test_dtype_names() -> None:
    assert dtype_name(torch.bfloat16) == "bfloat16"
    with pytest.raises(ValueError):
        dtype_name(torch.int8)


def test_engine_config_round_trips_and_options_are_kebab(tmp_path: Path) -> None:
    opts = AfdOptions.model_validate({"transport": "tcp", "ping-pong": False,
                                      "failover-timeout-s": 3})
    cfg = AfdEngineConfig(model="m", error_file="/tmp/e",
                          peers=[PeerInfo(instance="a", model="m", tcp="h:1", layers=[0])],
                          **opts.model_dump())
    path = tmp_path / "afd.json"
    write_engine_config(path, cfg)
    assert read_engine_config(path) == cfg
    assert [p.name for p in tmp_path.iterdir()] == ["afd.json"]  # no temp file left
    with pytest.raises(ValueError):
        AfdOptions.model_validate({"transprot": "tcp"})
