from __future__ import annotations

import dataclasses
import enum
import struct

import msgpack
import pydantic
import pytest

from dynagraph.errors import InvalidRequest, PromptTooLong, RemoteError
from dynagraph.runtime.rpc._framing import (
    CANCEL,
    CREDIT,
    END,
    ERROR,
    ITEM,
    REQUEST,
    FrameDecoder,
    FrameEncoder,
    ProtocolError,
    error_body,
    error_from_body,
)


class Color(enum.Enum):
    RED = "red"


class Inner(pydantic.BaseModel):
    ids: list[int]


class Chunk(pydantic.BaseModel):
    text: str
    inner: Inner
    color: Color


@dataclasses.dataclass
class Point:
    x: int
    y: int


def decode_all(data: bytes, max_frame_bytes: int = 1 << 20) -> list[list[object]]:
    dec = FrameDecoder(max_frame_bytes)
    dec.feed(data)
    frames = []
    while (frame := dec.next()) is not None:
        frames.append(frame)
    assert dec.buffered == 0
    return frames


def test_round_trip_of_every_frame_kind() -> None:
    enc = FrameEncoder()
    data = (enc.request(7, enc.request_tail("generate", {"x-request-id": "r1"}, {"a": [1, 2]}))
            + enc.request(300, enc.request_tail("e", {}, None))
            + enc.item(7, b"\x00bytes") + enc.item(2**40, {1: "int key"}) + enc.end(7)
            + enc.cancel(9) + enc.credit(9, 65536))
    assert decode_all(data) == [
        [REQUEST, 7, "generate", {"x-request-id": "r1"}, {"a": [1, 2]}],
        [REQUEST, 300, "e", {}, None],
        [ITEM, 7, b"\x00bytes"],
        [ITEM, 2**40, {1: "int key"}],
        [END, 7],
        [CANCEL, 9],
        [CREDIT, 9, 65536],
    ]


def test_pydantic_models_dataclasses_and_enums_arrive_as_plain_values() -> None:
    enc = FrameEncoder()
    chunk = Chunk(text="hi", inner=Inner(ids=[1, 2]), color=Color.RED)
    frames = decode_all(enc.item(1, [chunk, Point(1, 2), {3, 4}]))
    assert frames == [[ITEM, 1, [{"text": "hi", "inner": {"ids": [1, 2]}, "color": "red"},
                              {"x": 1, "y": 2}, [3, 4]]]]


def test_unencodable_payload_raises_type_error() -> None:
    with pytest.raises(TypeError, match="cannot encode object"):
        FrameEncoder().item(1, object())


def test_decoder_handles_frames_split_at_every_byte() -> None:
    enc = FrameEncoder()
    data = enc.item(1, "a" * 300) + enc.item(2, 7) + enc.end(1)
    dec = FrameDecoder(1 << 20)
    frames = []
    for i in range(len(data)):
        dec.feed(data[i:i + 1])
        while (frame := dec.next()) is not None:
            frames.append(frame)
    assert frames == [[ITEM, 1, "a" * 300], [ITEM, 2, 7], [END, 1]]


def test_oversized_frame_is_refused_from_its_header() -> None:
    dec = FrameDecoder(max_frame_bytes=100)
    dec.feed(struct.pack(">I", 101))
    with pytest.raises(ProtocolError, match="exceeds max_frame_bytes=100"):
        dec.next()


def test_garbage_body_and_non_array_frame_are_protocol_errors() -> None:
    dec = FrameDecoder(100)
    dec.feed(struct.pack(">I", 1) + b"\xc1")  # 0xc1 is never valid msgpack
    with pytest.raises(ProtocolError, match="undecodable"):
        dec.next()
    body = msgpack.packb({"not": "an array"})
    dec = FrameDecoder(100)
    dec.feed(struct.pack(">I", len(body)) + body)
    with pytest.raises(ProtocolError, match="not a non-empty array"):
        dec.next()


def test_plain_exception_becomes_remote_error() -> None:
    frame = decode_all(FrameEncoder().error(3, ValueError("bad value")))[0]
    assert frame[:2] == [ERROR, 3]
    exc = error_from_body(frame[2:])
    assert isinstance(exc, RemoteError)
    assert (exc.remote_type, exc.remote_message) == ("ValueError", "bad value")


def test_wire_errors_keep_their_type_message_and_scalar_attributes() -> None:
    exc = error_from_body(error_body(PromptTooLong("too long", param="messages")))
    assert type(exc) is PromptTooLong
    assert str(exc) == "too long"
    assert exc.param == "messages" and exc.code is None


def test_local_subclass_of_a_wire_error_arrives_as_the_wire_type() -> None:
    class MyBadRequest(InvalidRequest):
        pass

    body = error_body(MyBadRequest("nope"))
    assert body[0] == "MyBadRequest"
    exc = error_from_body(body)
    assert type(exc) is InvalidRequest and str(exc) == "nope"


def test_malformed_error_frame_is_a_protocol_error() -> None:
    assert isinstance(error_from_body(["x"]), ProtocolError)


def test_body_that_is_not_exactly_one_value_of_the_announced_length() -> None:
    body = msgpack.packb([1, 2]) + b"\x01"  # one extra byte inside the frame
    dec = FrameDecoder(100)
    dec.feed(struct.pack(">I", len(body)) + body)
    with pytest.raises(ProtocolError, match="not one msgpack value"):
        dec.next()


def test_append_item_matches_item() -> None:
    enc = FrameEncoder()
    out = bytearray(b"prefix")
    size = enc.append_item(out, 5, {"a": 1})
    assert bytes(out) == b"prefix" + enc.item(5, {"a": 1})
    assert size == len(out) - len(b"prefix")


def test_buffered_counts_undecoded_bytes() -> None:
    enc = FrameEncoder()
    data = enc.item(1, 1) + enc.item(1, 2)
    dec = FrameDecoder(100)
    dec.feed(data[:-1])
    assert dec.buffered == len(data) - 1
    assert dec.next() == [ITEM, 1, 1] and dec.last_size == len(data) // 2
    assert dec.next() is None
    dec.feed(data[-1:])
    assert dec.next() == [ITEM, 1, 2] and dec.buffered == 0
