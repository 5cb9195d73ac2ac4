"""The one-sided READ path: the API it needs from a communicator, and its two messages.

A producer exposes every serve ring once at set-up; everyone exchanges the descriptors. Each
sync, the producer announces every chunk to its consumer as ``(sync, seq, offset, nbytes,
source, descriptor, strides)``: a one-item chunk whose source view is contiguous and whose
storage was there last sync is read *in place* (its storage is exposed once, the descriptor
rides along with the first announcement to each consumer, and nothing is packed); any other
chunk is packed into the pair's next ring slot (round robin in issue order over the chunks
packed this sync, so chunks read in place take no slot) once the slot's last reader is done;
consumers stage likewise, round robin over the chunks whose parameter view is not contiguous.

Strided reads. A consumer whose communicator maps its peers' memory (``StridedReadCommunicator``:
CUDA IPC on one node) asks for them at set-up. Its producers then announce non-contiguous views
(the row-parallel slice of a weight) in place too, with their strides, and the consumer copies
each straight from the producer's weight into its parameter — through its own re-layout
(a transpose) where that is a view — with one copy kernel: no pack on the producer, no staging
and no unpack on the consumer, a third of the memory traffic of pack, read and unpack. Small
weights (expert shards) that a trainer keeps in one flat buffer (Megatron's parameter buffers,
flat FSDP parameters) are read in place too where the consumer maps the producer's memory, a
chunk of them at a time: the announcement gives each item's offset and strides in the buffer
(``SPREAD``); through NIXL (a descriptor per row) they are packed. What is still packed (small weights
in storages of their own) the consumer copies item by item from the producer's ring slot on the
same mapping straight into its parameters (``mapped_unpack``): pack and one copy, where read
and unpack were two. Announcements are batched until the
next group, the next wait, or ``_ANNOUNCE_BYTES`` of queued chunks, and one device
synchronization covers every pack behind them, so a layer costs one message, not one per weight.

The consumer turns everything announced into one ``read_batch_async`` per producer (straight
into its parameters where the destination is contiguous, else into staging slots), keeps up to
``_BATCHES_IN_FLIGHT`` such batches posted, completes them in plan order with one unpack launch
per batch and reports ``done(sync, seq)`` — every chunk of that pair up to ``seq`` — whenever it
runs out of finished reads; the producer then reuses slots and, once every chunk of a gather
group is done, releases the group. Control costs grow with the number of groups and waits, not
with the number of chunks or names (measured before batching: about 250 µs per chunk on one
H200). Every wait is bounded by the stall timeout, so a dead peer ends the sync on the other
side with ``TransferStallError``.

A sync whose every chunk is where the previous sync announced it (the trainer wrote in place) is
one ``replay_message`` per consumer instead of its announcements; the consumer answers with one
'done' for the pair's last chunk (see the engine's "Steady state").

Rejected alternative: producers WRITE into consumer buffers (push). The producer's thread would
move every byte for every consumer, where here it only packs what is not contiguous and each
consumer moves its own bytes, overlapped with its unpacking.
"""

from __future__ import annotations

import pickle
import struct
import time
from collections.abc import Sequence
from typing import Any

import torch

from vllm_dist.interfaces.dataplane import (
    OneSidedCommunicator,
    ReadHandle,
    StridedReadCommunicator,
)
from vllm_dist.tasks.weight_transfer.ring import TransferStallError

__all__ = ["OneSidedCommunicator", "ReadHandle", "StridedReadCommunicator"]  # moved to interfaces


_DONE = struct.Struct("<cqq")  # b"D", sync, seq: every chunk of the pair up to seq is read
_REPLAY = struct.Struct("<cq")  # b"P", sync: every chunk is where the previous sync had it
_ALIVE = struct.Struct("<cq")  # b"A", sync: busy reading other producers (``alive_message``)

Announcement = tuple[int, int, int, int, "str | None", Any, Any]
"""(sync, seq, offset, nbytes, source, descriptor, strides): chunk ``seq`` is ready at byte
``offset`` of the pair's ring (``source`` None) or of the exposed buffer ``source``, whose
descriptor travels along the first time (else None). ``strides``: None for packed bytes, else
the element strides of the producer's view there (a one-item chunk read in place, strided where
the consumer asked for strided reads). A chunk of several items read in place (the consumer
maps the producer's memory and every item lies in one storage, a trainer's flat buffer) has
offset ``SPREAD`` and, as strides, ``(byte offset, element strides)`` per item."""

SPREAD = -1
"""The offset of an announced chunk whose items are read in place one by one (``Announcement``)."""


