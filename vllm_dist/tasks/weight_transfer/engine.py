"""The producer and consumer engines: set-up (bake, plan, digests) and the sync data path.

Both take a coordinator (control plane) and a communicator (data plane) that span the fleet,
plus a ``Fleet`` naming which of the coordinator's ranks are producers and which consumers; they
do not care whether that group came from one launch or from two launches that met at a
host:port. Backends are never named: a communicator that declares ``CommOp.READ`` and offers
the ``OneSidedCommunicator`` API gets the one-sided READ path (``onesided.py``), every other one
the send/recv push path.

Set-up, collective over the coordinator:
1. producers all-gather their metadata and held names; every rank builds the same
   ``ModelIndex`` (groups, owner classes, router);
2. each consumer bakes its loader into op chains, plans its chunks, and sends every producer the
   requests routed to it (``"plan"``), then reserves serve buffers with a digest per producer
   (``RdtRouter.reserve_serve_buffers``);
3. each producer checks the requests (names it holds and serves, allowed ops only, shapes),
   rebuilds the pair's plan itself and compares digests;
4. everyone all-gathers the verdicts, so a refusal anywhere fails every rank at set-up;
5. READ path only: producers expose their serve rings and everyone exchanges the descriptors.

Sync, READ path: see ``onesided.py``; everything runs on the calling thread (a one-sided
communicator need not be thread-safe).

Steady state, READ path. An RL trainer writes its weights in place: from one sync to the next
every tensor is the same object at the same address. With a resident source (``resident``:
opening every group at once costs no memory) a producer records what each complete sync did —
the packs per pair — and each consumer the reads and unpacks it posted. At the next sync the
producer opens every group and compares objects and addresses with the recorded ones; if
nothing moved, it runs the recorded packs as one program per consumer (``CopyProgram``) and
sends each consumer a single ``replay_message``. The consumer posts its recorded reads as one
prepared set (``prepare_reads``: on CUDA IPC mappings one CUDA graph), unpacks, and answers
once. Per-chunk work disappears from both sides. A sync is recorded only when replaying it is
safe and worth it: no chain that copies (fresh bytes), no more packs than ring slots (all
packed at once), no source seen for the first time (it is read in place from the next sync
on), and on the consumer no staging slot used twice. Anything else — a swapped storage, a
consumer that (re)joined, a consumer whose record cannot be replayed — falls back to the
chunk-by-chunk path (a consumer reads a replay message as the last sync's announcements, one
by one).

Sync, push path: producers walk their chunks group by group, consumers taking turns within a
group (the pair's chunk i of each before chunk i + 1 of any), so a full ring for one consumer
leaves the others fed. Every (producer, consumer) pair has its own thread on both ends and
sends in its own chunk order, so a blocking send holds up only its pair. A per-consumer sender thread packs
chunk ``seq`` into slot ``seq % K`` of that consumer's ring and sends it; the producer's own
thread only waits for that slot's previous send before queueing the next chunk, which bounds
how far ahead it opens groups. On the consumer a per-producer receiver thread takes every chunk
of the sync in order and unpacks each straight after its recv (one staging slot per producer).
The per-group free barrier releases a group's source tensors once every chunk of it has been
delivered. On CUDA (``TransferConfig.push_threads``) every rank instead issues its sends or
receives from its own thread in one fleet-wide order, (group, consumer, the consumer's plan), each pack and unpack on the stream
behind the transfer it feeds: NCCL communicators are not thread-safe, a send or recv holds its
stream until the peer's match, and one order on every rank is what keeps that deadlock-free
(the first unfinished transfer of the order is at the head of both its ranks' queues).
"""

from __future__ import annotations

import functools
import gc
import operator
import os
import threading
import time
import warnings
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any, TypeVar

import numpy as np
import torch

from vllm_dist.interfaces import CommOp, DeviceCommunicator, WorkerCoordinator
from vllm_dist.interfaces.dataplane import (
    AsyncSendRecvCommunicator,
    ExposedDescriptor,
    OneSidedCommunicator,
    PreparedReadCommunicator,
    PreparedReadSet,
    StridedReadCommunicator,
)
from vllm_dist.tasks.weight_transfer._memory import (
    DEVICE_ARENA_BYTES,
    CopyProgram,
    arena_range,
    batched_copy,
    gather_device_storages,
    share_storages,
    shared_arena,
    shared_empty,
)
from vllm_dist.tasks.weight_transfer.config import (
    ANNOUNCE_BYTES,
    BATCHES_IN_FLIGHT,
    FIRST_ANNOUNCE_BYTES,
    MAX_PINNED,
    RECV_AHEAD,
    STRIDED_DIRECT_BYTES,
    Fleet,
    Route,
    SyncStats,
    TransferConfig,
    UnservedNameError,
    WeightTransferSetupError,
)
from vllm_dist.tasks.weight_transfer.index import ModelIndex, ProducerFacts, build_index
from vllm_dist.tasks.weight_transfer.messages import (
    SPREAD,
    AdmitMessage,
    Announcement,
    Done,
    PlanMessage,
    ReadyCodec,
    Replay,
    ReserveMessage,
    decode_consumer_message,
    encode_alive,
    encode_done,
    encode_replay,
)
from vllm_dist.tasks.weight_transfer.onesided import (
    device_synchronize,
    poll_message,
    ring_name,
    wait_device,
    wait_message,
    wait_read,
)
from vllm_dist.tasks.weight_transfer.ops import (
    Copy,
    Loader,
    OpChain,
    UnsafeOpError,
    bake,
    check_chain,
    loader_key,
    replay,
    split_for_wire,
)
from vllm_dist.tasks.weight_transfer.plan import (
    Chunk,
    LayoutConfig,
    PlanMismatchError,
    Request,
    buffer_alloc_bytes,
    cut_chunks,
    decode_requests,
    encode_requests,
    item_sizes,
    plan_digest,
    request_kinds,
    slot_bytes,
)
from vllm_dist.tasks.weight_transfer.ring import (
    FreeBarrier,
    SerialWorker,
    ServeRing,
    TransferStallError,
    Waitable,
    wait_or_stall,
)
from vllm_dist.tasks.weight_transfer.source import WeightSource, dtype_from_str
from vllm_dist.tasks.weight_transfer.views import ViewCache, slot_views


@dataclass(kw_only=True)
class _Pair:
    """One (producer, consumer) pair as seen from either end."""

    peer_rank: int
    chunks: list[Chunk]
    requests: list[Request]
    slot_bytes: int
    ring: ServeRing | None = None
    worker: SerialWorker | None = None
    names: list[str] = field(default_factory=list)  # producer side: the name of each item
    remote_name: str = ""  # READ path: the producer's exposed ring for this pair
    told: set[str] = field(default_factory=set)  # READ: exposed sources this consumer knows
    strided: bool = False  # READ: the consumer reads strided source views in place
    maps: bool = False  # READ: ... on a mapping of the producer's memory (``maps_peer_memory``)
    last_seq: int = -1  # consumer side: the seq of the pair's last chunk (set at set-up)
    outbox: list[Announcement] = field(default_factory=list)  # READ: not yet sent
    outbox_descs: list[Any] = field(default_factory=list)  # READ: their new sources' descriptors
    desc_sender: SerialWorker | None = None  # READ: sends descriptors (``_send_descriptors``)
    desc_sends: list[Waitable] = field(default_factory=list)  # READ: ... not known to be done
    outbox_bytes: int = 0  # READ: bytes of the chunks queued since the last announcement
    outbox_packed: int = 0  # READ: ring slots packed since the last announcement
    slot_seq: dict[int, int] = field(default_factory=dict)  # READ: slot -> last seq packed
    packs: int = 0  # READ: chunks packed this sync (the next one takes slot packs % K)
    announced: int = 0  # READ: bytes announced this sync
    sync_bytes: int = 0  # the bytes of all of the pair's chunks
    pending: deque[tuple[int, int]] = field(default_factory=deque)  # READ: (seq, group) unread
    items: list[tuple[torch.dtype, tuple[int, ...], int]] = field(default_factory=list)
    prefixes: list[OpChain] = field(default_factory=list)
    views: dict[int, Any] = field(default_factory=dict)  # chunk index -> its pack plan / views
    # READ path, steady state (``_Replay``): what the last complete sync did for this pair
    replay: _Replay | None = None
    staging: torch.Tensor | None = None  # the pair's pack programs' gathers stage here
    failed: threading.Event = field(default_factory=threading.Event)  # push: this sync's
    error: Exception | None = None  # push: why this pair failed this sync
    receipt: torch.Tensor | None = None  # push: the consumer's receipt of a sync lands here

    def close(self) -> None:
        """Stop the pair's threads and release its replay record."""
        for worker in (self.worker, self.desc_sender):
            if worker is not None:
                worker.close()
        if self.replay is not None:
            self.replay.close()

    def receipt_buffer(self, device: torch.device) -> torch.Tensor:
        if self.receipt is None:
            self.receipt = torch.zeros(1, dtype=torch.int64, device=device)
        return self.receipt

    def stage(self, nbytes: int) -> torch.Tensor:
        """The pair's staging buffer for ``CopyProgram`` gathers: one slot's size, so one
        serves every chunk's program (they run one after another on the pair's thread or
        stream)."""
        assert self.ring is not None
        if self.staging is None or self.staging.numel() < nbytes:
            size = max(nbytes, self.slot_bytes)
            self.staging = torch.empty(size, dtype=torch.uint8, device=self.ring.buffer.device)
        return self.staging


@dataclass(kw_only=True)
class _Replay:
    """One pair's last sync, kept so that the next can run as a whole (``replay_message``).

    Producer: the programs of the packs it made, merged into one ``CopyProgram`` at the first
    replay (``CopyProgram.merged``: nothing planned again); consumer: the reads it posted
    (``plain``, ``strided``) and the programs of the unpacks behind them, prepared at the first
    replay (a prepared set of reads, the unpack programs merged into one).
    ``sync``: the sync it describes (and was last replayed), or -1 while it is being recorded
    or when that sync cannot be replayed (``ok`` false: a chain that copies, a source seen for
    the first time, a staging slot used twice; more packs than ring slots).
    """

    sync: int = -1
    last_seq: int = -1
    packs: int = 0  # chunks packed (producer) or unpacked (consumer)
    ok: bool = True
    programs: list[CopyProgram] = field(default_factory=list)  # the packs / unpacks it ran
    plain: list[tuple[str, int, torch.Tensor]] = field(default_factory=list)
    strided: list[tuple[str, int, Any, torch.Tensor]] = field(default_factory=list)
    prepared: Any = None  # producer: a CopyProgram of the packs; consumer: the prepared reads
    unpack: CopyProgram | None = None  # consumer: the unpacks
    slots: set[tuple[int, int]] = field(default_factory=set)  # consumer: staging slots used
    # consumer: the prepared sets of chunks read item by item (``_gather``) and how many of
    # ``strided`` they read: when they read all of it, the first replay merges them
    sets: list[Any] = field(default_factory=list)
    gathered: int = 0

    def close(self) -> None:
        _close(self.prepared)
        _close(self.unpack)
        self.prepared = self.unpack = None


_T = TypeVar("_T")


def _gc_paused(method: Callable[..., _T]) -> Callable[..., _T]:
    """Run ``method`` with Python's cyclic garbage collector paused (as it was, after).

    Set-up and a sync that is not replayed make hundreds of thousands of short-lived objects
    (views, storages, plans) beside the engine's long-lived ones; every collection the
    allocations trigger walks all of them (measured on the CPU machine: a quarter of the
    planning time of 100,000 copies). Reference counting still frees what they drop; any
    cycles wait for the next collection."""

    @functools.wraps(method)
    def paused(*args: Any, **kwargs: Any) -> _T:
        if not gc.isenabled():
            return method(*args, **kwargs)
        gc.disable()
        try:
            return method(*args, **kwargs)
        finally:
            gc.enable()

    return paused


def _gather_verdicts(coordinator: WorkerCoordinator, error: BaseException | None) -> None:
    """All-gather every rank's set-up error; raise this rank's own, else the first other one."""
    verdicts = coordinator.all_gather_object(
        None if error is None else f"{type(error).__name__}: {error}"
    )
    if error is not None:
        raise error
    failed = [(r, v) for r, v in enumerate(verdicts) if v is not None]
    if failed:
        lines = "; ".join(f"rank {r}: {v}" for r, v in failed)
        raise WeightTransferSetupError(f"weight-transfer set-up failed on other ranks: {lines}")


class _Engine:
    """What producers and consumers share: the fleet, the index, the timers."""

    def __init__(
        self,
        coordinator: WorkerCoordinator,
        communicator: DeviceCommunicator,
        fleet: Fleet,
        config: TransferConfig,
    ) -> None:
        if coordinator.get_world_size() != len(fleet.producer_ranks) + len(fleet.consumer_ranks):
            raise ValueError(
                f"the coordinator has {coordinator.get_world_size()} members but the fleet names "
                f"{len(fleet.producer_ranks)} producers and {len(fleet.consumer_ranks)} consumers"
            )
        self.coordinator = coordinator
        self.communicator = communicator
        self.fleet = fleet
        self.config = config
        self.layout = config.layout()
        self.index: ModelIndex | None = None
        self.setup_seconds = 0.0
        self._pairs: dict[int, _Pair] = {}
        self._shapes = _ShapeCache()
        self._views = ViewCache()
        one_sided = _one_sided(communicator, config.transport)
        self._read = one_sided is not None
        self._one: OneSidedCommunicator  # the READ path's communicator (set on that path only)
        if one_sided is not None:
            self._one = one_sided
        self._async: AsyncSendRecvCommunicator | None = (
            communicator if isinstance(communicator, AsyncSendRecvCommunicator) else None
        )
        threads = config.push_threads
        if threads is None:
            threads = communicator.device.type != "cuda"
        self._threads = not self._read and threads  # push path: a thread per pair
        self._syncs = 0
        self.setup_phases: dict[str, float] = {}  # seconds per set-up step, for benchmarks
        # VLLM_DIST_WT_TRACE=1: (monotonic time, event) of the last sync, for benchmarks
        self.trace: list[tuple[float, str]] | None = (
            [] if os.environ.get("VLLM_DIST_WT_TRACE") == "1" else None
        )
        self._phase_start = time.perf_counter()
        self._exposed: list[str] = []
        self._packed = 0  # this sync's pack (producer) or unpack (consumer) copies, in chunks
        self._codec = ReadyCodec()

    @property
    def path(self) -> str:
        """``"read"`` (one-sided) or ``"send_recv"``: the data path this engine uses."""
        return "read" if self._read else "send_recv"

    def _mark(self, event: str) -> None:
        if self.trace is not None:
            self.trace.append((time.perf_counter(), event))

    def _phase(self, name: str) -> float:
        """Record the seconds since the previous phase ended under ``name``; returns them."""
        now = time.perf_counter()
        spent = now - self._phase_start
        self.setup_phases[name] = self.setup_phases.get(name, 0.0) + spent
        self._phase_start = now
        return spent

    def _expose(self, tensor: torch.Tensor, name: str) -> None:
        self._one.expose(tensor, name)
        self._exposed.append(name)

    def _index(self, facts: ProducerFacts | None) -> ModelIndex:
        gathered = self.coordinator.all_gather_object(facts)
        return self._build_index([gathered[r] for r in self.fleet.producer_ranks])

    def _build_index(self, producer_facts: list[ProducerFacts]) -> ModelIndex:
        self.producer_facts = producer_facts
        self.index = build_index(
            producer_facts, len(self.fleet.consumer_ranks), self.config.workers_per_replica
        )
        return self.index

    def _unexpose(self, name: str) -> None:
        self._one.unexpose(name)
        self._exposed.remove(name)

    def close(self) -> None:
        for pair in self._pairs.values():
            pair.close()
        self._pairs = {}
        for name in self._exposed:
            self._one.unexpose(name)
        self._exposed = []


