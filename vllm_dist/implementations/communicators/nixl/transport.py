"""Issuing transfers: NIXL requests over descriptor lists, or copies on a peer's mapping.

``Transport`` is what the communicator and the transfer handles share: the agent, the
registration cache, the peers, the mailbox and the mappings, plus the count of live request
handles and the ones that refused to be released (kept, with their memory, until ``close``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from vllm_dist.implementations.communicators.nixl.agent import (
    AgentSlot,
    NixlOptions,
    NixlTransferError,
    Peers,
    Registration,
    RegistrationCache,
    device_id,
    mem_type,
    nixl_errors,
)
from vllm_dist.implementations.communicators.nixl.mapping import PeerMaps
from vllm_dist.implementations.communicators.nixl.notifications import (
    Done,
    Mailbox,
    UserMessage,
    encode,
)
from vllm_dist.implementations.communicators.nixl.transfers import (
    CopyTransfer,
    NixlTransfer,
    Piece,
)

if TYPE_CHECKING:
    from nixl._api import nixl_agent, nixl_xfer_handle

_BATCH_COPY_BYTES = 1 << 20  # pieces below this share one batched copy launch


class Transport:
    """Posts requests and copies for one communicator, and releases what they held."""

    def __init__(
        self,
        slot: AgentSlot,
        opts: NixlOptions,
        device: torch.device,
        cache: RegistrationCache,
        peers: Peers,
        maps: PeerMaps,
    ) -> None:
        self._slot = slot
        self._opts = opts
        self.device = device
        self.cache = cache
        self.peers = peers
        self.maps = maps
        self.spin_s = 0.002 if device.type == "cuda" else 0.0  # see Backoff
        self.mailbox = Mailbox(slot, peers, self.spin_s)
        self.live_xfers = 0
        self.graveyard: list[tuple[nixl_xfer_handle, list[Registration]]] = []
        self.last_backend = ""

    def agent(self) -> nixl_agent:
        return self._slot.get()

    @property
    def closed(self) -> bool:
        return self._slot.closed

    def timeout(self, timeout: float | None) -> float:
        """``timeout``, or the communicator's when None."""
        return self._opts.timeout if timeout is None else timeout

    def post_pieces(
        self, op: str, peer: int, pieces: Sequence[Piece], notify: bytes | None
    ) -> NixlTransfer:
        """One NIXL request over ``(local view, remote offset, nbytes, remote buffer)``."""
        names = sorted({p[3].name for p in pieces})
        what = f"{op} of {', '.join(map(repr, names[:3]))}{' ...' if len(names) > 3 else ''}"
        return self.post(
            op,
            peer,
            [(view, r.addr + off, n, r.device_id) for view, off, n, r in pieces],
            remote_mem=pieces[0][3].mem_type if pieces else "DRAM",
            notif=None if notify is None else UserMessage(data=bytes(notify)),
            what=f"{what} on rank {peer}",
        )

    def post(
        self,
        op: str,
        peer: int,
        pieces: Sequence[tuple[torch.Tensor, int, int, int]],
        *,
        remote_mem: str,
        notif: UserMessage | Done | None,
        what: str,
    ) -> NixlTransfer:
        """One request over ``(local view, remote address, nbytes, remote device)``; ``notif``
        reaches the peer after the bytes."""
        agent = self.agent()
        pieces = [p for p in pieces if p[2] > 0]
        regs = []
        local = np.empty((len(pieces), 3), dtype=np.uint64)
        remote = np.empty((len(pieces), 3), dtype=np.uint64)
        try:
            for i, (view, raddr, n, remote_dev) in enumerate(pieces):
                reg = self.cache.register(view)
                reg.inflight += 1  # held as it is made: the next registration cannot evict it
                regs.append(reg)
                local[i] = (view.data_ptr(), n, device_id(view))
                remote[i] = (raddr, n, remote_dev)
            if not pieces:
                if notif is not None:
                    self.mailbox.send(peer, notif)
                return NixlTransfer(self, None, [], what)
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # the bytes must exist
            with nixl_errors(f"{what}: creating the request"):
                handle = agent.initialize_xfer(
                    op,
                    agent.get_xfer_descs(local, mem_type(self.device)),
                    agent.get_xfer_descs(remote, remote_mem),
                    self.peers.agent_of[peer],
                    b"" if notif is None else encode(notif),
                )
        except BaseException:
            for reg in regs:
                reg.inflight -= 1
            raise
        self.live_xfers += 1
        return self._start(agent, handle, regs, what)

    def _start(
        self, agent: nixl_agent, handle: nixl_xfer_handle, regs: list[Registration], what: str
    ) -> NixlTransfer:
        xfer = NixlTransfer(self, handle, regs, what)
        try:
            with nixl_errors(f"{what}: posting"):
                state = agent.transfer(handle)
        except NixlTransferError as exc:
            xfer._fail(exc)
            raise
        if not self.last_backend:
            with contextlib.suppress(Exception):
                self.last_backend = agent.query_xfer_backend(handle)
        if state == "ERR":
            xfer._fail(NixlTransferError(f"{what} could not be posted (NIXL state ERR)"))
        return xfer

    def mapped_copy(
        self,
        op: str,
        peer: int,
        copies: Sequence[tuple[torch.Tensor, torch.Tensor, int]],
        notify: bytes | None,
    ) -> CopyTransfer:
        """Copies over ``(destination, source, nbytes)`` byte views, one side of each a peer's
        mapping: one copy per large piece, one batched (``_foreach_copy_``) launch for all the
        small ones."""
        small_dst: list[torch.Tensor] = []
        small_src: list[torch.Tensor] = []
        for dst, src, n in copies:
            if n >= _BATCH_COPY_BYTES:
                dst.copy_(src, non_blocking=True)
            elif n:
                small_dst.append(dst)
                small_src.append(src)
        if small_dst:
            torch._foreach_copy_(small_dst, small_src, non_blocking=True)
        xfer = self.copied(f"{op} of rank {peer}'s buffer {self.maps.via}")
        if notify is not None:  # the peer may look only after the bytes have landed
            xfer.wait()
            self.mailbox.send(peer, UserMessage(data=bytes(notify)))
        return xfer

    def copied(self, what: str) -> CopyTransfer:
        """The transfer of copies just issued on mappings (on CUDA: behind an event)."""
        self.last_backend = self.maps.backend
        if self.device.type != "cuda":
            return CopyTransfer(self, None, what)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return CopyTransfer(self, event, what)

    def release(
        self, handle: nixl_xfer_handle, regs: list[Registration], failed: bool = False
    ) -> None:
        """Release a finished request and the registrations it held."""
        try:
            handle.release()
        except Exception:  # noqa: BLE001 - an in-flight request may refuse to abort
            self.graveyard.append((handle, regs))  # keep its memory registered and alive
            return
        finally:
            self.live_xfers -= 1
        for reg in regs:
            reg.inflight -= 1
        if failed:
            self.cache.evict()

    def close(self) -> None:
        """Release the requests that refused to be released earlier (at close)."""
        for handle, _ in self.graveyard:
            with contextlib.suppress(Exception):
                handle.release()
        self.graveyard.clear()
