"""The weight-transfer wire messages: round trips, and bytes that are refused when decoded."""

from __future__ import annotations

import pickle
import struct
import zlib
from typing import Any

import pytest

from vllm_dist.tasks.weight_transfer.index import build_index
from vllm_dist.tasks.weight_transfer.messages import (
    MAX_DESCRIPTOR,
    SPREAD,
    VERSION,
    Alive,
    Announcement,
    Done,
    MessageError,
    ProducerFacts,
    Ready,
    ReadyCodec,
    Replay,
    decode_consumer_message,
    decode_held,
    encode_alive,
    encode_done,
    encode_held,
    encode_replay,
    metadata_digest,
)
from vllm_dist.tasks.weight_transfer.source import WeightMeta

_DESC = b'{"v":1,"name":"wt-src-p0-1"}'  # opaque to the codec: the communicator reads it
_ANNOUNCEMENTS = [
    Announcement(3, 0, 0, 4096),  # packed into the ring
    Announcement(3, 1, 512, 1024, "wt-src-p0-1", None, _DESC),  # in place, first sight
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


def test_descriptor_only_on_first_sight() -> None:
    codec = ReadyCodec()
    first = Announcement(3, 1, 512, 1024, "wt-src-p0-1", None, _DESC)
    steady = Announcement(4, 1, 512, 1024, "wt-src-p0-1")
    got = ReadyCodec().decode(codec.encode([first]), "test")
    assert isinstance(got, Ready) and got.announcements == [first]
    assert got.announcements[0].descriptor == _DESC
    grown = len(codec.encode([first])) - len(codec.encode([steady]))
    assert grown == 4 + len(_DESC)  # a length prefix and the bytes, nothing else
    with pytest.raises(ValueError, match="for a named source"):
        codec.encode([Announcement(3, 0, 0, 64, None, None, _DESC)])
    with pytest.raises(ValueError, match="descriptor of 0 bytes"):
        codec.encode([Announcement(3, 0, 0, 64, "wt-src-p0-1", None, b"")])


def _with_descriptor_length(length: int) -> bytes:
    """A one-announcement 'ready' message whose descriptor length field says ``length``."""
    msg = bytearray(
        ReadyCodec().encode([Announcement(3, 1, 512, 1024, "wt-src-p0-1", None, _DESC)])
    )
    at = msg.index(_DESC) - 4
    struct.pack_into("<I", msg, at, length)
    return bytes(msg)


def test_bad_descriptor_lengths_are_refused() -> None:
    msg = ReadyCodec().encode([Announcement(3, 1, 512, 1024, "wt-src-p0-1", None, _DESC)])
    with pytest.raises(MessageError, match="cut short in a descriptor"):
        ReadyCodec().decode(msg[:-3], "test")  # truncated inside the descriptor
    with pytest.raises(MessageError, match="cut short in a descriptor"):
        ReadyCodec().decode(_with_descriptor_length(len(_DESC) + 1), "test")  # past the end
    with pytest.raises(MessageError, match="stray bytes"):
        ReadyCodec().decode(_with_descriptor_length(len(_DESC) - 1), "test")
    with pytest.raises(MessageError, match=f"descriptor of {MAX_DESCRIPTOR + 1} bytes"):
        ReadyCodec().decode(_with_descriptor_length(MAX_DESCRIPTOR + 1), "test")
    with pytest.raises(MessageError, match="descriptor of 0 bytes"):
        ReadyCodec().decode(_with_descriptor_length(0), "test")
    with pytest.raises(MessageError, match="malformed 'ready'"):
        ReadyCodec().decode(msg[: msg.index(_DESC) - 2], "test")  # cut in the length itself


# -- producer facts --------------------------------------------------------------------------------
_METAS = tuple(
    WeightMeta(name=f"layers.{i // 2}.w{i % 2}", dtype="torch.bfloat16", shape=(4, i + 1))
    for i in range(8)
)


def _wire(facts: ProducerFacts) -> ProducerFacts:
    back = pickle.loads(pickle.dumps(facts))  # our own bytes, as all_gather_object hands them
    assert isinstance(back, ProducerFacts)
    return back


def test_facts_ship_the_metadata_once() -> None:
    held = frozenset(m.name for m in _METAS[:4])
    shipped = _wire(ProducerFacts(metadata=_METAS, held=held))
    assert shipped.metadata == _METAS and shipped.held == held
    light = _wire(ProducerFacts(metadata=_METAS, held=held, ships_metadata=False))
    assert light.metadata is None and light.digest == metadata_digest(_METAS)
    assert light.held_blob is not None and decode_held(light.held_blob, "test") == list(_METAS[:4])
    everything = _wire(ProducerFacts(metadata=_METAS, held=None, ships_metadata=False))
    assert everything.held_blob is None and everything.held is None
    assert _wire(light) == light  # a joining consumer gets them again from producer 0
    assert len(pickle.dumps(everything)) < 200  # a digest, not the model


def test_facts_from_many_producers_build_the_same_index() -> None:
    halves = [frozenset(m.name for m in _METAS[:4]), frozenset(m.name for m in _METAS[4:])]
    facts = [
        ProducerFacts(metadata=_METAS, held=halves[p % 2], ships_metadata=p == 0) for p in range(4)
    ]
    wired = build_index([_wire(f) for f in facts], 2, 2)
    local = build_index(facts, 2, 2)
    assert wired.holders == local.holders and wired.names == local.names
    assert wired.router.owner_sets == [[0, 2], [1, 3]]
    assert wired.holders["layers.3.w1"] == [1, 3]


def test_facts_that_disagree_are_refused() -> None:
    other = (*_METAS[:-1], WeightMeta(name=_METAS[-1].name, dtype="torch.float32", shape=(4, 8)))
    ok = ProducerFacts(metadata=_METAS, held=None)
    with pytest.raises(ValueError, match="describes another model"):
        build_index(
            [ok, _wire(ProducerFacts(metadata=other, held=None, ships_metadata=False))], 1, 0
        )
    mine = frozenset([other[-1].name])
    with pytest.raises(ValueError, match="disagree on weight 'layers.3.w1'"):
        build_index(
            [ok, _wire(ProducerFacts(metadata=other, held=mine, ships_metadata=False))], 1, 0
        )
    light = _wire(ProducerFacts(metadata=_METAS, held=None, ships_metadata=False))
    with pytest.raises(ValueError, match="must ship it"):
        build_index([light, light], 1, 0)


def test_malformed_facts_are_refused() -> None:
    blob = encode_held(list(_METAS))
    assert decode_held(blob, "test") == list(_METAS)
    with pytest.raises(MessageError, match="malformed held names"):
        decode_held(blob[:-3], "test")
    with pytest.raises(MessageError, match="malformed held names"):
        decode_held(zlib.compress(zlib.decompress(blob) + b"\0"), "test")
    with pytest.raises(MessageError, match="malformed held names"):
        decode_held(b"not zlib", "test")
    with pytest.raises(MessageError, match="32-byte digest"):
        ProducerFacts(metadata=None, held=None, digest=b"short")
    with pytest.raises(MessageError, match="must be bytes"):
        pickle.loads(_facts_bad())


def _facts_bad() -> bytes:
    """A pickle of facts whose digest is not bytes (what a confused peer could send)."""
    from vllm_dist.tasks.weight_transfer import messages

    class Bad:
        def __reduce__(self) -> Any:
            return (messages._facts_from_wire, ("digest", None))

    return pickle.dumps(Bad())
