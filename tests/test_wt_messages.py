"""The weight-transfer wire messages: round trips, and bytes that are refused when decoded."""

from __future__ import annotations

import struct

import pytest

from vllm_dist.tasks.weight_transfer.messages import (
    SPREAD,
    VERSION,
    Alive,
    Announcement,
    Done,
    MessageError,
    Ready,
    ReadyCodec,
    Replay,
    decode_consumer_message,
    encode_alive,
    encode_done,
    encode_replay,
)

_ANNOUNCEMENTS = [
    Announcement(3, 0, 0, 4096),  # packed into the ring
    Announcement(3, 1, 512, 1024, "wt-src-p0-1", None, True),  # in place, contiguous
    Announcement(3, 2, 64, 2048, "wt-src-p0-1", (1, 4096)),  # in place, strided
    Announcement(3, 3, SPREAD, 96, "wt-src-p0-2", ((0, (1,)), (256, (8, 1)), (1024, ()))),
]


def test_ready_round_trip() -> None:
    sender, receiver = ReadyCodec(), ReadyCodec()
    msg = sender.encode(_ANNOUNCEMENTS)
    got = receiver.decode(msg, "test")
    assert isinstance(got, Ready) and got.announcements == _ANNOUNCEMENTS
    again = receiver.decode(sender.encode(_ANNOUNCEMENTS), "test")
    assert isinstance(again, Ready)
    assert again.announcements[3].strides is got.announcements[3].strides  # decoded once


def test_small_messages_round_trip() -> None:
    assert ReadyCodec().decode(encode_replay(7), "test") == Replay(7)
    assert decode_consumer_message(encode_done(7, 12), "test") == Done(7, 12)
    assert decode_consumer_message(encode_alive(9), "test") == Alive(9)


def test_wrong_version_is_refused() -> None:
    msg = bytearray(encode_done(1, 2))
    msg[2] = VERSION + 1
    with pytest.raises(MessageError, match=f"version {VERSION + 1}.*speaks {VERSION}"):
        decode_consumer_message(bytes(msg), "test")


def test_wrong_length_is_refused() -> None:
    with pytest.raises(MessageError, match="'done' message of 19 bytes, expected 20"):
        decode_consumer_message(encode_done(1, 2)[:-1], "test")
    with pytest.raises(MessageError, match="shorter than its header"):
        decode_consumer_message(b"WT", "test")
    ready = ReadyCodec().encode(_ANNOUNCEMENTS)
    with pytest.raises(MessageError, match="malformed 'ready'|cut short"):
        ReadyCodec().decode(ready[:-5], "test")
    with pytest.raises(MessageError, match="stray bytes"):
        ReadyCodec().decode(ready + b"\0", "test")


def test_wrong_type_is_refused() -> None:
    with pytest.raises(MessageError, match="expected 'done' or 'alive', got a 'replay'"):
        decode_consumer_message(encode_replay(1), "test")
    with pytest.raises(MessageError, match="expected 'ready' or 'replay', got a 'done'"):
        ReadyCodec().decode(encode_done(1, 2), "test")
    with pytest.raises(MessageError, match="not a weight-transfer message"):
        decode_consumer_message(b"\x80\x04" + struct.pack("<qq", 1, 2), "test")
    with pytest.raises(MessageError, match="unknown message kind 9"):
        decode_consumer_message(b"WT" + bytes((VERSION, 9)), "test")
