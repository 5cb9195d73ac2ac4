"""NixlRdtCommunicator: point-to-point and one-sided transfers between workers over NIXL agents.

One NIXL agent per worker; memory is registered once per tensor storage and cached, and
everything is released on ``close()``. The class is the public face: state lives in collaborators
it owns (``RegistrationCache``, ``Peers``, ``PeerMaps``, ``Planner``, ``Transport`` and its
``Mailbox``).

Two-sided ``send`` / ``recv`` are receiver-announced WRITEs: the receiver registers its buffer
and sends a ``Ready`` notification; the sender WRITEs into it with ``Done`` attached, which NIXL
delivers after the bytes. Rejected alternative: sender-exposed READ. It needs the same two
messages, and UCX's ``cuda_ipc`` transport disables GET (READ) without NVLink, silently falling
back to TCP, while PUT (WRITE) stays on CUDA IPC.

One-sided ``read`` / ``write`` use buffers a peer ``expose``-d under a name. Descriptors reach
peers through ``exchange_exposed()`` (a collective) or out of band (``import_exposed``). For
same-node peers the bytes move as copies on a mapping of the peer's memory where possible (see
``mapping``). Every wait is bounded by the ``timeout`` option: a dead peer gives
``NixlTimeoutError`` (or ``NixlTransferError`` when UCX sees the endpoint fail), never a hang.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import time
import uuid
from collections import defaultdict
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from vllm_dist.implementations.communicators.common import check_tensor, default_device
from vllm_dist.implementations.communicators.nixl.agent import (
    CUDA_IPC_GET_ZCOPY,
    AgentSlot,
    NixlOptions,
    Peers,
    RegistrationCache,
    load_nixl,
    mem_type,
    new_agent,
    unavailable_reason,
)
from vllm_dist.implementations.communicators.nixl.descriptors import ExposedBuffer
from vllm_dist.implementations.communicators.nixl.mapping import PeerMaps
from vllm_dist.implementations.communicators.nixl.network import nixl_listens_on
from vllm_dist.implementations.communicators.nixl.notifications import (
    Done,
    Ready,
    Refusal,
    UserMessage,
)
from vllm_dist.implementations.communicators.nixl.onesided import (
    ByteRequest,
    Planner,
    StridedRequest,
)
from vllm_dist.implementations.communicators.nixl.transfers import (
    NixlTransfer,
    PreparedBoth,
    PreparedCopies,
    PreparedReads,
    PreparedXfer,
)
from vllm_dist.implementations.communicators.nixl.transport import Transport
from vllm_dist.interfaces import CommOp, DeviceCommunicator, ReduceOp, WorkerCoordinator
from vllm_dist.memory import StreamPool

LocalPieces = Sequence[tuple[torch.Tensor, int, int]]  # (local view, remote offset, nbytes)


class RunTimePeers:
    """Peers taken in and let go at run time (an elastic fleet's ``ElasticPeers``), for
    ``NixlRdtCommunicator``: a member that joins after set-up, or a new process in a dead
    one's rank, without a collective."""

    _name: str
    _slot: AgentSlot
    _peers: Peers
    _cache: RegistrationCache
    _maps: PeerMaps
    _planner: Planner
    _tp: Transport

    def _check_peer(self, peer: int) -> None:
        raise NotImplementedError

    def peer_info(self) -> tuple[str, bytes]:
        """(agent name, full metadata) of this worker, for a peer's ``add_peer``."""
        return self._name, bytes(self._slot.get().get_agent_metadata())

    def add_peer(self, rank: int, info: tuple[str, bytes]) -> None:
        """Take peer ``rank`` (its ``peer_info()``) in at run time (an elastic fleet's member
        that joined after set-up, or a new process in a dead one's rank)."""
        self._check_peer(rank)
        self.remove_peer(rank)
        self._peers.add(rank, info[0], info[1])
        self._cache.shared_epoch[rank] = -1  # its first descriptor carries full metadata

    def remove_peer(self, rank: int) -> None:
        """Forget peer ``rank`` (it died or left): see ``forget_peer``."""
        forget_peer(rank, self._peers, self._cache, self._maps, self._tp)
        self._planner.clear()  # cached copy views may hold the peer's mapped memory


class NixlRdtCommunicator(DeviceCommunicator, RunTimePeers):
    """Point-to-point and one-sided transfers over one NIXL agent per worker.

    Args:
        coordinator: an initialized coordinator of the group (any implementation).
        device: where tensors live; None = ``cuda:<local rank>`` with CUDA, else CPU.
        **options: fields of ``NixlOptions`` (``timeout``, ``backends``, ...).

    Not thread-safe: use one communicator from one thread.
    """

    supported_ops: ClassVar[frozenset[CommOp]] = frozenset(
        {CommOp.SEND, CommOp.RECV, CommOp.READ, CommOp.WRITE}
    )

    def __init__(
        self,
        coordinator: WorkerCoordinator,
        device: torch.device | str | None = None,
        **options: Any,
    ) -> None:
        self._opts = NixlOptions(**options)
        api = load_nixl()
        self._coord = coordinator
        self._device = default_device(coordinator, device)
        self._rank = coordinator.get_rank()
        self._world = coordinator.get_world_size()
        cuda = self._device.type == "cuda"
        self._set_ucx_env = False
        if cuda:
            torch.cuda.set_device(self._device)
            if CUDA_IPC_GET_ZCOPY not in os.environ:  # the user's own UCX settings win
                os.environ[CUDA_IPC_GET_ZCOPY] = "y"  # READ of VRAM stays on CUDA IPC
                self._set_ucx_env = True
        self._name = (
            f"vllm_dist-r{coordinator.get_global_ranks()[self._rank]}-{uuid.uuid4().hex[:12]}"
        )
        delay = self._opts.progress_delay_us
        self._progress_delay_us = (0 if cuda else 1) if delay is None else delay
        self._slot = AgentSlot(new_agent(api, self._name, self._opts, self._progress_delay_us))
        self._cache = RegistrationCache(self._slot, self._opts.max_cached_registrations)
        self._peers = Peers(self._slot, self._rank)
        self._maps = PeerMaps(
            self._device, self._opts.cuda_ipc if cuda else self._opts.shared_memory
        )
        self._planner = Planner(self._device, self._peers, self._maps, self._cache)
        self._tp = Transport(
            self._slot, self._opts, self._device, self._cache, self._peers, self._maps
        )
        # the streams its prepared copies record CUDA graphs on; None: no graphs
        self._streams = StreamPool() if self._opts.cuda_graphs else None
        self._send_seq: defaultdict[int, itertools.count[int]] = defaultdict(itertools.count)
        self._recv_seq: defaultdict[int, itertools.count[int]] = defaultdict(itertools.count)
        self._peers.connect(coordinator, self._name)
        self._cache.shared_epoch.update(dict.fromkeys(self._peers.agent_of, 0))

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def agent_name(self) -> str:
        return self._name

    # -- collectives: not this backend's job -------------------------------------------------
    def all_reduce(
        self,
        tensor_in: torch.Tensor,
        tensor_out: torch.Tensor | None = None,
        op: ReduceOp = ReduceOp.SUM,
    ) -> torch.Tensor:
        raise self._unsupported(CommOp.ALL_REDUCE)

    def all_gather(
        self, tensor_in: torch.Tensor, tensor_out: torch.Tensor | None = None
    ) -> torch.Tensor:
        raise self._unsupported(CommOp.ALL_GATHER)

    def reduce_scatter(
        self,
        tensor_in: torch.Tensor,
        tensor_out: torch.Tensor | None = None,
        op: ReduceOp = ReduceOp.SUM,
    ) -> torch.Tensor:
        raise self._unsupported(CommOp.REDUCE_SCATTER)

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        raise self._unsupported(CommOp.BROADCAST)

    def _unsupported(self, op: CommOp) -> Exception:
        from vllm_dist.registry import unsupported_operation  # lazy: implementations sit below it

        return unsupported_operation(type(self), op)

    # -- two-sided ---------------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int, *, timeout: float | None = None) -> None:
        """Send ``tensor`` to ``dst`` (matched by order with ``recv``): WRITE into its buffer."""
        check_tensor(tensor, self._device)
        self._check_peer(dst)
        seq = next(self._send_seq[dst])
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            return
        deadline = time.monotonic() + self._tp.timeout(timeout)
        what = f"recv #{seq} posted by rank {dst}"
        ready = self._tp.mailbox.wait(dst, Ready, seq, deadline, what)
        assert isinstance(ready, Ready)
        if ready.metadata:
            self._peers.load(dst, ready.metadata, ready.epoch, full=ready.full)
        if ready.nbytes != nbytes:
            msg = f"send #{seq} to rank {dst} has {nbytes} bytes but the recv has {ready.nbytes}"
            self._tp.mailbox.send(dst, Refusal(seq=seq, reason=msg))
            raise ValueError(msg + "; shapes and dtypes of a send/recv pair must match")
        xfer = self._tp.post(
            "WRITE",
            dst,
            [(tensor, ready.addr, nbytes, ready.device_id)],
            remote_mem=ready.mem_type,
            notif=Done(seq=seq),
            what=f"send #{seq} to rank {dst}",
        )
        xfer.wait(max(0.0, deadline - time.monotonic()))

    def recv(self, tensor: torch.Tensor, src: int, *, timeout: float | None = None) -> torch.Tensor:
        """Receive the next ``send`` from ``src`` into ``tensor``; returns it."""
        check_tensor(tensor, self._device)
        self._check_peer(src)
        seq = next(self._recv_seq[src])
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            return tensor
        deadline = time.monotonic() + self._tp.timeout(timeout)
        reg = self._cache.register(tensor)
        reg.inflight += 1
        try:
            md, full = self._cache.metadata_for(src, reg)
            ready = Ready(
                seq=seq, addr=tensor.data_ptr(), nbytes=nbytes, device_id=reg.device_id,
                mem_type=reg.mem_type, epoch=self._cache.epoch, full=full, metadata=md,
            )  # fmt: skip
            self._tp.mailbox.send(src, ready)
            what = f"send #{seq} from rank {src}"
            self._tp.mailbox.wait(src, Done, seq, deadline, what, refusable=True)
        finally:
            reg.inflight -= 1
        return tensor

    # -- exposure ----------------------------------------------------------------------------
    def expose(self, tensor: torch.Tensor, name: str, *, writable: bool = False) -> ExposedBuffer:
        """Register ``tensor`` under ``name`` so peers may ``read`` it, and ``write`` it where
        ``writable`` (a WRITE target; ``mapping`` says how read-only is enforced); local only.

        Peers learn of it through ``exchange_exposed()`` or by ``import_exposed`` of the returned
        descriptor. The tensor stays registered (and alive) until ``unexpose(name)`` or ``close()``.

        Raises:
            ValueError: ``name`` is already exposed, or the tensor is on the wrong device.
        """
        check_tensor(tensor, self._device)
        if name in self._cache.exposed:
            raise ValueError(f"a buffer is already exposed as {name!r}; unexpose it first")
        reg = self._cache.register(tensor)
        reg.pinned += 1
        desc = ExposedBuffer(
            rank=self._rank,
            name=name,
            agent=self._name,
            addr=tensor.data_ptr(),
            nbytes=tensor.numel() * tensor.element_size(),
            device_id=reg.device_id,
            mem_type=reg.mem_type,
            epoch=self._cache.epoch,
            metadata=self._slot.get().get_agent_metadata(),
            mapping=self._maps.handle(tensor, reg, writable),
            writable=writable,
        )
        self._cache.exposed[name] = (desc, reg)
        return desc

    def unexpose(self, name: str) -> None:
        """Stop exposing ``name``; its registration is released once nothing else uses it."""
        try:
            desc, reg = self._cache.exposed.pop(name)
        except KeyError:
            known = sorted(self._cache.exposed)
            raise ValueError(f"nothing is exposed as {name!r}; exposed: {known}") from None
        reg.pinned -= 1
        self._maps.release(reg, desc.writable)
        self._planner.clear()  # cached copy views may hold the released memory
        self._cache.evict()

    def exchange_exposed(self) -> dict[int, dict[str, ExposedBuffer]]:
        """Collective: every member learns every other member's exposed buffers.

        Returns ``{rank: {name: ExposedBuffer}}`` of the peers (this rank excluded).
        """
        mine = [desc for desc, _ in self._cache.exposed.values()]
        md = self._slot.get().get_agent_metadata()
        gathered = self._coord.all_gather_object((self._cache.epoch, md, mine))
        for rank, (epoch, peer_md, descs) in enumerate(gathered):
            if rank == self._rank:
                continue
            self._peers.load(rank, peer_md, epoch, full=True)
            self._peers.exposed[rank] = {d.name: d for d in descs}
        self._cache.shared_everything(self._peers.agent_of)
        return {r: dict(d) for r, d in self._peers.exposed.items()}

    def import_exposed(self, desc: ExposedBuffer) -> None:
        """Make a peer's ``ExposedBuffer`` (received out of band) addressable by ``read``/``write``.

        Raises:
            ValueError: the descriptor is from this worker, from an agent that is not a member of
                this group, or older than metadata already loaded from that peer.
        """
        rank = self._peers.rank_of.get(desc.agent)
        if rank is None or rank == self._rank:
            raise ValueError(
                f"{desc.name!r} belongs to agent {desc.agent!r}, which is not a peer of this "
                f"communicator (peers: {sorted(self._peers.agent_of.values())})"
            )
        self._peers.load(rank, desc.metadata, desc.epoch, full=True)
        self._peers.exposed[rank][desc.name] = desc

    def decode_exposed(self, data: bytes) -> ExposedBuffer:
        """The ``ExposedBuffer`` a peer's ``to_bytes`` wrote (checked JSON, never a pickle).

        Raises:
            ValueError: ``data`` is not a descriptor of this version.
        """
        return ExposedBuffer.from_bytes(data)

    @property
    def maps_peer_memory(self) -> bool:
        """Whether one-sided transfers with same-node peers run as copies on a mapping of their
        memory (CUDA IPC for VRAM, shared memory for DRAM), where a strided view costs what its
        bytes cost (``read_strided_async``). ``maps_exposed`` says it of one buffer."""
        return self._maps.enabled

    def maps_exposed(self, peer: int, remote_name: str) -> bool:
        """Whether ``peer``'s exposed buffer ``remote_name`` is mapped here (see above)."""
        self._check_peer(peer)
        return self._maps.open(peer, self._peers.buffer(peer, remote_name)) is not None

    # -- one-sided ---------------------------------------------------------------------------
    def read(
        self,
        peer: int,
        remote_name: str,
        local: torch.Tensor,
        remote_offset: int = 0,
        *,
        timeout: float | None = None,
    ) -> torch.Tensor:
        """Copy ``local.nbytes`` bytes at ``remote_offset`` of the peer's buffer into ``local``."""
        self.read_async(peer, remote_name, local, remote_offset).wait(timeout)
        return local

    def write(
        self,
        peer: int,
        remote_name: str,
        local: torch.Tensor,
        remote_offset: int = 0,
        *,
        notify: bytes | None = None,
        timeout: float | None = None,
    ) -> None:
        """Copy ``local`` into the peer's buffer at ``remote_offset``.

        ``notify``: bytes delivered to the peer after the data (see ``wait_notification``).
        """
        self.write_async(peer, remote_name, local, remote_offset, notify=notify).wait(timeout)

    def read_async(
        self,
        peer: int,
        remote_name: str,
        local: torch.Tensor | LocalPieces,
        remote_offset: int = 0,
    ) -> NixlTransfer:
        """Start a READ; ``local`` is one tensor or a list of ``(view, remote_offset, nbytes)``."""
        return self._one_sided("READ", peer, remote_name, local, remote_offset, None)

    def write_async(
        self,
        peer: int,
        remote_name: str,
        local: torch.Tensor | LocalPieces,
        remote_offset: int = 0,
        *,
        notify: bytes | None = None,
    ) -> NixlTransfer:
        """Start a WRITE; ``local`` is one tensor or a list of ``(view, remote_offset, nbytes)``."""
        return self._one_sided("WRITE", peer, remote_name, local, remote_offset, notify)

    def read_batch_async(
        self, peer: int, requests: Sequence[tuple[str, int, torch.Tensor]]
    ) -> NixlTransfer:
        """Start one READ gathering from several of ``peer``'s exposed buffers.

        Each request is ``(remote name, remote byte offset, local tensor)`` and fills the whole
        local tensor; one request (or one set of copies on a mapping) carries them all, so a
        batch of many weights costs one completion to wait on.
        """
        return self._gather("READ", peer, _byte_requests(requests), None)

    def write_batch_async(
        self,
        peer: int,
        requests: Sequence[tuple[str, int, torch.Tensor]],
        *,
        notify: bytes | None = None,
    ) -> NixlTransfer:
        """Start one WRITE scattering local tensors into several of ``peer``'s exposed buffers
        (``(remote name, remote byte offset, local tensor)`` each); see ``read_batch_async``."""
        return self._gather("WRITE", peer, _byte_requests(requests), notify)

    def read_strided_async(self, peer: int, requests: Sequence[StridedRequest]) -> NixlTransfer:
        """Start one READ of strided views of ``peer``'s exposed buffers into local tensors.

        Each request is ``(remote name, remote byte offset, remote strides, local tensor)``: the
        remote view has the local tensor's shape and dtype and those element strides, and lands
        in ``local`` whatever either layout. On a mapping each request is one copy; through NIXL
        the remote view is cut into its contiguous runs (``local`` must then be contiguous).

        Raises:
            ValueError: unknown buffer, strides that do not match the shape, an offset that is
                not a multiple of the element size, a view reaching outside the buffer, or (NIXL
                path) a non-contiguous local tensor or too many runs.
        """
        self._check_peer(peer)
        pieces, copies = self._planner.strided(peer, requests, maps=self._maps.enabled)
        if copies is not None:
            return self._tp.mapped_copy("READ", peer, copies, None)
        return self._tp.post_pieces("READ", peer, pieces, None)

    def read_many(
        self,
        peer: int,
        remote_name: str,
        requests: LocalPieces,
        *,
        timeout: float | None = None,
    ) -> None:
        """One READ request of many descriptors: each ``(local view, remote offset, nbytes)``."""
        self.read_async(peer, remote_name, requests).wait(timeout)

    def write_many(
        self,
        peer: int,
        remote_name: str,
        requests: LocalPieces,
        *,
        notify: bytes | None = None,
        timeout: float | None = None,
    ) -> None:
        """One WRITE request of many descriptors: each ``(local view, remote offset, nbytes)``."""
        self.write_async(peer, remote_name, requests, notify=notify).wait(timeout)

    # -- prepared reads ----------------------------------------------------------------------
    def prepare_reads(
        self,
        peer: int,
        requests: Sequence[tuple[str, int, torch.Tensor]] = (),
        strided: Sequence[StridedRequest] = (),
    ) -> PreparedReads:
        """A fixed set of READs from ``peer``, checked and laid out once, to post again and again.

        ``requests`` are ``read_batch_async``'s, ``strided`` ``read_strided_async``'s. On CUDA
        IPC mappings the copies are recorded into a CUDA graph at the first ``post``; through
        NIXL the request is created once and reposted. A set reading mapped and unmapped buffers
        does both. Local tensors and the peer's buffers must stay put until ``close()``.
        """
        self._check_peer(peer)

        def mapped(name: str) -> bool:
            return self._maps.open(peer, self._peers.buffer(peer, name)) is not None

        byte_reqs = _byte_requests(requests)
        on_map = [mapped(r[0]) for r in byte_reqs]
        s_on_map = [mapped(r[0]) for r in strided]
        sets: list[PreparedReads] = []
        if any(on_map) or any(s_on_map):
            copies = self._planner.gather("READ", peer, _where(byte_reqs, on_map), maps=True)[1]
            s_copies = self._planner.strided(peer, _where(strided, s_on_map), maps=True)[1]
            assert copies is not None and s_copies is not None  # every buffer is mapped
            pairs = [*copies, *s_copies]
            sets.append(PreparedCopies(self._tp, peer, pairs, streams=self._streams))
        if not (all(on_map) and all(s_on_map)) or not sets:
            off_map = [not m for m in on_map]
            pieces = self._planner.gather("READ", peer, _where(byte_reqs, off_map), maps=False)[0]
            s_off = [not m for m in s_on_map]
            s_pieces = self._planner.strided(peer, _where(strided, s_off), maps=False)[0]
            sets.insert(0, PreparedXfer(self._tp, peer, [*pieces, *s_pieces]))
        return sets[0] if len(sets) == 1 else PreparedBoth(self._tp, peer, sets)

    def merge_prepared(self, peer: int, sets: Sequence[PreparedReads]) -> PreparedReads | None:
        """One prepared set doing what ``sets`` (prepared here for ``peer``) do, planned by
        none, where every set is copies on a mapping (their ``CopyProgram``s merged, one CUDA
        graph on CUDA IPC); None otherwise (a NIXL request): prepare afresh. The sets must not
        be posted while the merged one is in flight."""
        self._check_peer(peer)
        copies = [p for p in sets if isinstance(p, PreparedCopies) and p.peer == peer]
        if not copies or len(copies) != len(sets):
            return None
        return PreparedCopies.merged(self._tp, peer, copies, streams=self._streams)

    # -- notifications -----------------------------------------------------------------------
    def notify(self, peer: int, message: bytes) -> None:
        """Send ``message`` to ``peer`` (ordered after every transfer this rank completed)."""
        self._check_peer(peer)
        self._tp.mailbox.send(peer, UserMessage(data=bytes(message)))

    def wait_notification(self, peer: int, timeout: float | None = None) -> bytes:
        """The next message ``peer`` sent with ``notify`` or a ``write(..., notify=...)``."""
        self._check_peer(peer)
        return self._tp.mailbox.wait_user(peer, self._tp.timeout(timeout))

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        agent = self._slot.take()
        if agent is None:
            return
        self._maps.close([reg for _, reg in self._cache.exposed.values()])
        self._planner.clear()
        self._tp.close()
        self._cache.release_all(agent)
        self._peers.forget(agent)
        del agent

    def stats(self) -> dict[str, int]:
        """Live resource counts, for leak checks: registrations, exposures, transfer handles."""
        return {
            "registrations": len(self._cache.regs),
            "exposed": len(self._cache.exposed),
            "live_xfer_handles": self._tp.live_xfers,
            "leaked_xfer_handles": len(self._tp.graveyard),
            "epoch": self._cache.epoch,
        }

    def describe(self) -> dict[str, Any]:
        facts: dict[str, Any] = {
            "backend": ",".join(self._opts.backends),
            "last_xfer_backend": self._tp.last_backend,
            "mem_type": mem_type(self._device),
            "agent": self._name,
            "ucx_tls": os.environ.get("UCX_TLS", "(UCX default)"),
            CUDA_IPC_GET_ZCOPY: os.environ.get(CUDA_IPC_GET_ZCOPY, "(unset)"),
            "ucx_env_set_by_vllm_dist": self._set_ucx_env,
            "maps_peer_memory": self._maps.enabled and self._maps.backend,
            "progress_delay_us": self._progress_delay_us,
            "listens_on": nixl_listens_on(),  # what new_agent bound UCX to
        }
        with contextlib.suppress(Exception):
            from importlib import metadata

            facts["nixl"] = metadata.version("nixl")
        return facts

    @classmethod
    def unavailable_reason(cls, device_type: str) -> str | None:
        return unavailable_reason(device_type)

    # -- internals ---------------------------------------------------------------------------
    def _one_sided(
        self,
        op: str,
        peer: int,
        remote_name: str,
        local: torch.Tensor | LocalPieces,
        remote_offset: int,
        notify: bytes | None,
    ) -> NixlTransfer:
        if isinstance(local, torch.Tensor):
            check_tensor(local, self._device, "local")
            requests = [(remote_name, remote_offset, local, local.numel() * local.element_size())]
        else:
            requests = [(remote_name, remote_offset + off, view, n) for view, off, n in local]
        return self._gather(op, peer, requests, notify)

    def _gather(
        self, op: str, peer: int, requests: Sequence[ByteRequest], notify: bytes | None
    ) -> NixlTransfer:
        """One request over ``(remote name, remote offset, local view, nbytes)`` pieces."""
        self._check_peer(peer)
        pieces, copies = self._planner.gather(op, peer, requests, maps=self._maps.enabled)
        if copies is not None:
            return self._tp.mapped_copy(op, peer, copies, notify)
        return self._tp.post_pieces(op, peer, pieces, notify)

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self._world:
            raise ValueError(f"rank {peer} is outside this group of {self._world}")
        if peer == self._rank:
            raise ValueError(f"rank {peer} is this worker itself; use tensor.copy_ locally")


def forget_peer(
    rank: int, peers: Peers, cache: RegistrationCache, maps: PeerMaps, tp: Transport
) -> None:
    """Drop what this worker holds of peer ``rank``: its agent, descriptors, mappings and
    queued notifications, so that a new process in that rank starts clean."""
    peers.remove(rank)
    cache.shared_epoch.pop(rank, None)
    for reg in cache.regs.values():
        reg.shared_with.discard(rank)
    maps.forget(rank)
    tp.mailbox.forget(rank)


def _byte_requests(requests: Sequence[tuple[str, int, torch.Tensor]]) -> list[ByteRequest]:
    """``(name, offset, tensor)`` requests with each tensor's byte size."""
    return [(name, off, t, t.numel() * t.element_size()) for name, off, t in requests]


def _where(items: Sequence[Any], keep: Sequence[bool]) -> list[Any]:
    """The items whose flag in ``keep`` is set."""
    return [item for item, k in zip(items, keep, strict=True) if k]
