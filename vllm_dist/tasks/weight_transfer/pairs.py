"""Per-pair state: what a producer keeps for each consumer and a consumer for each producer.

One class per role rather than one bag for both: a consumer never packs, a producer never
stages a read. ``Record`` is a pair's last sync as the replayed READ path keeps it.
"""

from __future__ import annotations

import operator
import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from vllm_dist.interfaces.dataplane import PreparedReadSet
from vllm_dist.tasks.weight_transfer._memory import CopyProgram, batched_copy
from vllm_dist.tasks.weight_transfer.messages import Announcement
from vllm_dist.tasks.weight_transfer.ops import OpChain
from vllm_dist.tasks.weight_transfer.plan import Chunk
from vllm_dist.tasks.weight_transfer.ring import SerialWorker, ServeRing
from vllm_dist.tasks.weight_transfer.views import ViewCache, slot_views


def close_prepared(prepared: PreparedReadSet | CopyProgram | None) -> None:
    """Release a prepared set of reads or a copy program, if any."""
    if prepared is not None:
        prepared.close()


@dataclass(kw_only=True)
class Pair:
    """What both ends keep of one (producer, consumer) pair."""

    peer_rank: int
    chunks: list[Chunk]
    slot_bytes: int
    ring: ServeRing | None = None
    worker: SerialWorker | None = None
    remote_name: str = ""  # READ path: the producer's exposed ring for this pair
    replay: Record | None = None  # READ path: the pair's last sync, to replay
    staging: torch.Tensor | None = None  # the pair's copy programs' gathers stage here
    receipt: torch.Tensor | None = None  # push: the consumer's receipt of a sync lands here

    def close(self) -> None:
        """Stop the pair's thread and release its replay record."""
        if self.worker is not None:
            self.worker.close()
        if self.replay is not None:
            self.replay.close()

    def receipt_buffer(self, device: torch.device) -> torch.Tensor:
        """The one-number buffer a push sync's receipt travels in."""
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
class ConsumerPair(Pair):
    """A consumer's view of one producer."""

    last_seq: int = -1  # the seq of the pair's last chunk


@dataclass(kw_only=True)
class ProducerPair(Pair):
    """A producer's view of one consumer: what it serves and how each chunk is packed."""

    names: list[str] = field(default_factory=list)  # the name of each item
    items: list[tuple[torch.dtype, tuple[int, ...], int]] = field(default_factory=list)
    prefixes: list[OpChain] = field(default_factory=list)
    views: dict[int, PackPlan] = field(default_factory=dict)  # chunk index -> its pack plan
    sync_bytes: int = 0  # the bytes of all of the pair's chunks
    strided: bool = False  # READ: the consumer reads strided source views in place
    maps: bool = False  # READ: ... on a mapping of the producer's memory (``maps_peer_memory``)
    # READ path, per sync
    told: set[str] = field(default_factory=set)  # exposed sources this consumer knows
    outbox: list[Announcement] = field(default_factory=list)  # not yet sent
    outbox_bytes: int = 0  # bytes of the chunks queued since the last announcement
    outbox_packed: int = 0  # ring slots packed since the last announcement
    slot_seq: dict[int, int] = field(default_factory=dict)  # slot -> last seq packed
    packs: int = 0  # chunks packed this sync (the next one takes slot packs % K)
    announced: int = 0  # bytes announced this sync
    pending: deque[tuple[int, int]] = field(default_factory=deque)  # (seq, group) unread
    # push path, per sync
    failed: threading.Event = field(default_factory=threading.Event)  # a chunk failed
    error: Exception | None = None  # why this pair failed this sync

    def sources(
        self, chunk: Chunk, tensors: Mapping[str, torch.Tensor], cache: ViewCache
    ) -> list[torch.Tensor]:
        """The chunk's source views; rebuilt only when a source tensor object changed. The
        very mapping of last time from ``open_group`` is the source's word that nothing in it
        moved: no look at any name."""
        plan = self.views[chunk.index]
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
            plan.srcs = [cache(t, c) for t, c in zip(objs, plan.prefixes, strict=True)]
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

    def pack_views(
        self,
        slot: torch.Tensor,
        chunk: Chunk,
        tensors: Mapping[str, torch.Tensor],
        cache: ViewCache,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(views into ``slot``, source views) of the chunk's items: packing copies one into
        the other."""
        plan = self.views[chunk.index]
        if plan.dsts is None or plan.slot_ptr != slot.data_ptr():  # views per slot it lands in
            plan.slot_ptr = slot.data_ptr()
            plan.dsts = slot_views(slot, [self.items[i] for i in chunk.items], chunk.offsets)
        return plan.dsts, self.sources(chunk, tensors, cache)

    def program(
        self, chunk: Chunk, dsts: list[torch.Tensor], srcs: list[torch.Tensor]
    ) -> Callable[[], None]:
        """What copies the chunk's sources into its slot views: a ``CopyProgram`` kept while
        the chunk's sources and slot stay (planned once: widened views, one gather for many
        small strided items such as row-parallel expert shards, where a copy each would be
        a kernel each on a GPU), or a one-off batched copy of the fresh bytes of a chain that
        copies."""
        plan = self.views[chunk.index]
        if plan.copies:
            return partial(batched_copy, dsts, srcs)
        prog = plan.program
        if prog is None or prog[0] is not dsts or prog[1] is not srcs:
            prog = plan.program = (
                dsts,
                srcs,
                CopyProgram(dsts, srcs, staging=self.stage),
            )
        return prog[2].run


@dataclass(kw_only=True)
class Record:
    """One pair's last sync, kept so that the next can run as a whole (a ``Replay`` message).

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
    # consumer: the prepared sets of chunks read item by item (``ConsumerRead.gather``) and how many of
    # ``strided`` they read: when they read all of it, the first replay merges them
    sets: list[Any] = field(default_factory=list)
    gathered: int = 0

    def close(self) -> None:
        close_prepared(self.prepared)
        close_prepared(self.unpack)
        self.prepared = self.unpack = None


@dataclass(kw_only=True, slots=True)
class PackPlan:
    """What packing one chunk needs, built at set-up; views are cached across syncs."""

    names: list[str]
    prefixes: list[OpChain]
    dsts: list[torch.Tensor] | None = None
    slot_ptr: int = 0  # where ``dsts`` point: a READ-path chunk may take another slot next sync
    objs: list[torch.Tensor] | None = None  # the source tensors ``srcs`` were built from
    srcs: list[torch.Tensor] | None = None
    ptrs: list[int] = field(default_factory=list)  # data pointers of ``objs``
    # (srcs, exposed name, byte offset, strides): the chunk is read in place
    # (``SourceExposure.exposed_source``)
    inplace: tuple[list[torch.Tensor], str, int, Any] | None = None
    copies: bool = False  # a prefix chain copies: ``srcs`` are fresh every sync
    # (dsts, srcs, the program that packs one into the other), while both stay
    program: tuple[list[torch.Tensor], list[torch.Tensor], CopyProgram] | None = None
    mapping: Mapping[str, torch.Tensor] | None = None  # the group ``srcs`` were taken from
