"""Handles of issued transfers, and prepared read sets that are posted again and again.

A ``NixlTransfer`` is one NIXL request (or copies on a mapping, or several of either) to
``wait`` for; a ``PreparedReads`` is a fixed set of reads laid out once. Both talk to the
communicator's ``Transport`` only, which owns the agent and the registrations they hold.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm_dist.implementations.communicators.nixl.agent import (
    NixlTimeoutError,
    NixlTransferError,
    Registration,
    device_id,
    mem_type,
    nixl_errors,
)
from vllm_dist.memory import CopyProgram, StreamPool

if TYPE_CHECKING:
    from nixl._api import nixl_xfer_handle

    from vllm_dist.implementations.communicators.nixl.descriptors import ExposedBuffer
    from vllm_dist.implementations.communicators.nixl.transport import Transport


class Backoff:
    """Spin for the first few ms, then sleep in short pauses that grow only for long waits.

    A sleep that overshoots a transfer's end is pure loss on the bandwidth a caller sees, so
    pauses stay at 20 µs for the first 100 ms and reach 1 ms only when a dead peer is likely.
    With ``spin_s`` 0 (DRAM) the waiter never spins and pauses a twentieth of the wait so far
    (20 µs to 1 ms): on few cores a polling waiter takes CPU from the processes moving bytes.
    """

    def __init__(self, spin_s: float) -> None:
        self._start = time.monotonic()
        self._spin_s = spin_s

    def sleep(self) -> None:
        waited = time.monotonic() - self._start
        if waited < self._spin_s:
            return
        if not self._spin_s:
            time.sleep(min(1e-3, max(20e-6, waited / 20)))
            return
        time.sleep(20e-6 if waited < 0.1 else 1e-3)


class NixlTransfer:
    """An issued NIXL request. ``wait(timeout)`` blocks (bounded); ``done()`` polls.

    Errors surface from ``wait``/``done`` as ``NixlTransferError`` / ``NixlTimeoutError``. The
    handle is released as soon as the request finishes or fails.
    """

    def __init__(
        self,
        transport: Transport,
        handle: nixl_xfer_handle | None,
        regs: list[Registration],
        what: str,
    ) -> None:
        self._transport = transport
        self._handle: nixl_xfer_handle | None = handle
        self._regs = regs
        self._what = what
        self._error: BaseException | None = None

    def done(self) -> bool:
        """True once the bytes have landed; raises if the transfer failed."""
        if self._error is not None:
            raise self._error
        if self._handle is None:
            return True
        try:
            with nixl_errors(self._what):
                state = self._transport.agent().check_xfer_state(self._handle)
        except NixlTransferError as exc:
            self._fail(exc)
            raise
        if state == "PROC":
            return False
        if state == "DONE":
            self._finish()
            return True
        self._fail(NixlTransferError(f"{self._what} failed (NIXL state {state})"))
        raise self._error  # type: ignore[misc]

    def wait(self, timeout: float | None = None) -> None:
        """Block until done, at most ``timeout`` s (default: the communicator's timeout)."""
        seconds = self._transport.timeout(timeout)
        deadline = time.monotonic() + seconds
        poll = Backoff(self._transport.spin_s)
        while not self.done():
            if time.monotonic() > deadline:
                self._fail(
                    NixlTimeoutError(
                        f"{self._what} did not complete within {seconds} s; "
                        "the peer may be dead or overloaded (raise the 'timeout' option if not)"
                    )
                )
                raise self._error  # type: ignore[misc]
            poll.sleep()

    def _finish(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            self._transport.release(handle, self._regs)

    def _fail(self, error: BaseException) -> None:
        self._error = error
        handle, self._handle = self._handle, None
        if handle is not None:
            self._transport.release(handle, self._regs, failed=True)


class CopyTransfer(NixlTransfer):
    """A same-node transfer done by copies on a mapping: CUDA IPC (done when ``event`` is) or
    shared memory (``event`` None: the copies ran before it was made)."""

    def __init__(self, transport: Transport, event: torch.cuda.Event | None, what: str) -> None:
        super().__init__(transport, None, [], what)
        self._event: torch.cuda.Event | None = event

    def done(self) -> bool:
        if self._event is None or self._event.query():
            self._event = None
            return True
        return False

    def wait(self, timeout: float | None = None) -> None:
        seconds = self._transport.timeout(timeout)
        deadline = time.monotonic() + seconds
        poll = Backoff(self._transport.spin_s)
        while not self.done():
            if time.monotonic() > deadline:
                raise NixlTimeoutError(f"{self._what} did not complete within {seconds} s")
            poll.sleep()


class JoinedTransfer(NixlTransfer):
    """Several transfers that are done when all of them are."""

    def __init__(self, transport: Transport, parts: list[NixlTransfer], what: str) -> None:
        super().__init__(transport, None, [], what)
        self._parts = parts

    def done(self) -> bool:
        return all([part.done() for part in self._parts])  # each polled: errors surface

    def wait(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + self._transport.timeout(timeout)
        for part in self._parts:
            part.wait(max(deadline - time.monotonic(), 1e-3))


def settled(xfer: NixlTransfer) -> bool:
    """Whether ``xfer`` is over, landed or failed (its waiter saw the error)."""
    try:
        return xfer.done()
    except NixlTransferError:
        return True


class PreparedReads:
    """A set of READs from one peer laid out once (``prepare_reads``); ``post`` starts them.

    One post at a time: wait for a post's transfer before the next. ``close`` releases what the
    set holds (a NIXL request, a CUDA graph); it is idempotent.
    """

    def __init__(self, transport: Transport, peer: int, what: str) -> None:
        self._transport = transport
        self._peer = peer
        self._what = what
        self._last: NixlTransfer | None = None
        self.posts = 0

    @property
    def peer(self) -> int:
        """The rank the set reads from."""
        return self._peer

    def post(self) -> NixlTransfer:
        """Start the reads; returns a transfer to ``wait`` for."""
        if self._last is not None and not settled(self._last):
            raise RuntimeError(f"{self._what}: posted again while the last post is in flight")
        self._last = self._post()
        self.posts += 1
        return self._last

    def _post(self) -> NixlTransfer:
        raise NotImplementedError

    @property
    def graphed(self) -> bool:
        """Whether posts replay a CUDA graph (see ``NixlOptions.cuda_graphs``)."""
        return False

    def close(self) -> None:  # noqa: B027 - nothing to release by default
        """Release what the set holds."""


class PreparedCopies(PreparedReads):
    """Copies on mappings, one ``CopyProgram`` (on CUDA IPC a CUDA graph at the first post)."""

    def __init__(
        self,
        transport: Transport,
        peer: int,
        copies: list[tuple[torch.Tensor, torch.Tensor, int]],
        *,
        streams: StreamPool | None,
    ) -> None:
        what = f"prepared READ of rank {peer}'s buffers {transport.maps.via}"
        super().__init__(transport, peer, what)
        pairs = [(d, s) for d, s, n in copies if n]  # byte views are sliced to n already
        self._program = CopyProgram([d for d, _ in pairs], [s for _, s in pairs], streams=streams)

    @classmethod
    def merged(
        cls,
        transport: Transport,
        peer: int,
        sets: list[PreparedCopies],
        *,
        streams: StreamPool | None,
    ) -> PreparedCopies:
        """One set of what ``sets`` copy, planned by none (``CopyProgram.merged``)."""
        self = cls.__new__(cls)
        PreparedReads.__init__(self, transport, peer, sets[0]._what)
        self._program = CopyProgram.merged([p._program for p in sets], streams=streams)
        return self

    def _post(self) -> NixlTransfer:
        self._program.run()
        return self._transport.copied(self._what)

    @property
    def graphed(self) -> bool:
        return self._program.graphed

    @property
    def graph_error(self) -> str | None:
        return self._program.graph_error

    def close(self) -> None:
        self._program.close()


class PreparedBoth(PreparedReads):
    """Reads of one peer's unmapped buffers (a NIXL request) and of its mapped ones (copies),
    posted together: the request first, so that the copies run while it is in flight."""

    def __init__(self, transport: Transport, peer: int, sets: list[PreparedReads]) -> None:
        super().__init__(transport, peer, " and ".join(p._what for p in sets))
        self._sets = sets

    def _post(self) -> NixlTransfer:
        started: list[NixlTransfer] = []
        try:
            for prepared in self._sets:
                started.append(prepared.post())
        except BaseException:
            for xfer in started:  # nothing may still write into the caller's tensors
                with contextlib.suppress(NixlTransferError):
                    xfer.wait()
            raise
        return JoinedTransfer(self._transport, started, self._what)

    @property
    def graphed(self) -> bool:
        return any(p.graphed for p in self._sets)

    def close(self) -> None:
        for prepared in self._sets:
            prepared.close()


Piece = tuple[torch.Tensor, int, int, "ExposedBuffer"]  # (local view, remote offset, nbytes, buf)


class PreparedXfer(PreparedReads):
    """One NIXL request built once and reposted; rebuilt when the peer's metadata changed."""

    def __init__(self, transport: Transport, peer: int, pieces: list[Piece]) -> None:
        names = sorted({p[3].name for p in pieces})
        more = " ..." if len(names) > 3 else ""
        super().__init__(
            transport,
            peer,
            f"prepared READ of {', '.join(map(repr, names[:3]))}{more} on rank {peer}",
        )
        self._pieces = [p for p in pieces if p[2] > 0]
        self._handle: nixl_xfer_handle | None = None
        self._regs: list[Registration] = []
        self._epoch = -1

    def _build(self) -> None:
        tp = self._transport
        agent = tp.agent()
        local = np.empty((len(self._pieces), 3), dtype=np.uint64)
        remote = np.empty((len(self._pieces), 3), dtype=np.uint64)
        regs = []
        for i, (view, off, n, r) in enumerate(self._pieces):
            reg = tp.cache.register(view)
            reg.inflight += 1  # not evicted by the registrations that follow
            regs.append(reg)
            local[i] = (view.data_ptr(), n, device_id(view))
            remote[i] = (r.addr + off, n, r.device_id)
        try:
            with nixl_errors(f"{self._what}: creating the request"):
                self._handle = agent.initialize_xfer(
                    "READ",
                    agent.get_xfer_descs(local, mem_type(tp.device)),
                    agent.get_xfer_descs(remote, self._pieces[0][3].mem_type),
                    tp.peers.agent_of[self._peer],
                    b"",
                )
        except BaseException:
            for reg in regs:
                reg.inflight -= 1
            raise
        tp.live_xfers += 1
        self._regs = regs
        self._epoch = tp.peers.known_epoch[self._peer]

    def _post(self) -> NixlTransfer:
        tp = self._transport
        if not self._pieces:
            return NixlTransfer(tp, None, [], self._what)
        if self._handle is not None and self._epoch != tp.peers.known_epoch[self._peer]:
            self.close()  # the peer's metadata was reloaded: descriptors must be resolved again
        if self._handle is None:
            self._build()
        if tp.device.type == "cuda":
            torch.cuda.current_stream(tp.device).synchronize()  # the bytes must exist first
        xfer = RepostedTransfer(tp, self._handle, self._what, self)
        try:
            with nixl_errors(f"{self._what}: posting"):
                state = tp.agent().transfer(self._handle)
        except NixlTransferError as exc:
            xfer._fail(exc)
            raise
        if state == "ERR":
            xfer._fail(NixlTransferError(f"{self._what} could not be posted (NIXL state ERR)"))
        return xfer

    def close(self) -> None:
        last = self._last
        if isinstance(last, RepostedTransfer) and last._handle is not None:
            # a post still in flight: it fails (its waiter is told) instead of polling a
            # released request; releasing an in-flight request keeps its memory registered
            last._error = NixlTransferError(f"{self._what}: closed while the reads were in flight")
            last._handle = None
        handle, self._handle = self._handle, None
        regs, self._regs = self._regs, []
        if handle is not None and not self._transport.closed:
            self._transport.release(handle, regs)


class RepostedTransfer(NixlTransfer):
    """One post of a ``PreparedXfer``: finishing keeps the request for the next post."""

    def __init__(self, transport: Transport, handle: Any, what: str, owner: PreparedXfer) -> None:
        super().__init__(transport, handle, [], what)
        self._owner = owner

    def _finish(self) -> None:
        self._handle = None

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._handle = None
        self._owner.close()  # a failed request is not posted again: the next post rebuilds it
