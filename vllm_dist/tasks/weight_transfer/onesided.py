"""Bounded waits of the one-sided READ path: for a peer's notification, for a read, for the
device; and the exposed name of a serve ring.

Every wait is bounded by the stall timeout, so a dead peer ends the sync on the other side with
``TransferStallError`` instead of a hang. The capabilities themselves are Protocols in
``vllm_dist.interfaces.dataplane`` (re-exported here for old imports); the messages are in
``messages.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from vllm_dist.interfaces.dataplane import (
    OneSidedCommunicator,
    ReadHandle,
    StridedReadCommunicator,
)
from vllm_dist.tasks.weight_transfer.ring import TransferStallError

POLL_S = 0.2  # how often a device wait calls its ``poll``

__all__ = [
    "OneSidedCommunicator",
    "ReadHandle",
    "StridedReadCommunicator",
    "device_synchronize",
    "poll_message",
    "ring_name",
    "wait_device",
    "wait_message",
    "wait_read",
]


def ring_name(producer_id: int, consumer_id: int) -> str:
    """The exposed name of producer ``producer_id``'s serve ring for ``consumer_id``."""
    return f"wt-ring-p{producer_id}-c{consumer_id}"


def wait_message(
    comm: OneSidedCommunicator, peer: int, timeout: float, what: str, stall: float | None = None
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


def poll_message(comm: OneSidedCommunicator, peer: int) -> bytes | None:
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


def wait_device(
    device: torch.device, timeout: float, what: str, poll: Callable[[], None] | None = None
) -> None:
    """Wait, at most ``timeout`` s, for the work queued on the current stream (asynchronous
    sends and receives included); ``TransferStallError`` instead of hanging on a dead peer.
    ``poll`` is called every ``POLL_S`` while waiting (an elastic fleet gives up on peers that
    left there, which may end their queued transfers, or raises)."""
    if device.type != "cuda":
        return
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    deadline = time.monotonic() + timeout
    polled = time.monotonic()
    while not event.query():
        now = time.monotonic()
        if now > deadline:
            raise TransferStallError(
                f"{what}: device work did not finish within the stall timeout of {timeout} s "
                "(a peer of an asynchronous transfer is dead or hung)"
            )
        if poll is not None and now - polled > POLL_S:
            polled = now
            poll()
        time.sleep(20e-6)