def _one_sided(communicator: DeviceCommunicator, transport: str) -> OneSidedCommunicator | None:
    """The communicator as the one-sided READ path uses it under ``transport``, or None when
    it gets the send/recv path."""
    has_read = CommOp.READ in communicator.supported_ops and isinstance(
        communicator, OneSidedCommunicator
    )
    if transport == "read" and not has_read:
        raise ValueError(
            f"TransferConfig(transport='read') needs a communicator with one-sided READ "
            f"(CommOp.READ and the OneSidedCommunicator API); {type(communicator).__name__} has "
            "none: use transport='auto' or a communicator such as NIXL_RDT"
        )
    if not has_read or transport == "send_recv":
        return None
    assert isinstance(communicator, OneSidedCommunicator)
    return communicator


class WeightProducer(_Engine):
    """Serves a ``WeightSource`` to the fleet's consumers.

    Args:
        coordinator: an initialized coordinator over the fleet.
        communicator: a communicator over the same group.
        fleet: the producer and consumer ranks; this worker must be a producer.
        source: the weights this producer holds.
        config: the deployment settings (must equal the consumers').
    """

    def __init__(
        self,
        coordinator: WorkerCoordinator,
        communicator: DeviceCommunicator,
        *,
        fleet: Fleet,
        source: WeightSource,
        config: TransferConfig | None = None,
    ) -> None:
        super().__init__(coordinator, communicator, fleet, config or TransferConfig())
        rank = coordinator.get_rank()
        if rank not in fleet.producer_ranks:
            raise ValueError(f"rank {rank} is not a producer of {fleet}")
        self.producer_id = fleet.producer_ranks.index(rank)
        self.source = source
        self.shared_bytes = 0  # share_cpu_weights: source bytes moved into shared memory
        self._schedule: list[tuple[int, int, int]] = []  # (group, consumer, chunk index)
        self._source_names: dict[
            tuple[int, int], tuple[str, ExposedDescriptor]
        ] = {}  # exposed sources
        self._generation = 0  # serve rings exposed by ``admit``
        self._dirty = False  # READ path: device work queued since the last synchronization
        # READ path: the packs queued since the last announcement (``_program``'s launches)
        self._packs: list[Callable[[], None]] = []
        self._seen_sources: tuple[set[Any], set[Any]] = (set(), set())  # (last sync, this one)
        # group -> (tensor objects, data pointers) when the recorded sync opened it
        self._seen_groups: dict[int, tuple[list[torch.Tensor], list[int]]] = {}
        # every served tensor as ``source.current`` gave it at the recorded sync (if it can)
        self._seen_current: tuple[list[torch.Tensor], list[int]] | None = None
        # push path, CUDA: (event behind a queued transfer, its consumer) of this sync
        self._queued: list[tuple[torch.cuda.Event, int]] = []
        # push path, not CUDA: consumer -> (receive of its receipt still posted, its buffer)
        self._receipts_posted: dict[int, tuple[Any, torch.Tensor]] = {}

    # -- set-up --------------------------------------------------------------------------------
    @_gc_paused
    def setup(self) -> None:
        """Join the fleet's set-up; raises on any rank's refusal (see module docstring)."""
        start = self._phase_start = time.perf_counter()
        held = self.source.held_names()
        index = self._index(ProducerFacts(metadata=tuple(self.source.metadata()), held=held))
        self._phase("index")
        errors: list[Exception] = []
        for cid, crank in enumerate(self.fleet.consumer_ranks):
            plan_msg = self.coordinator.recv_object(crank)
            reserve_msg = self.coordinator.recv_object(crank)
            self._phase("wait for plans")
            try:
                self._accept(cid, crank, index, plan_msg, reserve_msg)
            except Exception as exc:  # every consumer is checked, then reported to the fleet
                errors.append(exc)
            self._phase("check plans")
        error: Exception | None = errors[0] if errors else None
        if len(errors) > 1:
            error = type(errors[0])("; ".join(str(e) for e in errors))
        _gather_verdicts(self.coordinator, error)
        self._build_schedule()
        self._phase("verdicts, schedule")
        self._share_weights()
        if self._read:
            self._expose_rings()
            self._phase("expose")
        self.setup_seconds = time.perf_counter() - start

    def _share_weights(self) -> None:
        """``TransferConfig.share_cpu_weights`` / ``share_gpu_weights``: at set-up, before any
        address is recorded."""
        kind = self.communicator.device.type
        wanted = {"cpu": self.config.share_cpu_weights, "cuda": self.config.share_gpu_weights}
        if not (
            self._read
            and wanted.get(kind, False)
            and self._resident
            and any(pair.maps for pair in self._pairs.values())
        ):
            return
        # in the order chunks take them: a consumer's items then step evenly through the arena
        # (its shard of each of 100,000 expert weights), and its copies batch into few
        tensors = self.source.current(self._served_names)
        if tensors is None:
            return
        if kind == "cpu":
            self.shared_bytes = share_storages(tensors)
        else:
            self.shared_bytes = sum(
                gather_device_storages(
                    bundle,
                    max_bytes=DEVICE_ARENA_BYTES,
                    arena_bytes=1 << 62,
                    device=self.communicator.device,
                )
                for bundle in self._chunk_bundles(
                    dict(zip(self._served_names, tensors, strict=True))
                )
            )
        self._phase("share weights")

    def _chunk_bundles(self, tensors: Mapping[str, torch.Tensor]) -> list[list[torch.Tensor]]:
        """The tensors of the items that travel together (chunks of several items, of the
        consumers that map this rank's memory), each in a storage of its own, in chunk order,
        cut into bundles of up to ``DEVICE_ARENA_BYTES`` between chunks: one arena each, so
        that no chunk spans two (its items would be packed). A storage that holds several
        weights (a trainer's flat buffer) is one home for them already: it stays."""
        alone = _alone_in_storage(tensors.values())
        bundles: list[list[torch.Tensor]] = [[]]
        size, seen = 0, set()
        for pair in self._pairs.values():
            for c in pair.chunks if pair.maps else ():
                if len(c.items) < 2:
                    continue
                names = [
                    n for n in pair.views[c.index].names if n not in seen and alone(tensors[n])
                ]
                seen.update(names)
                nbytes = sum(tensors[n].untyped_storage().nbytes() for n in names)
                if size and size + nbytes > DEVICE_ARENA_BYTES:
                    bundles.append([])
                    size = 0
                bundles[-1] += [tensors[n] for n in names]
                size += nbytes
        return bundles

    def _expose_rings(self) -> None:
        """Expose every serve ring once; collective with the consumers' ``_connect_read``."""
        for cid, pair in self._pairs.items():
            if pair.ring is not None:
                self._expose(pair.ring.buffer, ring_name(self.producer_id, cid))
        self._one.exchange_exposed()

    @_gc_paused
    def admit(self, consumer_id: int) -> None:
        """Take consumer ``consumer_id`` (back) in, between syncs.

        For a consumer that sat out set-up (``WeightConsumer.setup(defer=True)``) or was
        restarted (a new ``WeightConsumer`` over the same ranks calling ``join()``): call it
        on every producer while that consumer calls ``join()``. Only those ranks take part —
        the other consumers neither wait nor notice, and their next sync is unchanged. The
        consumer's plan is checked like at set-up; on a refusal anywhere the consumer is left
        out of the fleet (the others keep syncing) and ``admit`` raises the reason.
        """
        if not 0 <= consumer_id < len(self.fleet.consumer_ranks):
            raise ValueError(f"no consumer {consumer_id} in {self.fleet}")
        crank = self.fleet.consumer_ranks[consumer_id]
        index = self.index
        assert index is not None, "admit() needs setup() first"
        facts = self.producer_facts if self.producer_id == 0 else None
        self.coordinator.send_object(AdmitMessage(self.producer_id, self._syncs, facts), crank)
        plan_msg = self.coordinator.recv_object(crank)
        reserve_msg = self.coordinator.recv_object(crank)
        self._drop_pair(consumer_id)
        error: Exception | None = None
        try:
            self._accept(consumer_id, crank, index, plan_msg, reserve_msg)
        except Exception as exc:  # reported to the consumer, then raised here
            error = exc
        self.coordinator.send_object(
            None if error is None else f"{type(error).__name__}: {error}", crank
        )
        verdict = self.coordinator.recv_object(crank)  # the consumer's: every producer agreed?
        if error is not None or verdict is not None:
            self._drop_pair(consumer_id)
            self._pairs[consumer_id] = _Pair(peer_rank=crank, chunks=[], requests=[], slot_bytes=0)
            self._build_schedule()
            if error is not None:
                raise error
            raise WeightTransferSetupError(f"consumer {consumer_id} was not admitted: {verdict}")
        self._build_schedule()
        pair = self._pairs[consumer_id]
        if self._read and pair.ring is not None:
            self._generation += 1
            name = f"{ring_name(self.producer_id, consumer_id)}-g{self._generation}"
            desc = self._one.expose(pair.ring.buffer, name)
            self._exposed.append(name)
            pair.remote_name = name
            self.coordinator.send_object(desc, crank)

    def _drop_pair(self, consumer_id: int) -> None:
        """Release what this producer holds for one consumer (its ring, sender, exposure)."""
        pair = self._pairs.pop(consumer_id, None)
        if pair is None:
            return
        pair.close()
        name = pair.remote_name or ring_name(self.producer_id, consumer_id)
        if pair.ring is not None and name in self._exposed:
            self._unexpose(name)

    def _accept(
        self, cid: int, crank: int, index: ModelIndex, plan_msg: Any, reserve_msg: Any
    ) -> None:
        if not isinstance(plan_msg, PlanMessage) or plan_msg.consumer_id != cid:
            raise RuntimeError(f"expected a plan from consumer {cid}, got {plan_msg!r:.80}")
        payload, path = plan_msg.requests, plan_msg.path
        strided, maps = plan_msg.strided, plan_msg.maps
        if isinstance(payload, str):  # the consumer failed its own set-up
            self._pairs[cid] = _Pair(peer_rank=crank, chunks=[], requests=[], slot_bytes=0)
            return
        if path != self.path:  # refused here, before the READ path's collective set-up step
            raise PlanMismatchError(
                f"consumer {cid} uses the {path!r} path but producer {self.producer_id} the "
                f"{self.path!r} path; give both sides the same TransferConfig.transport"
            )
        try:
            kinds, names, ids = decode_requests(payload)
        except ValueError as exc:
            raise UnsafeOpError(f"consumer {cid} sent {exc}") from None
        pos = self._check_names(cid, index, names)
        sizes = self._check_kinds(cid, index, kinds, names, ids, pos)
        layout = _pair_layout(self.layout, strided is True)  # strided reads: see there
        chunks = cut_chunks(
            index.group_ids[pos],
            index.class_ids[pos],
            np.full(len(pos), self.producer_id),
            sizes[ids],
            layout,
        )
        encoded = (kinds, names, ids.tobytes())
        digest = plan_digest(cid, self.producer_id, chunks, encoded, index.router, layout)
        self._compare(cid, chunks, digest, reserve_msg)
        slot = slot_bytes(chunks, self.producer_id, self.layout.align)
        pair = _Pair(peer_rank=crank, chunks=chunks, requests=[], slot_bytes=slot, names=names)
        pair.strided = self._read and strided is True
        pair.maps = pair.strided and maps is True
        items = _item_table([Request("", *k) for k in kinds])
        prefixes = _shared_splits([Request("", *k) for k in kinds], 0)
        id_list = ids.tolist()
        pair.items = [items[k] for k in id_list]
        pair.prefixes = [prefixes[k] for k in id_list]
        pair.views = {
            c.index: _PackPlan(
                names=[names[i] for i in c.items], prefixes=[pair.prefixes[i] for i in c.items]
            )
            for c in chunks
        }
        if chunks:
            ring_bytes = slot * self.layout.ring_slots
            alloc = buffer_alloc_bytes(ring_bytes, self.config.presize_bytes)
            device = self.communicator.device
            if pair.maps:  # the consumer maps this ring (CUDA IPC; on the CPU, shared memory)
                buf = shared_empty(alloc, device)
            else:
                buf = torch.empty(alloc, dtype=torch.uint8, device=device)
            pair.ring = ServeRing(buf, self.layout.ring_slots, slot)
            if self._threads:
                pair.worker = SerialWorker(f"wt-serve-c{cid}")
        self._pairs[cid] = pair

    def _compare(self, cid: int, chunks: list[Chunk], digest: str, reserve_msg: Any) -> None:
        if not isinstance(reserve_msg, ReserveMessage) or reserve_msg.consumer_id != cid:
            raise RuntimeError(
                f"expected a reservation from consumer {cid}, got {reserve_msg!r:.80}"
            )
        nbytes, their_digest = reserve_msg.nbytes, reserve_msg.digest
        if their_digest != digest:
            raise PlanMismatchError(
                f"producer {self.producer_id} and consumer {cid} derived different plans "
                f"(digest {digest[:12]} vs {str(their_digest)[:12]}): their deployments differ "
                "(model, TransferConfig, workers_per_replica, or held names); deploy both sides "
                "from the same configuration"
            )
        ring_bytes = (
            slot_bytes(chunks, self.producer_id, self.layout.align) * self.layout.ring_slots
        )
        if nbytes != ring_bytes:
            raise PlanMismatchError(
                f"consumer {cid} reserved {nbytes} B of serve ring but the plan needs {ring_bytes}"
            )

    def _check_names(self, cid: int, index: ModelIndex, names: list[str]) -> np.ndarray:
        """Positions of ``names`` in the index; refuses names this producer does not serve."""
        pos = np.fromiter((index.position.get(n, -1) for n in names), np.int64, len(names))
        known = pos >= 0
        held = np.zeros(len(pos), dtype=bool)
        held[known] = index.held_by(self.producer_id)[pos[known]]
        if not held.all():
            name = names[int(np.argmin(held))]
            raise UnservedNameError(
                f"consumer {cid} asked producer {self.producer_id} for {name!r}, which it "
                "does not hold; refusing to serve it"
            )
        routed = index.routes(cid, pos)
        if (routed != self.producer_id).any():
            i = int(np.argmax(routed != self.producer_id))
            raise UnservedNameError(
                f"consumer {cid} asked producer {self.producer_id} for {names[i]!r}, which this "
                f"deployment routes to producer {int(routed[i])}; refusing to serve it"
            )
        return pos

    def _check_kinds(
        self,
        cid: int,
        index: ModelIndex,
        kinds: list[Any],
        names: list[str],
        ids: np.ndarray,
        pos: np.ndarray,
    ) -> np.ndarray:
        """Check each distinct (chain, source shape) once; returns the bytes of each kind."""
        pairs, first = np.unique(
            np.stack([ids.astype(np.int64), index.shape_ids[pos]]), axis=1, return_index=True
        )
        for (k, _sid), i in zip(pairs.T.tolist(), first.tolist(), strict=True):
            self._check_request(cid, index, Request(names[i], *kinds[k]))
        return np.asarray([Request("", *k).nbytes for k in kinds] or [0], dtype=np.int64)

    def _check_request(self, cid: int, index: ModelIndex, req: Request) -> None:
        """Refuse an unsafe chain or a shape that does not follow from the weight's metadata."""
        meta = index.meta[req.name]
        check_chain(req.chain)
        try:
            shape, wire = self._shapes(meta.shape, meta.torch_dtype, req.chain)
        except UnsafeOpError:
            raise
        except Exception as exc:
            raise UnsafeOpError(
                f"consumer {cid}: op chain {req.chain!r} does not apply to {req.name!r} "
                f"of shape {meta.shape}: {exc}"
            ) from exc
        if shape != tuple(req.shape) or req.dtype != meta.dtype or req.wire_shape != wire:
            raise UnsafeOpError(
                f"consumer {cid}: {req.name!r} through {req.chain!r} is {shape} {meta.dtype}, "
                f"(wire shape {wire}), but the request claims {req.shape} {req.dtype} "
                f"(wire shape {req.wire_shape})"
            )

    def _build_schedule(self) -> None:
        if self._threads:
            # a thread per pair: consumers take turns within a group (the pair's chunk i of
            # every consumer before chunk i + 1 of any), so a ring full for one leaves the
            # others fed
            turns = [
                (c.group, c.seq, cid, c.index) for cid, p in self._pairs.items() for c in p.chunks
            ]
            self._schedule = [(g, cid, i) for g, _, cid, i in sorted(turns)]
        else:
            # one thread, transfers that block: (group, consumer, chunk) is the one order every
            # rank keeps (a consumer's plan runs group by group; within a group and consumer
            # this producer's chunks come in the consumer's plan order)
            sched = [(c.group, cid, c.index) for cid, p in self._pairs.items() for c in p.chunks]
            self._schedule = sorted(sched)
        for pair in self._pairs.values():
            pair.sync_bytes = sum(c.nbytes for c in pair.chunks)
        self._group_counts: dict[int, int] = {}
        for g, _cid, _i in self._schedule:
            self._group_counts[g] = self._group_counts.get(g, 0) + 1
        assert self.index is not None
        served: dict[int, set[str]] = {}
        for pair in self._pairs.values():
            for c in pair.chunks:
                served.setdefault(c.group, set()).update(pair.names[i] for i in c.items)
        self._group_names = {
            g: [n for n in self.index.groups[g] if n in names] for g, names in served.items()
        }
        self._group_order = sorted(self._group_names)
        self._served_names = [n for g in self._group_order for n in self._group_names[g]]
        self._sync_bytes = sum(pair.sync_bytes for pair in self._pairs.values())

    # -- sync ----------------------------------------------------------------------------------
    @_gc_paused
    def sync(self) -> SyncStats:
        """Serve one version of the weights to every consumer; returns this rank's stats."""
        start = time.perf_counter()
        if self.trace is not None:
            self.trace.clear()
        self._mark("sync")
        self.source.begin_sync()
        self._syncs += 1
        self._packed = 0
        barrier = FreeBarrier(self._group_counts)
        serve = self._serve_read if self._read else self._serve_push
        opened: dict[int, Mapping[str, torch.Tensor]] = {}
        moved = 0
        if self._read and self.communicator.device.type == "cuda":
            torch.cuda.synchronize(self.communicator.device)  # the trainer's writes, any stream
        record = self._read and self.config.replay and self._resident
        now = self._current() if record else None
        if self._replayable():
            # checked before the recorded packs run: a moved source may be freed memory
            if now is not None:
                self._mark("checked")
                if _same_tensors(now, self._seen_current):
                    return self._replay(start, {}, self._replay_packs())
            else:
                every = {g: self.source.open_group(self._group_names[g]) for g in self._group_order}
                self._mark("opened")
                if self._unchanged(every):
                    return self._replay(start, every, self._replay_packs())
                for g in self._group_order:
                    self.source.release_group(self._group_names[g])
        self._seen_current = now
        per_group = self.config.announce_bytes == 0
        for pair in self._pairs.values():
            pair.slot_seq.clear()  # the last sync drained every slot
            pair.failed = threading.Event()  # push: a failed chunk stops the pair's later ones
            pair.error = None
            pair.packs = 0
            pair.announced = 0
            if pair.replay is not None:
                pair.replay.close()
            pair.replay = _Replay() if record and pair.chunks else None
        for g, cid, i in self._schedule:
            self._release(barrier, opened)
            if g not in opened:
                if self._read and per_group:  # a new group: what the last one queued goes out
                    self._announce_all()
                if self._read:
                    self._poll_done(barrier)
                self._mark(f"open {g}")
                opened[g] = self.source.open_group(self._group_names[g])
                self._dirty = True  # opening may queue device work (a gather): sync before telling
                if record:
                    self._seen_groups[g] = _snapshot(opened[g], self._group_names[g])
                self._mark(f"opened {g}")
            pair = self._pairs[cid]
            chunk = pair.chunks[i]
            serve(cid, pair, chunk, opened[g], barrier)
            moved += chunk.nbytes
        self._mark("drain")
        self._drain(barrier)
        barrier.wait_all(self.config.stall_timeout)  # every send done or failed
        if not self._read:
            self._take_receipts()
        self._release(barrier, opened)
        self._raise_pair_errors()
        self._mark("end")
        self._seen_sources = (self._seen_sources[1], set())
        for pair in self._pairs.values():
            rec = pair.replay
            if rec is not None and pair.ring is not None:
                rec.packs = pair.packs
                rec.last_seq = max(c.seq for c in pair.chunks)
                rec.sync = self._syncs if rec.ok and pair.packs <= pair.ring.slots else -1
        return SyncStats(
            seconds=time.perf_counter() - start,
            bytes=moved,
            chunks=len(self._schedule),
            path=self.path,
            packed=self._packed,
        )

    @property
    def _resident(self) -> bool:
        return self.source.resident

    def _replayable(self) -> bool:
        """READ path: whether every pair's last sync was recorded and the source is resident
        (opening every group at once costs nothing), so this sync may run as that one."""
        pairs = [pair for pair in self._pairs.values() if pair.chunks]
        return (
            self._read
            and self.config.replay
            and self._resident
            and bool(pairs)
            and all(p.replay is not None and p.replay.sync == self._syncs - 1 for p in pairs)
        )

    def _current(self) -> tuple[list[torch.Tensor], list[int]] | None:
        """Every served tensor as the source holds it now and its address (C-speed passes over
        one list), or None when the source cannot say without opening its groups."""
        tensors = self.source.current(self._served_names)
        if tensors is None:
            return None
        seen = self._seen_current
        if seen is not None and tensors is seen[0]:
            return seen  # the source vouches: the list of the recorded sync, nothing moved
        return tensors, list(map(torch.Tensor.data_ptr, tensors))

    def _unchanged(self, opened: Mapping[int, Mapping[str, torch.Tensor]]) -> bool:
        """Whether every group hands out the same tensor objects at the same addresses as when
        the recorded sync opened it (the trainer wrote in place; nothing was swapped)."""
        for g, tensors in opened.items():
            seen = self._seen_groups.get(g)
            objs, ptrs = _snapshot(tensors, self._group_names[g])
            if seen is None or ptrs != seen[1] or not all(map(operator.is_, objs, seen[0])):
                return False
        return True

    def _replay_packs(self) -> dict[int, Waitable | None]:
        """Launch every pair's recorded packs (the programs of its chunks merged into one:
        one CUDA graph on a GPU); the consumers that had packs, each with the handle of its
        packs where they run on a thread of their own (None: done, or queued on the GPU).

        On the CPU, with more than one consumer's packs, each runs on its pair's thread but the
        first, which this thread runs after launching the others: a copy releases the GIL, so
        the packs share the cores their consumers leave idle while they wait for their slots
        (measured on 2 cores: 100,000 MoE tensors for two consumers, 147 ms one after another,
        about 90 ms side by side)."""
        runs: list[tuple[int, _Pair, CopyProgram]] = []
        for cid, pair in self._pairs.items():
            rec = pair.replay
            if rec is not None and rec.programs:
                if rec.prepared is None:
                    rec.prepared = CopyProgram.merged(rec.programs)
                runs.append((cid, pair, rec.prepared))
        handles: dict[int, Waitable | None] = {}
        spread = self.communicator.device.type == "cpu"
        for cid, pair, program in runs[1:] if spread else ():
            if pair.worker is None:  # the READ path has no sender thread: this one packs
                pair.worker = SerialWorker(f"wt-pack-c{cid}")
            handles[cid] = pair.worker.submit(program.run)
        for cid, _pair, program in runs if not spread else runs[:1]:
            program.run()
            handles[cid] = None
        return handles

    def _replay(
        self,
        start: float,
        opened: Mapping[int, Mapping[str, torch.Tensor]],
        packs: dict[int, Waitable | None],
    ) -> SyncStats:
        """The steady state: every source is where it was, so every chunk is too. The recorded
        packs ran as one program per consumer, each consumer gets one message for the whole
        sync, as soon as its packs are through, and answers once it has read everything; no
        per-chunk work on this side."""
        self._mark("replay")
        pairs = [(cid, pair, pair.replay) for cid, pair in self._pairs.items() if pair.replay]
        if packs:
            device_synchronize(self.communicator.device)
        for cid, pair, _ in pairs:
            handle = packs.get(cid)
            if handle is not None:
                what = f"producer {self.producer_id}: packs of the replayed sync for consumer {cid}"
                wait_or_stall(handle, self.config.stall_timeout, what)
            self._tell(pair, encode_replay(self._syncs), "the replayed sync")
        self._mark("told")
        for cid, pair, rec in pairs:
            self._await_done(cid, pair, rec.last_seq)
            rec.sync = self._syncs
        for g in opened:
            self.source.release_group(self._group_names[g])
        self._mark("end")
        return SyncStats(
            seconds=time.perf_counter() - start,
            bytes=self._sync_bytes,
            chunks=len(self._schedule),
            path=self.path,
            packed=sum(rec.packs for _, _, rec in pairs),
            replayed=True,
        )

    def _await_done(self, cid: int, pair: _Pair, last_seq: int) -> None:
        """Take consumer ``cid``'s 'done' messages until it has read chunk ``last_seq``."""
        what = f"producer {self.producer_id} waiting for consumer {cid} to read (replayed sync)"
        seen = -1
        while seen < last_seq:
            done = self._consumer_word(pair.peer_rank, what, block=True)
            assert done is not None
            sync, seq = done.sync, done.seq
            if sync != self._syncs or not seen < seq <= last_seq:
                raise RuntimeError(f"{what}: unexpected 'done' for (sync, seq) {(sync, seq)}")
            seen = seq

    def _serve_push(
        self,
        cid: int,
        pair: _Pair,
        chunk: Chunk,
        tensors: Mapping[str, torch.Tensor],
        barrier: FreeBarrier,
    ) -> None:
        """Send one chunk. A consumer that failed (dead, stalled) is skipped for the rest of
        the sync and its error raised at the end (``_raise_pair_errors``): the others are
        served in full first."""
        assert pair.ring is not None
        if pair.error is not None:
            barrier.arrive(chunk.group)
            return
        try:
            self._push_chunk(cid, pair, chunk, tensors, barrier)
        except Exception as exc:  # noqa: BLE001 - raised once the others are served
            pair.error = pair.error or exc
            pair.failed.set()
            barrier.arrive(chunk.group)

    def _push_chunk(
        self,
        cid: int,
        pair: _Pair,
        chunk: Chunk,
        tensors: Mapping[str, torch.Tensor],
        barrier: FreeBarrier,
    ) -> None:
        assert pair.ring is not None
        direct = self._direct_view(pair, chunk, tensors)
        if pair.worker is None:  # in fleet order from this thread: a slot is reused only
            # after its last send returned (blocking) or behind it on the stream (NCCL)
            if direct is None:
                self._packed += 1
                direct = pair.ring.acquire(chunk.seq, chunk.nbytes, 0.0, "")  # nothing in flight
                self._packer(direct, pair, chunk, tensors)()
            what = f"producer {self.producer_id} -> consumer {cid} (chunk {chunk.seq})"
            _send(self.communicator, self._async, direct, pair.peer_rank, self.config, what)
            self._queued_mark(cid)
            barrier.arrive(chunk.group)
            return
        if direct is not None:
            handle = pair.worker.submit(self._sender(cid, pair, chunk, direct))
        else:
            what = f"producer {self.producer_id} -> consumer {cid}"
            timeout = self.config.stall_timeout
            slot = pair.ring.acquire(chunk.seq, chunk.nbytes, timeout, what)
            self._packed += 1
            # packed by the sender thread right before its send: no hand-over between threads
            # per chunk (on a busy host each costs a wake-up), and the slot's last send is over
            pack = self._packer(slot, pair, chunk, tensors)
            handle = pair.worker.submit(self._sender(cid, pair, chunk, slot, pack))
            pair.ring.in_flight(chunk.seq, handle)
        handle.add_done_callback(_arrival(barrier, chunk.group))

    def _serve_read(
        self,
        cid: int,
        pair: _Pair,
        chunk: Chunk,
        tensors: Mapping[str, torch.Tensor],
        barrier: FreeBarrier,
    ) -> None:
        """Tell the consumer where chunk ``seq`` is: in its source (exposed, no pack) or
        packed into the next ring slot (round robin over the packed chunks only) once that
        slot's last reader is done."""
        assert pair.ring is not None
        exposed = self._exposed_source(pair, chunk, tensors)
        if exposed is not None:
            name, offset, desc, strides = exposed
            pair.outbox.append(
                Announcement(
                    self._syncs, chunk.seq, offset, chunk.nbytes, name, strides, desc is not None
                )
            )
            if desc is not None:
                pair.outbox_descs.append(desc)
        else:
            index = pair.packs % pair.ring.slots
            pair.packs += 1
            last = pair.slot_seq.get(index)  # the last chunk packed into this slot
            while last is not None and pair.pending and pair.pending[0][0] <= last:
                self._take_done(cid, pair, barrier, block=True)
            pair.slot_seq[index] = chunk.seq
            start = index * pair.slot_bytes
            slot = pair.ring.buffer[start : start + chunk.nbytes]
            self._pack(slot, pair, chunk, tensors)
            pair.outbox.append(Announcement(self._syncs, chunk.seq, start, chunk.nbytes))
            pair.outbox_packed += 1
        pair.pending.append((chunk.seq, chunk.group))
        pair.outbox_bytes += chunk.nbytes
        if pair.replay is not None and pair.views[chunk.index].copies:
            pair.replay.ok = False  # fresh bytes every sync: never replayed
        # announcements double in size up to the limit, and to an eighth of what the pair
        # moves per sync: the consumer starts on the first few MiB, a sync takes a dozen
        # messages, and what is left to read after the last one is small
        limit = self.config.announce_bytes or ANNOUNCE_BYTES
        limit = min(limit, max(FIRST_ANNOUNCE_BYTES, pair.sync_bytes // 8))
        if pair.outbox_bytes >= min(
            limit, max(FIRST_ANNOUNCE_BYTES, pair.announced)
        ) or pair.outbox_packed >= max(1, pair.ring.slots // 2):
            self._announce(pair)  # let the consumer read half the ring while we pack the rest

    def _announce(self, pair: _Pair) -> None:
        """Send the pair's queued announcements as one message, once every pack and source
        behind them is in place (one device synchronization covers all of them)."""
        if pair.outbox:
            if self._packs:  # every queued pack, then one synchronization below
                packs, self._packs = self._packs, []
                for launch in packs:
                    launch()
                self._dirty = True
            if self._dirty:
                device_synchronize(self.communicator.device)
                self._dirty = False
            self._mark(f"announce {pair.peer_rank} x{len(pair.outbox)}")
            if pair.outbox_descs:  # through the coordinator, beside the message that names them
                descs, pair.outbox_descs = pair.outbox_descs, []
                self._send_descriptors(pair, descs)
            self._tell(pair, self._codec.encode(pair.outbox), "what is ready")
            pair.outbox = []
        pair.announced += pair.outbox_bytes
        pair.outbox_bytes = 0
        pair.outbox_packed = 0

    def _send_descriptors(self, pair: _Pair, descs: list[Any]) -> None:
        """Hand ``descs`` to the pair's consumer through the coordinator, from a thread of the
        pair's: a coordinator send waits for the matching receive, which the consumer posts
        only once it reads the announcement that names them."""
        if pair.desc_sender is None:
            pair.desc_sender = SerialWorker(f"wt-desc-r{pair.peer_rank}")
        send = partial(self.coordinator.send_object, descs, pair.peer_rank)
        pair.desc_sends.append(pair.desc_sender.submit(send))

    def _tell(self, pair: _Pair, message: bytes, what: str) -> None:
        """Notify ``pair``'s consumer; a failure (the consumer is gone: NIXL reports the
        disconnect) names the consumer and what it was being told."""
        try:
            self._one.notify(pair.peer_rank, message)
        except Exception as exc:
            cid = next(c for c, p in self._pairs.items() if p is pair)
            raise RuntimeError(
                f"producer {self.producer_id}: telling consumer {cid} (rank {pair.peer_rank}) "
                f"{what} in sync {self._syncs} failed: {type(exc).__name__}: {exc}"
            ) from exc

    def _poll_done(self, barrier: FreeBarrier) -> None:
        """Take every 'done' that has arrived (never waits): frees slots and finished groups."""
        for cid, pair in self._pairs.items():
            while pair.pending and self._take_done(cid, pair, barrier, block=False):
                pass

    def _exposed_source(
        self, pair: _Pair, chunk: Chunk, tensors: Mapping[str, torch.Tensor]
    ) -> tuple[str, int, Any, Any] | None:
        """(buffer name, byte offset, descriptor if new, strides) of a chunk read in place.

        A one-item chunk: strides are None for a contiguous view, else the view's (strided
        reads). A chunk of several items, for a consumer that reads strided views on a mapping
        of this rank's memory, whose items all lie in one exposed buffer (a trainer's flat
        parameter buffer, or the ``share_storages`` arena its weights were moved into): the
        offset is ``SPREAD`` and the strides are ``(byte offset, strides)`` per item, so the
        consumer copies each item straight from the trainer's memory and nothing is packed.

        Only views of the source's own storage (not copies the chain made) whose storage was
        already there last sync (or lies in an arena) are exposed (a trainer that gathers into
        fresh memory every sync gets packed copies instead of an ever-growing set of
        registrations); it stays exposed until ``close``.
        """
        single = len(chunk.items) == 1
        if not (single or pair.maps):
            return None  # through NIXL, a descriptor per row of a small weight: packed
        srcs = self._sources(pair, chunk, tensors)
        plan = pair.views[chunk.index]
        if plan.inplace is not None and plan.inplace[0] is srcs:
            return plan.inplace[1], plan.inplace[2], None, plan.inplace[3]  # as last sync
        if plan.copies:
            return None
        if single:
            view = srcs[0]
            contiguous = view.is_contiguous()
            if not (contiguous or pair.strided):
                return None
            strides: Any = None if contiguous else tuple(view.stride())
        else:
            home = _home(srcs[0])
            if any(_home(s) != home for s in srcs):
                return None  # several storages (not in one arena): packed
            strides = tuple((s.data_ptr() - home[0], tuple(s.stride())) for s in srcs)
        known = self._exposed_storage(pair, srcs[0])
        if known is None:
            return None
        if (strides is not None or not single) and pair.maps and not self._mappable(srcs[0]):
            # a consumer that maps its producers' memory reads strided views of this one, which
            # it cannot map (a DRAM storage out of shared memory), through NIXL: a descriptor
            # per row (per item of a flat buffer), not what it asked for. Packed instead.
            return None
        name, desc = known
        offset = srcs[0].data_ptr() - _home(srcs[0])[0] if single else SPREAD
        plan.inplace = (srcs, name, offset, strides)
        return name, offset, desc, strides

    def _mappable(self, view: torch.Tensor) -> bool:
        """Whether the exposed storage of ``view`` can be mapped by a same-node peer (a DRAM
        storage can stay out of shared memory: ``NixlOptions.shared_memory``)."""
        _, desc = self._source_names[_home(view)]
        return desc.mapping is not None

    def _exposed_storage(self, pair: _Pair, view: torch.Tensor) -> tuple[str, Any] | None:
        """(exposed name, descriptor the first time this consumer hears of it, else None) of
        ``view``'s storage (of the arena it lies in: ``_home``), exposing it if it was there
        last sync, lies in an arena, or the source vouches that its tensors stay where they
        are (``WeightSource.in_place``); None if it is new: a storage met once (a trainer that
        puts its weights in new tensors every step) is packed, never registered."""
        storage = view.untyped_storage()
        key = _home(view)
        known = self._source_names.get(key)
        if known is None:
            arena = shared_arena(storage.data_ptr())
            fresh = key not in self._seen_sources[0] and arena is None
            if fresh and not self.source.in_place:
                self._seen_sources[1].add(key)
                if pair.replay is not None:
                    pair.replay.ok = False  # read in place next sync: not a state to repeat
                return None
            name = f"wt-src-p{self.producer_id}-{len(self._source_names)}"
            whole = arena
            if whole is None:
                whole = torch.empty(0, dtype=torch.uint8, device=view.device)
                whole.set_(storage, 0, (key[1],), (1,))
            desc = self._one.expose(whole, name)
            self._exposed.append(name)
            known = self._source_names[key] = (name, desc)
        name, desc = known
        if name in pair.told:
            return name, None
        pair.told.add(name)  # this consumer imports the descriptor once
        return name, desc

    def _take_done(self, cid: int, pair: _Pair, barrier: FreeBarrier, *, block: bool) -> bool:
        """Consume one 'done up to seq' from consumer ``cid`` (waiting for it when ``block``)."""
        what = f"producer {self.producer_id} waiting for consumer {cid} to read"
        if block:
            self._announce_all()  # never wait on a consumer that has not been told everything
            self._mark(f"wait done {pair.peer_rank}")
            done = self._consumer_word(pair.peer_rank, what, block=True)
            self._mark(f"got done {pair.peer_rank}")
        else:
            done = self._consumer_word(pair.peer_rank, what, block=False)
        if done is None:
            return False
        sync, seq = done.sync, done.seq
        if sync != self._syncs or not pair.pending or seq < pair.pending[0][0]:
            raise RuntimeError(f"{what}: unexpected 'done' for (sync, seq) {(sync, seq)}")
        while pair.pending and pair.pending[0][0] <= seq:
            barrier.arrive(pair.pending.popleft()[1])
        return True

    def _consumer_word(self, peer: int, what: str, *, block: bool) -> Done | None:
        """The consumer's next message that is not 'alive' (None: none yet, when not
        ``block``). An 'alive' of this sync starts the stall timeout over (the consumer reads
        other producers first); one of an earlier sync is dropped; a later one is an error."""
        stall = self.config.stall_timeout
        deadline = time.monotonic() + stall
        while True:
            if block:
                left = deadline - time.monotonic()
                msg: bytes | None = wait_message(self._one, peer, left, what, stall)
            else:
                msg = poll_message(self._one, peer)
            if msg is None:
                return None
            word = decode_consumer_message(msg, what)
            if isinstance(word, Done):
                return word
            sync = word.sync
            if sync > self._syncs:
                raise RuntimeError(f"{what}: 'alive' for sync {sync}, this is sync {self._syncs}")
            if sync == self._syncs:
                self._mark(f"alive {peer}")
                deadline = time.monotonic() + stall

    def _announce_all(self) -> None:
        for pair in self._pairs.values():
            if pair.outbox:
                self._announce(pair)

    def _drain(self, barrier: FreeBarrier) -> None:
        self._announce_all()
        timeout = self.config.stall_timeout
        for cid, pair in self._pairs.items():
            if self._read:
                while pair.pending:
                    self._take_done(cid, pair, barrier, block=True)
                what = f"producer {self.producer_id}: descriptors to consumer {cid}"
                for handle in pair.desc_sends:  # received: the consumer read every chunk
                    wait_or_stall(handle, timeout, what)
                pair.desc_sends.clear()
            elif pair.ring is not None:
                try:
                    pair.ring.drain(timeout, f"producer {self.producer_id} -> consumer {cid}")
                except Exception as exc:  # noqa: BLE001 - raised once the others are drained
                    pair.error = pair.error or exc

    def _queued_mark(self, cid: int) -> None:
        """On a stream-ordered communicator: an event behind the transfer just queued for
        consumer ``cid``, so that a stall names whose transfer stopped the stream."""
        device = self.communicator.device
        if device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._queued.append((event, cid))

    def _take_receipts(self) -> None:
        """Push path: every consumer served says it has the sync in place (one number, sent
        after its last chunk is unpacked), in consumer order. Without this a sync to a dead
        consumer could end well: NCCL, and a socket's buffers, take small sends that the peer
        never receives. Sends and receipts of a stream-ordered communicator (NCCL) are only
        queued; on a stall, the events behind them name the consumer whose transfer stopped the
        stream."""
        device = self.communicator.device
        waiting = []
        for cid in sorted(self._pairs):
            pair = self._pairs[cid]
            if not pair.chunks or pair.error is not None:
                continue
            what = f"producer {self.producer_id} waiting for consumer {cid}'s receipt"
            what = f"{what} of sync {self._syncs}"
            try:
                if device.type == "cuda":
                    receipt = pair.receipt_buffer(device)
                    _recv(
                        self.communicator, self._async, receipt, pair.peer_rank, self.config, what
                    )
                    self._queued_mark(cid)
                    waiting.append((cid, pair))
                else:
                    self._await_receipt(cid, pair, what)
            except Exception as exc:  # noqa: BLE001 - raised once the others are heard
                pair.error = pair.error or _reworded(exc, f"{what}: {exc}")
        try:
            wait_device(device, self.config.stall_timeout, f"producer {self.producer_id}")
        except TransferStallError as exc:
            # stream order: the first unfinished transfer is the one that holds up the rest
            first = next((cid for event, cid in self._queued if not event.query()), None)
            if first is None:
                raise
            late = {cid for event, cid in self._queued if not event.query()}
            for cid in sorted(late):
                why = (
                    f"the transfers to consumer {cid} stopped"
                    if cid == first
                    else f"consumer {cid} is unconfirmed, queued behind consumer {first}"
                )
                self._pairs[cid].error = self._pairs[cid].error or TransferStallError(
                    f"{exc}; {why} (what is queued on the stream stays there: recreate the "
                    "communicator to go on)"
                )
            waiting = []  # the stream is held: reading a receipt would wait on it for ever
        finally:
            self._queued.clear()
        for cid, pair in waiting:
            got = int(pair.receipt_buffer(device).item())
            if got != self._syncs:
                pair.error = RuntimeError(
                    f"consumer {cid} confirmed its sync {got}, expected {self._syncs}: it fell "
                    "out of step with this producer (restart it: join() and admit())"
                )

    def _await_receipt(self, cid: int, pair: _Pair, what: str) -> None:
        """Take consumer ``cid``'s receipt of this sync, bounded by the stall timeout. A receive
        that timed out stays posted (gloo cannot take it back) and is waited on next time, so it
        never swallows a later receipt; receipts of syncs this producer gave up on are skipped."""
        comm, device = self.communicator, self.communicator.device
        post = None if self._async is None else self._async.irecv
        while True:
            posted = self._receipts_posted.pop(cid, None)
            if posted is None:
                buffer = torch.zeros(1, dtype=torch.int64, device=device)
                if post is None:
                    comm.recv(buffer, pair.peer_rank)
                    posted = (None, buffer)
                else:
                    posted = (post(buffer, pair.peer_rank), buffer)
            handle, buffer = posted
            if handle is not None:
                try:
                    wait_or_stall(handle, self.config.stall_timeout, what)
                except TransferStallError:
                    self._receipts_posted[cid] = posted
                    raise
            got = int(buffer.item())
            if got == self._syncs:
                return
            if got > self._syncs:
                raise RuntimeError(
                    f"consumer {cid} confirmed sync {got}, ahead of this producer's "
                    f"{self._syncs}: restart it (join() and admit())"
                )

    def _raise_pair_errors(self) -> None:
        """Push path: raise the first consumer's failure of this sync, once every other
        consumer was served."""
        failed = {cid: p.error for cid, p in self._pairs.items() if p.error is not None}
        if failed:
            cid, error = next(iter(failed.items()))
            served = sorted(set(self._pairs) - set(failed))
            msg = (
                f"producer {self.producer_id}: consumer(s) {sorted(failed)} failed in sync "
                f"{self._syncs} (consumer {cid}: {error}); consumers {served} were served"
            )
            raise _reworded(error, msg)

    def _release(self, barrier: FreeBarrier, opened: dict[int, Mapping[str, torch.Tensor]]) -> None:
        for g in barrier.pop_free():
            if opened.pop(g, None) is not None:
                self.source.release_group(self._group_names[g])

    def _direct_view(
        self, pair: _Pair, chunk: Chunk, tensors: Mapping[str, torch.Tensor]
    ) -> torch.Tensor | None:
        """The source bytes of a one-item chunk when they are contiguous: sent without a pack."""
        if len(chunk.items) != 1:
            return None
        srcs = self._sources(pair, chunk, tensors)
        return _as_bytes(srcs[0]) if srcs[0].is_contiguous() else None

    def _pack(
        self,
        slot: torch.Tensor,
        pair: _Pair,
        chunk: Chunk,
        tensors: Mapping[str, torch.Tensor],
    ) -> None:
        """Queue the copies of the chunk's items into its slot for ``_announce``."""
        self._packed += 1
        dsts, srcs = self._pack_views(slot, pair, chunk, tensors)
        self._packs.append(self._program(pair, chunk, dsts, srcs))
        plan = pair.views[chunk.index]
        if pair.replay is not None and not plan.copies:  # a chain that copies: not replayed
            assert plan.program is not None  # the one ``_program`` just gave
            pair.replay.programs.append(plan.program[2])

    def _sender(
        self,
        cid: int,
        pair: _Pair,
        chunk: Chunk,
        tensor: torch.Tensor,
        pack: Callable[[], None] | None = None,
    ) -> Callable[[], None]:
        """The sender thread's job for one chunk: ``pack`` (which fills ``tensor``) if given,
        then the send, bounded by the stall timeout. After a failed chunk the pair's later
        ones of the sync are not sent (the consumer would take them for the missing one)."""
        comm, peer, failed, config = self.communicator, pair.peer_rank, pair.failed, self.config
        asynchronous = self._async
        what = f"producer {self.producer_id} -> consumer {cid} (chunk {chunk.seq})"

        def send() -> None:
            if failed.is_set():
                raise RuntimeError(f"{what}: not sent, an earlier chunk to this consumer failed")
            try:
                if pack is not None:
                    pack()
                _send(comm, asynchronous, tensor, peer, config, what)
            except Exception as exc:
                if not failed.is_set():
                    pair.error = pair.error or exc  # the cause, not a later skipped chunk
                failed.set()
                raise

        return send

    def _packer(
        self,
        slot: torch.Tensor,
        pair: _Pair,
        chunk: Chunk,
        tensors: Mapping[str, torch.Tensor],
    ) -> Callable[[], None]:
        """What packs the chunk into ``slot`` (push path)."""
        dsts, srcs = self._pack_views(slot, pair, chunk, tensors)
        return self._program(pair, chunk, dsts, srcs)

    def _program(
        self, pair: _Pair, chunk: Chunk, dsts: list[torch.Tensor], srcs: list[torch.Tensor]
    ) -> Callable[[], None]:
        """What copies the chunk's sources into its slot views: a ``CopyProgram`` kept while
        the chunk's sources and slot stay (planned once: widened views, one gather for many
        small strided items such as row-parallel expert shards, where a copy each would be
        a kernel each on a GPU), or a one-off batched copy of the fresh bytes of a chain that
        copies."""
        plan = pair.views[chunk.index]
        if plan.copies:
            return partial(batched_copy, dsts, srcs)
        prog = plan.program
        if prog is None or prog[0] is not dsts or prog[1] is not srcs:
            prog = plan.program = (
                dsts,
                srcs,
                CopyProgram(dsts, srcs, graph=False, staging=pair.stage),
            )
        return prog[2].run

    def _pack_views(
        self,
        slot: torch.Tensor,
        pair: _Pair,
        chunk: Chunk,
        tensors: Mapping[str, torch.Tensor],
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(views into ``slot``, source views) of the chunk's items: packing copies one into
        the other."""
        plan = pair.views[chunk.index]
        if plan.dsts is None or plan.slot_ptr != slot.data_ptr():  # views per slot it lands in
            plan.slot_ptr = slot.data_ptr()
            plan.dsts = slot_views(slot, [pair.items[i] for i in chunk.items], chunk.offsets)
        return plan.dsts, self._sources(pair, chunk, tensors)

    def _sources(
        self, pair: _Pair, chunk: Chunk, tensors: Mapping[str, torch.Tensor]
    ) -> list[torch.Tensor]:
        """The chunk's source views; rebuilt only when a source tensor object changed. The
        very mapping of last time from ``open_group`` is the source's word that nothing in it
        moved: no look at any name."""
        plan = pair.views[chunk.index]
        if tensors is plan.mapping and plan.srcs is not None and not plan.copies:
            return plan.srcs
        plan.mapping = None  # until the views below are built
        objs = [tensors[n] for n in plan.names]
        ptrs = [t.data_ptr() for t in objs]  # a ``p.data = ...`` swap keeps the object
        if (
            plan.copies
            or plan.objs is None
            or not all(map(operator.is_, objs, plan.objs))
            or not all(map(operator.eq, ptrs, plan.ptrs))
        ):
            views = self._views
            plan.srcs = [views(t, c) for t, c in zip(objs, plan.prefixes, strict=True)]
            plan.objs = objs
            plan.ptrs = ptrs
            # a chain that copies (reshape of a non-contiguous view) gives fresh bytes each
            # sync: such views are rebuilt every time, never cached or read in place
            plan.copies = any(
                s.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
                for s, t in zip(plan.srcs, objs, strict=True)
            )
        assert plan.srcs is not None
        plan.mapping = tensors
        return plan.srcs


@dataclass(kw_only=True, slots=True)
class _PackPlan:
    """What packing one chunk needs, built at set-up; views are cached across syncs."""

    names: list[str]
    prefixes: list[OpChain]
    dsts: list[torch.Tensor] | None = None
    slot_ptr: int = 0  # where ``dsts`` point: a READ-path chunk may take another slot next sync
    objs: list[torch.Tensor] | None = None  # the source tensors ``srcs`` were built from
    srcs: list[torch.Tensor] | None = None
    ptrs: list[int] = field(default_factory=list)  # data pointers of ``objs``
    # (srcs, exposed name, byte offset, strides): the chunk is read in place
    # (``_exposed_source``)
    inplace: tuple[list[torch.Tensor], str, int, Any] | None = None
    copies: bool = False  # a prefix chain copies: ``srcs`` are fresh every sync
    # (dsts, srcs, the program that packs one into the other), while both stay
    program: tuple[list[torch.Tensor], list[torch.Tensor], CopyProgram] | None = None
    mapping: Mapping[str, torch.Tensor] | None = None  # the group ``srcs`` were taken from


def _pair_layout(layout: LayoutConfig, strided: bool) -> LayoutConfig:
    """The layout of a pair: with strided reads every item of at least 8 KiB (a norm of a
    hidden-4096 model) is a chunk of its own, read in place, so producers pack and
    synchronize their device for nothing but tiny items (below that, per-chunk bookkeeping of
    about 10 µs a side costs more than packing)."""
    if not strided or layout.direct_bytes <= STRIDED_DIRECT_BYTES:
        return layout
    return replace(layout, direct_bytes=STRIDED_DIRECT_BYTES)


def _storage_address(tensor: torch.Tensor) -> int | None:
    """The address of ``tensor``'s storage; None for a tensor without one of its own (a
    wrapper subclass, such as quantized weights)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except RuntimeError:
        return None


def _alone_in_storage(tensors: Iterable[torch.Tensor]) -> Callable[[torch.Tensor], bool]:
    """Whether a tensor of ``tensors`` is the only one of them in its storage, which may then
    move into an arena (a storage that holds several, a flat buffer or fused experts, is one
    home for them already); False for a tensor without a storage of its own."""
    homes = Counter(map(_storage_address, tensors))

    def alone(tensor: torch.Tensor) -> bool:
        at = _storage_address(tensor)
        return at is not None and homes[at] == 1

    return alone


def _home(view: torch.Tensor) -> tuple[int, int]:
    """(address, bytes) of the buffer a producer exposes to have ``view`` read in place: the
    ``share_storages`` arena its storage lies in (one exposure for every storage moved
    there), else its storage."""
    storage = view.untyped_storage()
    at = storage.data_ptr()
    arena = arena_range(at)
    return arena if arena is not None else (at, storage.nbytes())


def _snapshot(
    tensors: Mapping[str, torch.Tensor], names: list[str]
) -> tuple[list[torch.Tensor], list[int]]:
    objs = [tensors[n] for n in names]
    return objs, [t.data_ptr() for t in objs]


def _same_tensors(
    now: tuple[list[torch.Tensor], list[int]], seen: tuple[list[torch.Tensor], list[int]] | None
) -> bool:
    """Whether ``now`` holds the very objects of ``seen``, at the same addresses."""
    return now is seen or (
        seen is not None
        and now[1] == seen[1]
        and len(now[0]) == len(seen[0])
        and all(map(operator.is_, now[0], seen[0]))
    )


def _wire(req: Request) -> tuple[int, ...]:
    return req.shape if req.wire_shape is None else req.wire_shape


def _item_table(requests: list[Request]) -> list[tuple[torch.dtype, tuple[int, ...], int]]:
    """(wire dtype, wire shape, bytes) per request, computed once per distinct kind."""
    memo: dict[tuple[tuple[int, ...], str, tuple[int, ...] | None], Any] = {}
    out = []
    for r in requests:
        key = (r.shape, r.dtype, r.wire_shape)
        item = memo.get(key)
        if item is None:
            item = memo[key] = (dtype_from_str(r.dtype), _wire(r), r.nbytes)
        out.append(item)
    return out


def _shared_splits(requests: list[Request], part: int) -> list[OpChain]:
    """``split_for_wire(r.chain)[part]`` per request; one object per distinct chain object, so
    ``ViewCache`` (keyed on chain identity) sees a handful of chains, not one per name."""
    memo: dict[int, tuple[OpChain, OpChain]] = {}
    out = []
    for r in requests:
        hit = memo.get(id(r.chain))
        if hit is None:
            hit = memo[id(r.chain)] = (r.chain, split_for_wire(r.chain)[part])
        out.append(hit[1])
    return out


class _ShapeCache:
    """(final shape, wire shape) of a weight through a chain, from meta tensors, memoised.

    100,000 expert weights share a handful of (shape, dtype, chain) triples, so set-up replays
    each triple once. One per engine: no module-level state.
    """

    def __init__(self) -> None:
        self._memo: dict[tuple[int, tuple[int, ...], torch.dtype], Any] = {}

    def __call__(
        self, shape: tuple[int, ...], dtype: torch.dtype, chain: OpChain
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        key = (id(chain), tuple(shape), dtype)  # the memo keeps ``chain`` alive: ids stay unique
        hit = self._memo.get(key)
        if hit is None or hit[0] is not chain:
            probe = torch.empty(shape, dtype=dtype, device="meta")
            prefix, suffix = split_for_wire(chain)
            wire = replay(probe, prefix) if prefix else probe
            out = replay(wire, suffix) if suffix else wire
            hit = self._memo[key] = (chain, tuple(out.shape), tuple(wire.shape))
        return hit[1], hit[2]


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (what travels on the wire)."""
    return t.reshape(-1).view(torch.uint8)


class _Reposter:
    """Recorded reads posted through the plain one-sided API, for a communicator without
    ``prepare_reads``."""

    def __init__(
        self,
        one_sided: OneSidedCommunicator,
        strided_comm: StridedReadCommunicator | None,
        peer: int,
        plain: list[tuple[str, int, torch.Tensor]],
        strided: list[tuple[str, int, Any, torch.Tensor]],
    ) -> None:
        self._one, self._strided_comm, self._peer = one_sided, strided_comm, peer
        self._plain, self._strided = plain, strided

    def post(self) -> list[Any]:
        handles = []
        if self._plain:
            handles.append(self._one.read_batch_async(self._peer, self._plain))
        if self._strided:
            assert self._strided_comm is not None  # strided reads come from strided routes
            handles.append(self._strided_comm.read_strided_async(self._peer, self._strided))
        return handles

    def close(self) -> None:
        """Nothing to release."""


def _close(prepared: PreparedReadSet | CopyProgram | None) -> None:
    """Release a prepared set of reads or a copy program, if any."""
    if prepared is not None:
        prepared.close()


def _reworded(error: Exception, msg: str) -> Exception:
    """``error`` said as ``msg``: the same kind (a stall stays a ``TransferStallError``) where
    its type takes a message, caused by ``error``."""
    try:
        again = type(error)(msg)
    except Exception:  # noqa: BLE001 - an exception type with other arguments
        again = RuntimeError(msg)
    again.__cause__ = error
    return again


def _arrival(barrier: FreeBarrier, g: int) -> Callable[[Any], None]:
    return lambda _future: barrier.arrive(g)


def _send(
    comm: DeviceCommunicator,
    asynchronous: AsyncSendRecvCommunicator | None,
    tensor: torch.Tensor,
    peer: int,
    config: TransferConfig,
    what: str,
) -> None:
    """``comm.send``, bounded by the stall timeout where the communicator can post it
    (``isend``) and wait with a timeout. On CUDA the send is only queued on the stream (a host
    wait per transfer would serialize them); the stall bound there is the caller's
    ``wait_device`` at the end of the sync."""
    if asynchronous is None or tensor.device.type == "cuda":
        comm.send(tensor, peer)
    else:
        wait_or_stall(asynchronous.isend(tensor, peer), config.stall_timeout, what)


def _recv(
    comm: DeviceCommunicator,
    asynchronous: AsyncSendRecvCommunicator | None,
    tensor: torch.Tensor,
    peer: int,
    config: TransferConfig,
    what: str,
) -> None:
    """``comm.recv``, bounded like ``_send``."""
    if asynchronous is None or tensor.device.type == "cuda":
        comm.recv(tensor, peer)
    else:
        wait_or_stall(asynchronous.irecv(tensor, peer), config.stall_timeout, what)


class WeightConsumer(_Engine):
    """Receives this consumer's shard of every weight into its own parameters.

    Args:
        coordinator: an initialized coordinator over the fleet.
        communicator: a communicator over the same group.
        fleet: the producer and consumer ranks; this worker must be a consumer.
        params: this consumer's parameters by name (written in place by every sync).
        route: ``route(name)`` -> ``[(param name, loader), ...]`` for each model weight; an
            empty result means this consumer does not need the weight.
        config: the deployment settings (must equal the producers').
    """

    def __init__(
        self,
        coordinator: WorkerCoordinator,
        communicator: DeviceCommunicator,
        *,
        fleet: Fleet,
        params: Mapping[str, torch.Tensor],
        route: Route,
        config: TransferConfig | None = None,
    ) -> None:
        super().__init__(coordinator, communicator, fleet, config or TransferConfig())
        rank = coordinator.get_rank()
        if rank not in fleet.consumer_ranks:
            raise ValueError(f"rank {rank} is not a consumer of {fleet}")
        self.consumer_id = fleet.consumer_ranks.index(rank)
        self.params = params
        self.route = route
        self.chunks: list[Chunk] = []
        self.requests: list[Request] = []
        self._dests: list[torch.Tensor] = []
        self._unpack_views: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self._unpack_programs: dict[int, CopyProgram] = {}  # by chunk index
        self._broken = ""  # push path: why a sync failed mid-transfer (no sync after it)
        self.bake_seconds = 0.0
        self.gathered_bytes = 0  # gather_cpu_params: parameter bytes moved into an arena
        want = self.config.strided_reads
        strided_comm = communicator if isinstance(communicator, StridedReadCommunicator) else None
        capable = self._read and strided_comm is not None
        if want and not capable:
            raise ValueError(
                "TransferConfig(strided_reads=True) needs the one-sided READ path with a "
                f"communicator that reads strided views (read_strided_async); "
                f"{type(communicator).__name__} on the {self.path!r} path has none: leave "
                "strided_reads=None (auto) or use NIXL_RDT"
            )
        self._strided = capable and (
            want is True
            or (want is None and strided_comm is not None and strided_comm.maps_peer_memory)
        )
        self.layout = _pair_layout(self.layout, self._strided)
        # strided reads on a mapping of the producers' memory (a strided view costs its bytes)
        self._maps = (
            self._strided and strided_comm is not None and bool(strided_comm.maps_peer_memory)
        )
        self._strided_comm: StridedReadCommunicator  # set where strided reads are used
        if self._strided and strided_comm is not None:
            self._strided_comm = strided_comm
        self._preparer: PreparedReadCommunicator | None = (
            communicator if isinstance(communicator, PreparedReadCommunicator) else None
        )
        self._map_packs = self._strided and self.config.mapped_unpack
        # chunk index -> ((source, offset, strides) it was last read from, how): see ``_route``
        self._routes: dict[int, tuple[Any, tuple[str, int, Any, torch.Tensor, bool]]] = {}
        # chunk index -> (where it was announced, its items' strided reads from there or None,
        # those reads prepared, whether they land in staging): see ``_gather``
        self._gathers: dict[int, tuple[Any, list[Any] | None, Any, bool]] = {}
        # READ path, this sync: the record being made per producer, the replays whose reads
        # are in flight (producer -> handles), the producers whose message was a replay
        self._recording: dict[int, _Replay] = {}
        self._replaying: dict[int, list[Any]] = {}
        self._replayed_from: set[int] = set()
        self._heard: set[int] = set()  # producers whose first message this sync came
        # READ path, this sync: producer -> the seq of its last 'done' (while not sent yet),
        # and when each producer last heard from this consumer (``_keep_alive``)
        self._owed: dict[int, int] = {}
        self._last_word: dict[int, float] = {}

    # -- set-up --------------------------------------------------------------------------------
    @_gc_paused
    def setup(self, *, defer: bool = False) -> None:
        """Bake, plan and reserve; raises on any rank's refusal (see module docstring).

        ``defer``: take part in the fleet's set-up without a plan (the engine is not ready
        yet); producers serve this consumer nothing until it calls ``join()``.
        """
        start = self._phase_start = time.perf_counter()
        index = self._index(None)
        self._phase("index")
        if defer:
            self._send_plans(index, None, deferred=True)
            _gather_verdicts(self.coordinator, None)
            if self._read:
                self._one.exchange_exposed()
            self.setup_seconds = time.perf_counter() - start
            return
        error = self._prepare(index)
        self._send_plans(index, error)
        self._phase("send plans")
        _gather_verdicts(self.coordinator, error)
        self._phase("verdicts")
        self._gather_params()  # while the producers move their own weights
        self._make_rings()
        if self._read:
            self._connect_read()
        self._phase("rings")
        self.setup_seconds = time.perf_counter() - start

    @_gc_paused
    def join(self) -> None:
        """Join the fleet between syncs, while every producer calls ``admit(consumer_id)``.

        For a consumer that deferred set-up or a restarted one (a new engine, e.g. after the
        inference worker reloaded its model): the producers' facts come from producer 0, the
        plan is checked like at set-up, and only this consumer and the producers take part.
        Raises ``WeightTransferSetupError`` (or this rank's own error) when any side refused.
        """
        start = self._phase_start = time.perf_counter()
        prods = self.fleet.producer_ranks
        hello = [self.coordinator.recv_object(r) for r in prods]
        for p, msg in enumerate(hello):
            if not (isinstance(msg, AdmitMessage) and msg.producer_id == p):
                raise RuntimeError(f"expected admit() from producer {p}, got {msg!r:.80}")
        self._syncs = hello[0].syncs
        facts = hello[0].facts
        if facts is None:
            raise RuntimeError("admit() from producer 0 came without the producers' facts")
        index = self._build_index(facts)
        self._phase("index")
        error = self._prepare(index)
        self._send_plans(index, error)
        verdicts = [self.coordinator.recv_object(r) for r in prods]
        refused = [f"producer {p}: {v}" for p, v in enumerate(verdicts) if v is not None]
        verdict = (
            f"consumer {self.consumer_id}: {type(error).__name__}: {error}"
            if error is not None
            else ("; ".join(refused) or None)
        )
        for r in prods:
            self.coordinator.send_object(verdict, r)
        if error is not None:
            raise error
        if verdict is not None:
            raise WeightTransferSetupError(f"join refused: {verdict}")
        self._phase("verdicts")
        self._gather_params()
        self._make_rings()
        if self._read:
            for pair in self._pairs.values():
                desc = self.coordinator.recv_object(pair.peer_rank)
                self._one.import_exposed(desc)
                pair.remote_name = desc.name
            self._pin_destinations()
        self._phase("rings")
        self.setup_seconds = time.perf_counter() - start

    def _prepare(self, index: ModelIndex) -> BaseException | None:
        """Bake and plan; returns the error instead of raising (the fleet must hear of it)."""
        try:
            self.requests, dests = self._bake(index)
            self.bake_seconds = self._phase("bake")
            self._dests = [self._dest_view(name, chain) for name, chain in dests]
            self._dest_params = [name for name, _ in dests]
            self._phase("destination views")
            self.chunks = self._plan(index)
            self._phase("plan")
        except Exception as exc:  # reported to the fleet by the caller
            return exc
        return None

    def _plan(self, index: ModelIndex) -> list[Chunk]:
        """``build_chunks`` over the index's per-name arrays (a name it lacks: group 0,
        class 0, as the router resolves it; the producer then refuses it)."""
        names = [r.name for r in self.requests]
        pos = np.fromiter((index.position.get(n, -1) for n in names), np.int64, len(names))
        known = pos >= 0
        groups = np.where(known, index.group_ids[np.maximum(pos, 0)], 0) if len(pos) else pos
        classes = np.where(known, index.class_ids[np.maximum(pos, 0)], 0) if len(pos) else pos
        producers = np.asarray(
            [
                index.router.producer_for_group(self.consumer_id, g, k)
                for g, k in zip(groups.tolist(), classes.tolist(), strict=True)
            ],
            dtype=np.int64,
        )
        sizes = item_sizes(self.requests)
        kinds = request_kinds(self.requests)
        return cut_chunks(groups, classes, producers, sizes, self.layout, kinds=kinds)

    def _gather_params(self) -> None:
        """``TransferConfig.gather_cpu_params``: after the plan is agreed, before any
        destination address is recorded. Moving only makes copies faster: where an arena's
        memory is not there, its parameters stay (with a warning; those before it have moved)
        and set-up goes on."""
        if not (self.config.gather_cpu_params and self.communicator.device.type == "cpu"):
            return
        if not hasattr(torch.UntypedStorage, "_swap_data_ptr_"):
            return  # re-pointed tensors would leave the destination views made above behind
        alone = _alone_in_storage(self.params.values())
        order: dict[int, torch.Tensor] = {}  # in chunk order, each parameter once
        for chunk in self.chunks:
            if len(chunk.items) < 2:
                continue
            for i in chunk.items:
                param = self.params[self._dest_params[i]]
                if param.is_cpu and alone(param):
                    order.setdefault(id(param), param)
        if not order:
            return
        try:
            # an arena at a time: at most DEVICE_ARENA_BYTES are held twice while they move
            self.gathered_bytes = gather_device_storages(
                list(order.values()), max_bytes=DEVICE_ARENA_BYTES, device="cpu"
            )
        except (MemoryError, RuntimeError) as exc:
            warnings.warn(
                f"consumer {self.consumer_id}: parameters left where they are ({exc}); set "
                "TransferConfig(gather_cpu_params=False) to skip trying",
                RuntimeWarning,
                stacklevel=2,
            )
        self._phase("gather parameters")

    def _connect_read(self) -> None:
        """Learn the producers' rings (collective with ``_expose_rings``); pin local buffers.

        Staging slots and the parameters that direct chunks land in are exposed (registered)
        once here, so no sync pays for registering memory; peers never learn of them.
        """
        self._one.exchange_exposed()
        for p, pair in self._pairs.items():
            pair.remote_name = ring_name(p, self.consumer_id)
        self._pin_destinations()

    def _pin_destinations(self) -> None:
        for p, pair in self._pairs.items():
            assert pair.ring is not None
            self._expose(pair.ring.buffer, f"wt-stage-c{self.consumer_id}-p{p}")
        pinned: set[int] = set()
        for i, direct in enumerate(self._direct):
            if len(pinned) >= MAX_PINNED:
                break
            if direct is None and not (self._strided and len(self.chunks[i].items) == 1):
                continue  # strided reads may land in place: their copies are cached if pinned
            param = self.params[self._dest_params[self.chunks[i].items[0]]].data
            key = param.untyped_storage().data_ptr()
            if key not in pinned and param.is_contiguous():
                pinned.add(key)
                self._expose(param, f"wt-dest-c{self.consumer_id}-{len(pinned)}")

    def _bake(self, index: ModelIndex) -> tuple[list[Request], list[tuple[str, Any]]]:
        """Run the loader of every needed weight on fakes; the requests and their destinations.

        Loaders that bake alike (``loader_key``) on the same shapes are baked once and their
        recorded copies shared, chain objects included (``ViewCache`` keys on them).
        """
        requests: list[Request] = []
        dests: list[tuple[str, Any]] = []
        metas: dict[Any, torch.Tensor] = {}
        baked: dict[Any, list[tuple[Copy, tuple[int, ...]]]] = {}
        for name in index.names:
            meta = index.meta[name]
            for param_name, loader in self.route(name):
                dest = self.params.get(param_name)
                if dest is None:
                    raise KeyError(f"route({name!r}) names parameter {param_name!r}, not in params")
                lkey = loader_key(loader)
                key = (
                    None if lkey is None else (meta.shape, meta.dtype, dest.shape, dest.dtype, lkey)
                )
                copies = None if key is None else baked.get(key)
                if copies is None:
                    copies = self._bake_one(loader, meta, dest, name, metas)
                    if key is not None:
                        baked[key] = copies
                for copy, wire in copies:
                    requests.append(Request(name, copy.src_chain, copy.shape, meta.dtype, wire))
                    dests.append((param_name, copy.dest_chain))
        return requests, dests

    def _bake_one(
        self, loader: Loader, meta: Any, dest: torch.Tensor, name: str, metas: dict[Any, Any]
    ) -> list[tuple[Copy, tuple[int, ...]]]:
        dtype = meta.torch_dtype
        return [
            (copy, self._shapes(meta.shape, dtype, copy.src_chain)[1])
            for copy in bake(loader, meta.shape, dtype, dest, name, metas)
        ]

    def _dest_view(self, param_name: str, chain: Any) -> torch.Tensor:
        param = self.params[param_name].data
        if not chain:
            return param
        if self._views.geometry(tuple(param.shape), param.stride(), param.dtype, chain) is None:
            raise UnsafeOpError(
                f"the loader's destination view of {param_name!r} ({chain!r}) is a copy, so "
                "copy_ into it would not reach the parameter; avoid contiguous()/reshape on "
                "non-contiguous destination views"
            )
        return self._views(param, chain)

    def _send_plans(
        self, index: ModelIndex, error: BaseException | None, *, deferred: bool = False
    ) -> None:
        router = index.router
        router.bind(
            actors=list(self.fleet.producer_ranks),
            produce_methods=[self._control(r) for r in self.fleet.producer_ranks],
            consumer_id=self.consumer_id,
        )
        digests: dict[int, str] = {}
        reserve: dict[int, int] = {}
        for p, prank in enumerate(self.fleet.producer_ranks):
            if error is not None or deferred:
                payload: Any = f"consumer {self.consumer_id} " + (
                    "deferred set-up" if deferred else "failed set-up"
                )
            else:
                payload = encode_requests(
                    [self.requests[i] for c in self.chunks if c.producer == p for i in c.items]
                )
                digests[p] = plan_digest(
                    self.consumer_id, p, self.chunks, payload, router, self.layout
                )
            plan = PlanMessage(self.consumer_id, payload, self.path, self._strided, self._maps)
            self.coordinator.send_object(plan, prank)
            reserve[p] = slot_bytes(self.chunks, p, self.layout.align) * self.layout.ring_slots
        router.reserve_serve_buffers(reserve, digests)

    def _control(self, rank: int) -> Callable[..., None]:
        def send(verb: str, consumer_id: int, *args: Any) -> None:
            if verb != "reserve":
                raise RuntimeError(f"the engine's producers take no {verb!r} request")
            self.coordinator.send_object(ReserveMessage(consumer_id, *args), rank)

        return send

    def _make_rings(self) -> None:
        for p, prank in enumerate(self.fleet.producer_ranks):
            chunks = [c for c in self.chunks if c.producer == p]
            if not chunks:
                continue
            slot = slot_bytes(chunks, p, self.layout.align)
            # push: one staging slot per producer (its receiver thread unpacks every chunk
            # before the next recv); READ: K, reads run ahead of unpacks
            k = self.layout.ring_slots if self._read else 1
            buf = torch.empty(slot * k, dtype=torch.uint8, device=self.communicator.device)
            self._pairs[p] = _Pair(
                peer_rank=prank,
                chunks=chunks,
                requests=self.requests,
                slot_bytes=slot,
                ring=ServeRing(buf, k, slot),
                worker=SerialWorker(f"wt-recv-p{p}") if self._threads else None,
                last_seq=max(c.seq for c in chunks),
            )
        self._items = _item_table(self.requests)
        self._suffixes = _shared_splits(self.requests, 1)
        self._direct = [self._direct_dest(c) for c in self.chunks]
        self._announced_as: list[Any] = [None] * len(self.chunks)  # this sync's announcements
        self._targets: list[torch.Tensor | None] = [None] * len(self.chunks)
        k = self.layout.ring_slots
        # staging slot per chunk: READ, round robin over the chunks that may need staging (a
        # direct chunk never does); push, the producer's one slot
        staging: dict[int, int] = {}
        self._stage_slot: list[int] = []
        for c, direct in zip(self.chunks, self._direct, strict=True):
            if not self._read:
                self._stage_slot.append(0)
            elif direct is None:
                self._stage_slot.append(staging.get(c.producer, 0) % k)
                staging[c.producer] = staging.get(c.producer, 0) + 1
            else:
                self._stage_slot.append(-1)

    # -- sync ----------------------------------------------------------------------------------
    @_gc_paused
    def sync(self) -> SyncStats:
        """Receive one version of the weights into ``params``; returns this rank's stats."""
        start = time.perf_counter()
        if self.trace is not None:
            self.trace.clear()
        self._mark("sync")
        self._syncs += 1
        self._packed = 0
        self._replayed = False
        if self._read:
            self._receive_read()
        else:
            if self._broken:
                raise RuntimeError(
                    f"consumer {self.consumer_id}: an earlier sync failed mid-transfer "
                    f"({self._broken}); receives it posted may still be pending, so this "
                    "consumer cannot tell its producers' messages apart any more: restart it "
                    "(a new WeightConsumer calling join(), with admit() on the producers)"
                )
            try:
                self._receive_push()
            except BaseException as exc:
                self._broken = f"{type(exc).__name__}: {exc}"
                raise
        return SyncStats(
            seconds=time.perf_counter() - start,
            bytes=sum(c.nbytes for c in self.chunks),
            chunks=len(self.chunks),
            path=self.path,
            packed=self._packed,
            replayed=self._replayed,
        )

    def _receive_push(self) -> None:
        """Each producer's receiver thread takes that producer's chunks of the sync in order
        (``_receive_from``); this thread only waits for them, chunk by chunk. Without push
        threads this thread receives every chunk itself, in plan order."""
        timeout = self.config.stall_timeout
        if not self._threads:  # in plan order (the fleet order) from this thread
            for j, chunk in enumerate(self.chunks):
                target = self._target(j)
                peer = self._pairs[chunk.producer].peer_rank
                what = (
                    f"consumer {self.consumer_id} <- producer {chunk.producer} (chunk {chunk.seq})"
                )
                _recv(self.communicator, self._async, target, peer, self.config, what)
                if self._direct[j] is None:  # behind the recv: a blocking one, or on its stream
                    self._unpacker(j)()
            self._packed = sum(d is None for d in self._direct)
            self._send_receipts()
            wait_device(self.communicator.device, timeout, f"consumer {self.consumer_id}")
            return
        failed = threading.Event()
        done: list[Future[None]] = [Future() for _ in self.chunks]
        for p, pair in self._pairs.items():
            assert pair.worker is not None
            mine = [j for j, c in enumerate(self.chunks) if c.producer == p]
            pair.worker.submit(partial(self._receive_from, pair, mine, done, failed))
        try:
            for chunk, future in zip(self.chunks, done, strict=True):
                what = (
                    f"consumer {self.consumer_id} <- producer {chunk.producer} (chunk {chunk.seq})"
                )
                wait_or_stall(Waitable(future), timeout, what)
        except BaseException:
            failed.set()  # what is still queued gives up instead of taking the next sync's bytes
            raise
        self._packed = sum(d is None for d in self._direct)
        self._send_receipts()
        wait_device(self.communicator.device, timeout, f"consumer {self.consumer_id}")

    def _send_receipts(self) -> None:
        """Tell each producer of this sync's chunks that they are in place (the sync's number,
        which ``join`` took from the producers), in producer order; on a stream, behind the
        last unpack."""
        device = self.communicator.device
        for p in sorted({c.producer for c in self.chunks}):
            pair = self._pairs[p]
            receipt = pair.receipt_buffer(device)
            receipt.fill_(self._syncs)
            what = f"consumer {self.consumer_id} -> producer {p} (receipt of sync {self._syncs})"
            _send(self.communicator, self._async, receipt, pair.peer_rank, self.config, what)

    def _receive_from(
        self, pair: _Pair, chunks: list[int], done: list[Future[None]], failed: threading.Event
    ) -> None:
        """Receive one producer's chunks in order, unpacking each staged one straight after it
        lands, on this (the pair's receiver) thread: no recv waits for another thread to wake
        up and unpack. A communicator with ``irecv`` gets up to ``RECV_AHEAD`` receives posted
        ahead (a staged chunk once the one before it left the pair's staging slot), so the
        producer's sends never wait for a receive to be posted."""
        comm, peer, timeout = self.communicator, pair.peer_rank, self.config.stall_timeout
        irecv = None if self._async is None else self._async.irecv
        ahead = RECV_AHEAD if irecv is not None else 1
        posted: deque[tuple[int, Any]] = deque()
        staged = 0  # staged chunks among the posted ones (at most one: one staging slot)

        def finish() -> None:
            nonlocal staged
            j, handle = posted.popleft()
            if handle is not None:
                what = f"consumer {self.consumer_id} <- producer {self.chunks[j].producer}"
                wait_or_stall(handle, timeout, f"{what} (chunk {self.chunks[j].seq})")
            if failed.is_set():  # the bytes may be another chunk's: never unpack them
                raise RuntimeError("an earlier chunk of this sync failed")
            if self._direct[j] is None:
                self._unpacker(j)()
                staged -= 1
            done[j].set_result(None)

        try:
            for j in chunks:
                if failed.is_set():
                    raise RuntimeError("an earlier chunk of this sync failed")
                is_staged = self._direct[j] is None
                while posted and (len(posted) >= ahead or (is_staged and staged)):
                    finish()
                target = self._target(j)
                if irecv is None:
                    comm.recv(target, peer)
                    posted.append((j, None))
                else:
                    posted.append((j, irecv(target, peer)))
                staged += is_staged
            while posted:
                finish()
        except BaseException as exc:
            failed.set()
            for j in chunks:
                if not done[j].done():
                    done[j].set_exception(exc)
            raise

    def _receive_read(self) -> None:
        """Pull every announced chunk in one batched read per producer, up to
        ``BATCHES_IN_FLIGHT`` batches at once; complete batches in plan order (one unpack
        launch, then 'done up to seq' per producer).

        Messages are taken in plan order whatever they say, as on a sync read chunk by chunk:
        a producer's replay message starts its recorded reads there and then (its chunks are
        skipped below), and a replay finishes — unpack, 'done' — as soon as its reads have
        landed, or before this consumer waits on any producer, so that no replayed producer
        waits on us while we wait on another one.
        """
        comm = self.communicator
        inbox: dict[int, deque[Any]] = {p: deque() for p in self._pairs}
        self._recording = {p: _Replay() for p, pair in self._pairs.items() if pair.chunks}
        self._replaying = {}
        self._replayed_from = set()
        self._heard = set()
        flight: deque[tuple[list[int], list[Any]]] = deque()  # (chunk indices, read handles)
        staged: set[tuple[int, int]] = set()  # (producer, staging slot) holding unread bytes
        finished: dict[int, int] = {}  # producer -> last seq read, not yet reported
        # producer -> the seq of its last 'done' this sync, and when it last heard from us
        self._owed = {p: pair.last_seq for p, pair in self._pairs.items() if pair.chunks}
        self._last_word = dict.fromkeys(self._owed, time.monotonic())
        nxt, n = 0, len(self.chunks)
        while nxt < n or flight:
            self._keep_alive()
            batch: list[int] = []
            announcements: list[Any] = []
            while nxt < n and len(flight) < BATCHES_IN_FLIGHT:
                chunk = self.chunks[nxt]
                if chunk.producer in self._replayed_from:
                    nxt += 1  # read as a whole
                    continue
                block = not flight and not batch
                if not self._announced(chunk, inbox, block=block):
                    break
                if chunk.producer in self._replayed_from:
                    continue  # its message was a replay
                slot = (chunk.producer, self._stage_slot[nxt])
                if self._staged(nxt, inbox[chunk.producer][0]):
                    if slot in staged:
                        break  # that staging slot's bytes are not unpacked yet
                    staged.add(slot)
                announcements.append(inbox[chunk.producer].popleft())
                batch.append(nxt)
                nxt += 1
            if batch:
                self._mark(f"pull x{len(batch)}")
                flight.append((batch, self._pull(batch, announcements)))
            if flight:
                self._complete(flight, staged, finished)
            self._finish_replays(block=False)
        self._report(finished)
        self._finish_replays(block=True)
        device_synchronize(comm.device)
        self._replayed = bool(self._recording) and self._replayed_from == set(self._recording)
        for p, rec in self._recording.items():
            pair = self._pairs[p]
            if p in self._replayed_from:
                continue  # its record stays (and was replayed)
            if pair.replay is not None:
                pair.replay.close()
            rec.last_seq = pair.last_seq
            rec.sync = self._syncs if rec.ok else -1
            pair.replay = rec
        self._mark("end")

    def _start_replay(self, p: int, msg: Replay, what: str) -> bool:
        """Post producer ``p``'s recorded reads if ``msg`` is a replay of a sync recorded here
        (the last one); False when it is not (then it is read chunk by chunk)."""
        pair = self._pairs[p]
        rec = pair.replay
        if rec is None or rec.sync != self._syncs - 1:
            return False
        self._check_replay(msg, what)
        if rec.prepared is None:
            rec.prepared = self._merged_reads(pair.peer_rank, rec)
        if rec.prepared is None:
            rec.prepared = self._prepare_reads(pair.peer_rank, rec)
        self._mark(f"replay {pair.peer_rank}")
        posted = rec.prepared.post()
        self._replaying[p] = posted if isinstance(posted, list) else [posted]
        self._replayed_from.add(p)
        return True

    def _merged_reads(self, peer: int, rec: _Replay) -> Any:
        """The recorded reads as the chunks' own prepared sets merged (nothing planned again;
        ``merge_prepared``), where those sets are all of them; else None."""
        if self._preparer is None or rec.plain or not rec.sets or rec.gathered != len(rec.strided):
            return None
        return self._preparer.merge_prepared(peer, rec.sets)

    def _prepare_reads(self, peer: int, rec: _Replay) -> Any:
        if self._preparer is not None:
            return self._preparer.prepare_reads(peer, rec.plain, rec.strided)
        strided_comm = self._strided_comm if self._strided else None
        return _Reposter(self._one, strided_comm, peer, rec.plain, rec.strided)

    def _finish_replays(self, *, block: bool) -> None:
        """Finish the replays whose reads have landed (every one when ``block``, waiting):
        unpack what was staged, tell the producer."""
        for p in list(self._replaying):
            handles = self._replaying[p]
            if not block and not all(h.done() for h in handles):
                continue
            del self._replaying[p]
            pair = self._pairs[p]
            rec = pair.replay
            assert rec is not None
            what = f"consumer {self.consumer_id}: replayed reads from producer {p}"
            for handle in handles:
                wait_read(handle, self.config.stall_timeout, what)
            self._mark("read done")
            if rec.programs:
                if rec.unpack is None:
                    rec.unpack = CopyProgram.merged(rec.programs)
                rec.unpack.run()
                self._packed += rec.packs
            self._tell_done(p, rec.last_seq)
            rec.sync = self._syncs

    def _check_replay(self, msg: Replay, what: str) -> None:
        if msg.sync != self._syncs:
            raise RuntimeError(f"{what}: replay message for sync {msg.sync}")

    def _take_message(self, p: int, msg: bytes, inbox: dict[int, deque[Any]], what: str) -> None:
        """Queue the announcements of producer ``p``'s message. A replay message starts the
        recorded reads when this consumer has a record of the last sync; otherwise it stands
        for the last sync's announcements (this consumer kept them), read chunk by chunk."""
        self._heard.add(p)
        message = self._codec.decode(msg, what)
        if isinstance(message, Replay):
            if self._start_replay(p, message, what):
                return
            self._check_replay(message, what)
            anns = [self._announced_as[c.index] for c in self._pairs[p].chunks]
            if any(a is None for a in anns):
                raise RuntimeError(f"{what}: a replay, but no earlier sync was read in full here")
            inbox[p].extend(
                Announcement(self._syncs, a.seq, a.offset, a.nbytes, a.source, a.strides)
                for a in anns
                if a is not None
            )
            return
        announced = message.announcements
        if any(a.new_source for a in announced):  # sources exposed for us: addressable now
            for desc in self.coordinator.recv_object(self._pairs[p].peer_rank):
                self._one.import_exposed(desc)
        inbox[p].extend(announced)

    def _announced(self, chunk: Chunk, inbox: dict[int, deque[Any]], *, block: bool) -> bool:
        """Whether ``chunk``'s announcement is in the inbox, fetching messages (waiting for
        one when ``block``), or its producer's message was a replay."""
        queue = inbox[chunk.producer]
        while not queue and chunk.producer not in self._replayed_from:
            pair = self._pairs[chunk.producer]
            what = f"consumer {self.consumer_id} <- producer {chunk.producer} (chunk {chunk.seq})"
            if block:
                self._mark(f"wait ready {pair.peer_rank}")
                msg: bytes | None = self._await_message(chunk.producer, inbox, what)
                self._mark("got ready")
            else:
                msg = poll_message(self._one, pair.peer_rank)
                if msg is None:
                    return False
            assert msg is not None
            self._take_message(chunk.producer, msg, inbox, what)
        return True

    def _await_message(self, p: int, inbox: dict[int, deque[Any]], what: str) -> bytes:
        """Producer ``p``'s next message. While it does not come, the first message of every
        producer not heard from yet is taken as it arrives (a replay starts its reads) and
        replays whose reads landed are finished: a producer that replays never waits on
        this consumer for longer than its reads take, whatever the others do."""
        peer = self._pairs[p].peer_rank
        others = [q for q in self._pairs if q != p and q not in self._heard]
        stall = self.config.stall_timeout
        deadline = time.monotonic() + stall
        if not others and not self._replaying:
            while len(self._owed) > 1:  # wait in slices, telling the others we are alive
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                try:
                    wait = min(left, stall / 4)
                    return bytes(self._one.wait_notification(peer, wait))
                except TimeoutError:
                    self._keep_alive()
            left = deadline - time.monotonic()
            return wait_message(self._one, peer, left, what, stall)
        pause = 10e-6
        while True:
            self._keep_alive()
            msg = poll_message(self._one, peer)
            if msg is not None:
                return msg
            for q in others:
                if q not in self._heard:
                    first = poll_message(self._one, self._pairs[q].peer_rank)
                    if first is not None:
                        self._take_message(q, first, inbox, f"{what}; from producer {q}")
            self._finish_replays(block=False)
            if time.monotonic() > deadline:
                return wait_message(self._one, peer, 0.0, what, stall)  # the stall error
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)

    def _pull(self, batch: list[int], announcements: list[Any]) -> list[Any]:
        """Start one read per producer over the batch's chunks; returns the handles."""
        by_producer: dict[int, list[tuple[str, int, torch.Tensor]]] = {}
        strided: dict[int, list[tuple[str, int, Any, torch.Tensor]]] = {}
        handles: list[Any] = []
        for j, ann in zip(batch, announcements, strict=True):
            self._announced_as[j] = ann
            sync, seq, offset, nbytes, source = (
                ann.sync,
                ann.seq,
                ann.offset,
                ann.nbytes,
                ann.source,
            )
            chunk = self.chunks[j]
            if (sync, seq, nbytes) != (self._syncs, chunk.seq, chunk.nbytes):
                raise RuntimeError(
                    f"consumer {self.consumer_id} <- producer {chunk.producer}: announced "
                    f"(sync, seq, nbytes) {(sync, seq, nbytes)}, expected "
                    f"{(self._syncs, chunk.seq, chunk.nbytes)}"
                )
            rec = self._recording[chunk.producer]
            gather = self._gather(j, ann)
            if gather is not None:
                prepared = self._gathers[j][2]
                posted = prepared.post()
                handles += posted if isinstance(posted, list) else [posted]
                rec.strided += gather
                rec.sets.append(prepared)
                rec.gathered += len(gather)
                continue
            route = self._route(j, ann)
            if route is not None:
                strided.setdefault(chunk.producer, []).append(route[:4])
                rec.strided.append(route[:4])
                continue
            remote = self._pairs[chunk.producer].remote_name if source is None else source
            request = (remote, offset, self._target(j))
            by_producer.setdefault(chunk.producer, []).append(request)
            rec.plain.append(request)
        handles += [
            self._one.read_batch_async(self._pairs[p].peer_rank, requests)
            for p, requests in by_producer.items()
        ]
        handles += [
            self._strided_comm.read_strided_async(self._pairs[p].peer_rank, requests)
            for p, requests in strided.items()
        ]
        return handles

    def _staged(self, j: int, ann: Announcement) -> bool:
        """Whether chunk ``j``, announced as ``ann``, lands in its staging slot (then unpacks)."""
        if self._gather(j, ann) is not None:
            return self._gathers[j][3]
        route = self._route(j, ann)
        return self._direct[j] is None if route is None else not route[4]

    def _route(self, j: int, ann: Announcement) -> tuple[str, int, Any, torch.Tensor, bool] | None:
        """A strided read for chunk ``j`` read in place: (source, byte offset, strides, local,
        lands in the parameter). None: a plain byte read (packed bytes, or contiguous bytes
        into a contiguous parameter, or no strided reads here).

        With a mapping of the producer's memory the read goes through the consumer's own
        re-layout (transpose) straight into the parameter when that is a view of the same
        dtype; otherwise it lands, as the wire bytes, in the chunk's staging slot.
        """
        source, strides = ann.source, ann.strides
        if source is None or not (
            strides is not None or (self._strided and self._direct[j] is None)
        ):
            return None
        key = (source, ann.offset, strides)
        hit = self._routes.get(j)
        if hit is not None and hit[0] == key:
            return hit[1]
        chunk = self.chunks[j]
        i = chunk.items[0]
        dtype, wire, nbytes = self._items[i]
        wire_strides = strides if strides is not None else _contiguous_strides(wire)
        offset = ann.offset
        view = None
        peer = self._pairs[chunk.producer].peer_rank
        if self._strided_comm.maps_exposed(peer, source):
            view = self._param_view(i, wire_strides)
        if view is not None:
            route = (source, offset + view[0], view[1], self._dests[i], True)
        else:
            staging = self._target(j)[:nbytes].view(dtype).view(wire)
            route = (source, offset, wire_strides, staging, self._direct[j] is not None)
        self._routes[j] = (key, route)
        return route

    def _param_view(self, i: int, wire_strides: tuple[int, ...]) -> tuple[int, Any] | None:
        """(byte offset from the start of item ``i``'s wire bytes, strides) of its parameter
        view laid over those bytes at ``wire_strides``: where the consumer's re-layout
        (narrow, transpose) is a view of them with the parameter's shape and dtype, so one
        strided read lands them in place. None for a loader that copies or casts."""
        dtype, wire, _ = self._items[i]
        dest = self._dests[i]
        if dest.dtype != dtype:
            return None
        geo = self._views.geometry(wire, wire_strides, dtype, self._suffixes[i])
        if geo is None or geo[0] != tuple(dest.shape):
            return None
        _size, strides, delta = geo
        return delta * dest.element_size(), strides

    def _gather(self, j: int, ann: Announcement) -> list[tuple[str, int, Any, torch.Tensor]] | None:
        """The strided reads that take chunk ``j``, announced as ``ann``, item by item: from
        the producer's ring slot straight into the parameters (a packed chunk,
        ``mapped_unpack``: where this consumer maps that ring and every item's re-layout is a
        view of its wire bytes with the parameter's shape and dtype), or from the trainer's
        flat buffer (a chunk read in place item by item, ``SPREAD``: into the parameters
        likewise, else into the staging slot as wire bytes, unpacked from there). None: the
        chunk is one read (then unpacked where it is staged).

        Built (and prepared as one set of reads) once per place the chunk is announced at."""
        spread = ann.offset == SPREAD
        if not spread and (
            ann.source is not None or not self._map_packs or self._direct[j] is not None
        ):
            return None  # read in place, or contiguous bytes read straight into the parameter
        pair = self._pairs[self.chunks[j].producer]
        key: tuple[Any, Any] = (
            (ann.source, ann.strides) if spread else (pair.remote_name, ann.offset)
        )
        hit = self._gathers.get(j)
        if hit is not None and hit[0] == key:
            return hit[1]
        if hit is not None:  # dropped before it is closed: a failed rebuild leaves nothing
            del self._gathers[j]
            _close(hit[2])
        chunk = self.chunks[j]
        if spread:
            source, items = key
        else:
            source = key[0]
            items = [
                (key[1] + off, _contiguous_strides(self._items[i][1]))
                for i, off in zip(chunk.items, chunk.offsets, strict=True)
            ]
        routes: list[Any] | None = None
        if self._strided_comm.maps_exposed(pair.peer_rank, source):
            routes = []
            for i, (off, strides) in zip(chunk.items, items, strict=True):
                view = self._param_view(i, strides)
                if view is None:
                    routes = None  # a loader that copies or casts: unpacked from staging
                    break
                routes.append((source, off + view[0], view[1], self._dests[i]))
        staged = routes is None and spread
        if staged:  # the wire bytes into the staging slot, each item at its packed place
            wires = slot_views(
                self._target(j), [self._items[i] for i in chunk.items], chunk.offsets
            )
            routes = [(source, off, st, w) for (off, st), w in zip(items, wires, strict=True)]
        prepared = None
        if routes is not None:
            prepared = self._prepare_reads(pair.peer_rank, _Replay(strided=routes))
        self._gathers[j] = (key, routes, prepared, staged)
        return routes

    def close(self) -> None:
        gathers, self._gathers = self._gathers, {}
        for _key, _routes, prepared, _staged in gathers.values():
            _close(prepared)
        super().close()

    def _complete(
        self,
        flight: deque[tuple[list[int], list[Any]]],
        staged: set[tuple[int, int]],
        finished: dict[int, int],
    ) -> None:
        """Finish the oldest batch: unpack it, free its staging slots, report when idle."""
        batch, handles = flight.popleft()
        what = f"consumer {self.consumer_id}: batch of {len(batch)} chunks"
        self._mark("wait read")
        for handle in handles:
            wait_read(handle, self.config.stall_timeout, what)
        self._mark("read done")
        unpacked = 0
        for j in batch:
            chunk = self.chunks[j]
            finished[chunk.producer] = chunk.seq
            if self._staged(j, self._announced_as[j]):
                self._packed += 1
                program = self._unpack_program(j)
                program.run()
                unpacked += len(chunk.items)
                slot = (chunk.producer, self._stage_slot[j])
                staged.discard(slot)
                rec = self._recording[chunk.producer]
                rec.programs.append(program)
                rec.packs += 1
                # replayed, every unpack runs after every read: each needs a slot of its own
                rec.ok = rec.ok and slot not in rec.slots
                rec.slots.add(slot)
        if unpacked:
            self._mark(f"unpacked {unpacked}")
        if not flight or not all(h.done() for h in flight[0][1]):
            self._report(finished)  # nothing else is ready: let producers reuse their slots

    def _report(self, finished: dict[int, int]) -> None:
        self._mark("report")
        for p, seq in finished.items():
            self._tell_done(p, seq)
        finished.clear()

    def _tell_done(self, p: int, seq: int) -> None:
        """'Done up to ``seq``' to producer ``p``."""
        message = encode_done(self._syncs, seq)
        self._one.notify(self._pairs[p].peer_rank, message)
        self._last_word[p] = time.monotonic()
        if self._owed.get(p) == seq:
            del self._owed[p]

    def _keep_alive(self) -> None:
        """Tell every producer still owed a 'done' that has not heard from this consumer for a
        quarter of the stall timeout that it is alive (``alive_message``): reading in plan
        order, it may be busy with another producer for longer than the timeout in all. Called
        between batches and while waiting for an announcement, not during one batch's reads
        (a single batch that reads for most of the stall timeout still stalls the others)."""
        if len(self._owed) < 2:
            return  # reading the one producer it owes: that one is not waiting on it
        now = time.monotonic()
        every = self.config.stall_timeout / 4
        for p in self._owed:
            if now - self._last_word[p] >= every:
                message = encode_alive(self._syncs)
                self._one.notify(self._pairs[p].peer_rank, message)
                self._last_word[p] = now

    def _target(self, j: int) -> torch.Tensor:
        """Where chunk ``j``'s bytes land: its destination (direct) or its staging slot."""
        target = self._targets[j]
        if target is None:
            target = self._targets[j] = self._find_target(j)
        return target

    def _find_target(self, j: int) -> torch.Tensor:
        direct = self._direct[j]
        if direct is not None:
            return direct
        chunk = self.chunks[j]
        pair = self._pairs[chunk.producer]
        assert pair.ring is not None
        start = self._stage_slot[j] * pair.slot_bytes
        return pair.ring.buffer[start : start + chunk.nbytes]

    def _direct_dest(self, chunk: Chunk) -> torch.Tensor | None:
        """A one-item chunk's destination bytes when it is contiguous and of the wire dtype."""
        if len(chunk.items) != 1:
            return None
        i = chunk.items[0]
        dest = self._dests[i]
        if not self._suffixes[i] and dest.is_contiguous() and dest.dtype == self._items[i][0]:
            return _as_bytes(dest)
        return None

    def _unpacker(self, j: int) -> Callable[[], None]:
        """What unpacks chunk ``j`` from its staging slot (push path)."""
        return self._unpack_program(j).run

    def _unpack_program(self, j: int) -> CopyProgram:
        """The ``CopyProgram`` that unpacks chunk ``j`` from its staging slot, planned once
        (the slot and destinations never move); its gathers stage in the producer pair's
        buffer (chunks of one producer are unpacked one after another)."""
        prog = self._unpack_programs.get(j)
        if prog is None:
            pair = self._pairs[self.chunks[j].producer]
            dsts, srcs = self._unpack_plan(j)
            prog = self._unpack_programs[j] = CopyProgram(
                dsts, srcs, graph=False, staging=pair.stage
            )
        return prog

    def _unpack_plan(
        self, j: int, slot: torch.Tensor | None = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(destination views, wire views in the chunk's slot) of chunk ``j``, built once: the
        slot of a chunk never moves."""
        views = self._unpack_views.get(j)
        if views is None:
            chunk = self.chunks[j]
            slot = self._target(j) if slot is None else slot
            wires = slot_views(slot, [self._items[i] for i in chunk.items], chunk.offsets)
            srcs = [
                self._views(wire, self._suffixes[i])
                for wire, i in zip(wires, chunk.items, strict=True)
            ]
            views = self._unpack_views[j] = ([self._dests[i] for i in chunk.items], srcs)
        return views
