"""Serve rings, the per-group free barrier, and the small thread helpers behind them.

A ring holds K slots of one pre-allocated buffer per (producer, consumer) pair. Chunk ``seq``
goes to slot ``seq % K``; before a slot is repacked the transfer that last used it must have
completed, so a slot is never overwritten while a peer may still be reading it. Waits are
bounded by the stall timeout: a dead peer ends the sync with ``TransferStallError``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch


class TransferStallError(TimeoutError):
    """A peer made no progress within the stall timeout (it is dead, hung or mis-deployed)."""


class Waitable:
    """Anything with ``wait(timeout)`` -> bool (True once complete); a Future is adapted here."""

    def __init__(self, future: Future[Any]) -> None:
        self._future = future

    def wait(self, timeout: float | None = None) -> bool:
        try:
            self._future.result(timeout=timeout)
        except TimeoutError:
            return False
        return True

    def done(self) -> bool:
        return self._future.done()

    def add_done_callback(self, fn: Callable[[Future[Any]], Any]) -> None:
        self._future.add_done_callback(fn)


def wait_or_stall(handle: Any, timeout: float, what: str) -> None:
    """Wait on ``handle``, raising ``TransferStallError`` when ``wait(timeout)`` returns False or
    raises ``TimeoutError`` (both conventions exist among communicators)."""
    try:
        finished = handle.wait(timeout) is not False
    except TransferStallError:
        raise
    except TimeoutError:
        finished = False
    if not finished:
        raise TransferStallError(
            f"{what}: no progress within the stall timeout of {timeout} s; the peer is dead or "
            "hung (raise TransferConfig.stall_timeout if transfers are just slow)"
        )


class SerialWorker:
    """One daemon thread running calls in submission order (one per peer keeps pair order).

    Daemon, so a call blocked on a dead peer never keeps the process from exiting.
    """

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], Any]) -> Waitable:
        future: Future[Any] = Future()
        self._queue.put((fn, future))
        return Waitable(future)

    def _loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            fn, future = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiter
                future.set_exception(exc)

    def close(self) -> None:
        self._queue.put(None)


class ServeRing:
    """K slots of ``slot_bytes`` over one buffer; slot ``seq % K`` serves chunk ``seq``."""

    def __init__(self, buffer: torch.Tensor, slots: int, slot_bytes: int) -> None:
        if buffer.numel() < slots * slot_bytes:
            raise ValueError(f"buffer of {buffer.numel()} B cannot hold {slots}x{slot_bytes} B")
        self.buffer = buffer
        self.slots = slots
        self.slot_bytes = slot_bytes
        self._in_flight: list[tuple[int, Any] | None] = [None] * slots

    def acquire(self, seq: int, nbytes: int, timeout: float, what: str) -> torch.Tensor:
        """The first ``nbytes`` of slot ``seq % K``, once its previous transfer has completed."""
        i = seq % self.slots
        prev = self._in_flight[i]
        if prev is not None:
            prev_seq, handle = prev
            if prev_seq >= seq:
                raise RuntimeError(f"ring slot {i}: seq {seq} issued after {prev_seq}")
            wait_or_stall(handle, timeout, f"{what}: slot {i} still holds chunk {prev_seq}")
            self._in_flight[i] = None
        start = i * self.slot_bytes
        return self.buffer[start : start + nbytes]

    def in_flight(self, seq: int, handle: Any) -> None:
        """Mark slot ``seq % K`` busy until ``handle`` completes."""
        self._in_flight[seq % self.slots] = (seq, handle)

    def drain(self, timeout: float, what: str) -> None:
        for i, entry in enumerate(self._in_flight):
            if entry is not None:
                wait_or_stall(entry[1], timeout, f"{what}: slot {i} (chunk {entry[0]})")
                self._in_flight[i] = None


class FreeBarrier:
    """Counts arrivals per group; a group is free once every expected arrival came in.

    ``arrive`` may be called from any thread; ``pop_free`` returns the groups freed since the
    last call, in group order.
    """

    def __init__(self, expected: dict[int, int]) -> None:
        self._left = {g: n for g, n in expected.items() if n > 0}
        self._freed: list[int] = [g for g, n in expected.items() if n <= 0]
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)

    def arrive(self, g: int) -> None:
        with self._cond:
            if g not in self._left:
                raise RuntimeError(f"free barrier: unexpected arrival for group {g}")
            self._left[g] -= 1
            if self._left[g] == 0:
                del self._left[g]
                self._freed.append(g)
                self._cond.notify_all()

    def pop_free(self) -> list[int]:
        with self._lock:
            out, self._freed = sorted(self._freed), []
            return out

    def wait_all(self, timeout: float) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: not self._left, timeout=timeout):
                raise TransferStallError(
                    f"groups {sorted(self._left)[:8]} were not freed by every consumer within "
                    f"the stall timeout of {timeout} s"
                )