def ring_name(producer_id: int, consumer_id: int) -> str:
    """The exposed name of producer ``producer_id``'s serve ring for ``consumer_id``."""
    return f"wt-ring-p{producer_id}-c{consumer_id}"


def ready_message(announcements: Sequence[Announcement]) -> bytes:
    """One message announcing several ready chunks of one pair, in seq order."""
    return b"R" + pickle.dumps(list(announcements))


def done_message(sync: int, seq: int) -> bytes:
    return _DONE.pack(b"D", sync, seq)


def alive_message(sync: int) -> bytes:
    """'Still in sync ``sync``, reading other producers first': a consumer takes chunks in plan
    order, so a producer late in the plan may wait on it for longer than the stall timeout
    while it reads a slow producer early in the plan. Between batches and while it waits for
    an announcement, it sends this to the producers it owes a 'done' that have not heard from
    it for a quarter of the stall timeout; a producer waiting on it in that sync starts its
    wait over."""
    return _ALIVE.pack(b"A", sync)


def alive_sync(msg: bytes) -> int | None:
    """The sync of an 'alive' message, or None for any other message."""
    if len(msg) != _ALIVE.size or msg[:1] != b"A":
        return None
    return int(_ALIVE.unpack(msg)[1])


def replay_message(sync: int) -> bytes:
    """'Sync ``sync`` is ready, every chunk where the previous sync announced it': the whole
    sync in one message (see ``WeightProducer``'s steady state)."""
    return _REPLAY.pack(b"P", sync)


def parse_replay(msg: bytes) -> int | None:
    """The sync of a replay message, or None for any other message."""
    if len(msg) != _REPLAY.size or msg[:1] != b"P":
        return None
    return int(_REPLAY.unpack(msg)[1])


def parse_ready(msg: bytes, what: str) -> list[Announcement]:
    """The announcements of a ready message; ``RuntimeError`` for anything else.

    Unpickled: ready messages come from producers, which consumers trust (it is the producer
    that refuses what a consumer asks for, never the other way round).
    """
    if msg[:1] != b"R":
        raise RuntimeError(f"{what}: expected a 'ready' message, got {msg[:32]!r}")
    return list(pickle.loads(msg[1:]))


def parse_done(msg: bytes, what: str) -> tuple[int, int]:
    """(sync, seq) of a done message; ``RuntimeError`` for anything else."""
    if len(msg) != _DONE.size or msg[:1] != b"D":
        raise RuntimeError(f"{what}: expected a 'done' message, got {msg[:32]!r}")
    _, sync, seq = _DONE.unpack(msg)
    return sync, seq


def wait_message(
    comm: Any, peer: int, timeout: float, what: str, stall: float | None = None
) -> bytes:
    """The next notification from ``peer``; ``TransferStallError`` when none came within
    ``timeout`` (the rest of a wait of ``stall`` s, when given: the error names that)."""
    try:
        return bytes(comm.wait_notification(peer, max(timeout, 0.0)))
    except TimeoutError as exc:
        raise TransferStallError(
            f"{what}: no message from rank {peer} within the stall timeout of "
            f"{timeout if stall is None else stall} s; the peer is dead or hung (raise "
            "TransferConfig.stall_timeout if transfers are just slow)"
        ) from exc


def poll_message(comm: Any, peer: int) -> bytes | None:
    """The next notification from ``peer`` if one has arrived, else None (never blocks)."""
    try:
        return bytes(comm.wait_notification(peer, 0.0))
    except TimeoutError:
        return None


def wait_read(handle: Any, timeout: float, what: str) -> None:
    """Wait for a read; ``TransferStallError`` when it did not finish within ``timeout``."""
    try:
        finished = handle.wait(timeout) is not False
    except TimeoutError:
        finished = False
    if not finished:
        raise TransferStallError(f"{what}: the read did not finish within {timeout} s")


def device_synchronize(device: torch.device) -> None:
    """Wait for the current stream's copies: a peer must not read bytes still being packed."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def wait_device(device: torch.device, timeout: float, what: str) -> None:
    """Wait, at most ``timeout`` s, for the work queued on the current stream (asynchronous
    sends and receives included); ``TransferStallError`` instead of hanging on a dead peer."""
    if device.type != "cuda":
        return
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    deadline = time.monotonic() + timeout
    while not event.query():
        if time.monotonic() > deadline:
            raise TransferStallError(
                f"{what}: device work did not finish within the stall timeout of {timeout} s "
                "(a peer of an asynchronous transfer is dead or hung)"
            )
        time.sleep(20e-6)
