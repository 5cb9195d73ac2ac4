"""The one-sided READ path, producer side: announce where each chunk is, let consumers read.

A producer exposes every serve ring once at set-up. Each sync it announces every chunk to its
consumer (``messages.Announcement``): a chunk whose source view can be read in place is
announced there (``SourceExposure``), any other is packed into the pair's next ring slot once
that slot's last reader is done. Announcements are batched until the next group, the next wait,
or a byte budget, and one device synchronization covers every pack behind them. Consumers
answer 'done up to seq'; a group is released once every chunk of it is read. Everything runs on
the calling thread (a one-sided communicator need not be thread-safe). Rejected: producers
WRITE into consumer buffers, which would move every byte for every consumer on this thread.

In an elastic fleet (``gone`` set) a consumer that left the fleet mid-sync is *lost*: its chunks
are skipped and its groups released, the others are served on, and ``lost`` names it so that
the engine drops the pair after the sync.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch

from vllm_dist.interfaces.dataplane import OneSidedCommunicator
from vllm_dist.tasks.weight_transfer.config import ANNOUNCE_BYTES, FIRST_ANNOUNCE_BYTES
from vllm_dist.tasks.weight_transfer.exposure import Exposures, SourceExposure
from vllm_dist.tasks.weight_transfer.messages import (
    Announcement,
    Done,
    ReadyCodec,
    decode_consumer_message,
)
from vllm_dist.tasks.weight_transfer.onesided import (
    device_synchronize,
    poll_message,
    ring_name,
    wait_message,
)
from vllm_dist.tasks.weight_transfer.pairs import ProducerPair, Record
from vllm_dist.tasks.weight_transfer.paths.base import ProducerPath
from vllm_dist.tasks.weight_transfer.paths.replay import ProducerReplay
from vllm_dist.tasks.weight_transfer.plan import Chunk
from vllm_dist.tasks.weight_transfer.ring import FreeBarrier, TransferStallError

logger = logging.getLogger("vllm_dist")

GONE_POLL_S = 0.25
"""Elastic fleets: how often a wait on one consumer asks whether it left the fleet."""


class _ConsumerGone(Exception):
    """The consumer being waited on left the fleet (elastic fleets only)."""


if TYPE_CHECKING:
    from vllm_dist.tasks.weight_transfer.config import SyncStats
    from vllm_dist.tasks.weight_transfer.producer import WeightProducer


class ProducerRead(ProducerPath):
    """A producer's side of the READ path (and, through ``ProducerReplay``, of replays)."""

    name = "read"

    def __init__(
        self, engine: WeightProducer, one_sided: OneSidedCommunicator, exposures: Exposures
    ) -> None:
        self.engine = engine
        self.config = engine.config
        self.communicator = engine.communicator
        self.coordinator = engine.coordinator
        self.producer_id = engine.producer_id
        self._pairs = engine._pairs
        self._views = engine._views
        self._one = one_sided
        self.exposures = exposures
        self.exposure = SourceExposure(
            exposures, engine.source, engine.producer_id, engine._views, engine.arenas
        )
        self._codec = ReadyCodec()
        self._dirty = False  # device work queued since the last synchronization
        self._packs: list[Callable[[], None]] = []  # packs queued since the last announcement
        self._record = False  # this sync is recorded for a replay
        self.replay = ProducerReplay(engine, self) if self.config.replay else None
        # elastic fleets: ``gone(peer rank)`` says a consumer left the fleet; ``lost`` are the
        # consumers of this sync given up on (skipped, their groups released)
        self.gone: Callable[[int], bool] | None = None
        self.lost: set[int] = set()
        self._barrier: FreeBarrier | None = None

    def expose_rings(self) -> None:
        """Expose every serve ring once; collective with the consumers' ``connect``."""
        for cid, pair in self._pairs.items():
            if pair.ring is not None:
                self.exposures.expose(pair.ring.buffer, ring_name(self.producer_id, cid))
        self._one.exchange_exposed()

    def begin(self, start: float) -> SyncStats | None:
        device = self.communicator.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the trainer's writes, on any stream
        replay = self.replay
        self._record = replay is not None and self.engine.source.resident
        if replay is None:
            return None
        return replay.begin(start, self._record)

    def reset(self) -> None:
        self.lost.clear()
        for pair in self._pairs.values():
            pair.slot_seq.clear()  # the last sync drained every slot
            pair.packs = 0
            pair.announced = 0
            if pair.replay is not None:
                pair.replay.close()
            pair.replay = Record() if self._record and pair.chunks else None

    def new_group(self, barrier: FreeBarrier) -> None:
        self._barrier = barrier
        if self.config.announce_bytes == 0:  # what the last group queued goes out
            self._announce_all()
        self._poll_done(barrier)

    def opened(self, group: int, tensors: Mapping[str, torch.Tensor]) -> None:
        self._dirty = True  # opening may queue device work (a gather): sync before telling
        if self._record and self.replay is not None:
            self.replay.snapshot(group, tensors)

    def finish(self, barrier: FreeBarrier) -> None:
        """Announce what is left and take every 'done'."""
        self._barrier = barrier
        self._announce_all()
        for cid, pair in self._pairs.items():
            while pair.pending:
                self._take_done(cid, pair, barrier, block=True)
        barrier.wait_all(self.config.stall_timeout)

    def end(self) -> None:
        self.exposure.end_sync()
        for pair in self._pairs.values():
            rec = pair.replay
            if rec is not None and pair.ring is not None:
                rec.packs = pair.packs
                rec.last_seq = max(c.seq for c in pair.chunks)
                rec.sync = self.engine._syncs if rec.ok and pair.packs <= pair.ring.slots else -1

    def serve(
        self,
        cid: int,
        pair: ProducerPair,
        chunk: Chunk,
        tensors: Mapping[str, torch.Tensor],
        barrier: FreeBarrier,
    ) -> None:
        """Tell the consumer where chunk ``seq`` is: in its source (exposed, no pack) or
        packed into the next ring slot (round robin over the packed chunks only) once that
        slot's last reader is done."""
        assert pair.ring is not None
        if cid in self.lost:
            barrier.arrive(chunk.group)
            return
        exposed = self.exposure.exposed_source(pair, chunk, tensors)
        if exposed is not None:
            name, offset, desc, strides = exposed
            pair.outbox.append(
                Announcement(
                    self.engine._syncs,
                    chunk.seq,
                    offset,
                    chunk.nbytes,
                    name,
                    strides,
                    None if desc is None else desc.to_bytes(),  # first sight: in the message
                )
            )
        else:
            index = pair.packs % pair.ring.slots
            pair.packs += 1
            last = pair.slot_seq.get(index)  # the last chunk packed into this slot
            while last is not None and pair.pending and pair.pending[0][0] <= last:
                self._take_done(cid, pair, barrier, block=True)
            if cid in self.lost:  # it left while we waited for the slot
                barrier.arrive(chunk.group)
                return
            pair.slot_seq[index] = chunk.seq
            start = index * pair.slot_bytes
            slot = pair.ring.buffer[start : start + chunk.nbytes]
            self._pack(slot, pair, chunk, tensors)
            pair.outbox.append(Announcement(self.engine._syncs, chunk.seq, start, chunk.nbytes))
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

    def _announce(self, pair: ProducerPair) -> None:
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
            self.engine._mark(f"announce {pair.peer_rank} x{len(pair.outbox)}")
            self._tell(pair, self._codec.encode(pair.outbox), "what is ready")
            pair.outbox = []
        pair.announced += pair.outbox_bytes
        pair.outbox_bytes = 0
        pair.outbox_packed = 0

    def _tell(self, pair: ProducerPair, message: bytes, what: str) -> None:
        """Notify ``pair``'s consumer; a failure (the consumer is gone: NIXL reports the
        disconnect) names the consumer and what it was being told."""
        try:
            self._one.notify(pair.peer_rank, message)
        except Exception as exc:
            cid = next(c for c, p in self._pairs.items() if p is pair)
            if self.gone is not None:  # elastic: an unreachable consumer is given up on
                self._lose(cid, pair, f"{type(exc).__name__}: {exc}")
                return
            raise RuntimeError(
                f"producer {self.producer_id}: telling consumer {cid} (rank {pair.peer_rank}) "
                f"{what} in sync {self.engine._syncs} failed: {type(exc).__name__}: {exc}"
            ) from exc

    def _poll_done(self, barrier: FreeBarrier) -> None:
        """Take every 'done' that has arrived (never waits): frees slots and finished groups."""
        for cid, pair in self._pairs.items():
            while pair.pending and self._take_done(cid, pair, barrier, block=False):
                pass

    def _take_done(
        self, cid: int, pair: ProducerPair, barrier: FreeBarrier, *, block: bool
    ) -> bool:
        """Consume one 'done up to seq' from consumer ``cid`` (waiting for it when ``block``)."""
        what = f"producer {self.producer_id} waiting for consumer {cid} to read"
        try:
            if block:
                self._announce_all()  # never wait on a consumer that was not told everything
                if cid in self.lost:
                    return False
                self.engine._mark(f"wait done {pair.peer_rank}")
                done = self._consumer_word(pair.peer_rank, what, block=True)
                self.engine._mark(f"got done {pair.peer_rank}")
            else:
                done = self._consumer_word(pair.peer_rank, what, block=False)
        except _ConsumerGone:
            self._lose(cid, pair, "it left the fleet")
            return False
        if done is None:
            return False
        sync, seq = done.sync, done.seq
        if sync != self.engine._syncs or not pair.pending or seq < pair.pending[0][0]:
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
                msg: bytes | None = self._wait_word(peer, deadline, what)
            else:
                msg = poll_message(self._one, peer)
            if msg is None:
                return None
            word = decode_consumer_message(msg, what)
            if isinstance(word, Done):
                return word
            sync = word.sync
            if sync > self.engine._syncs:
                raise RuntimeError(
                    f"{what}: 'alive' for sync {sync}, this is sync {self.engine._syncs}"
                )
            if sync == self.engine._syncs:
                self.engine._mark(f"alive {peer}")
                deadline = time.monotonic() + stall

    def _wait_word(self, peer: int, deadline: float, what: str) -> bytes:
        """The consumer's next message by ``deadline``; in an elastic fleet the wait is cut
        into short slices between which ``gone`` is asked (``_ConsumerGone``)."""
        stall = self.config.stall_timeout
        if self.gone is None:
            return wait_message(self._one, peer, deadline - time.monotonic(), what, stall)
        while True:
            left = deadline - time.monotonic()
            try:
                return wait_message(self._one, peer, min(left, GONE_POLL_S), what, stall)
            except TransferStallError:
                if self.gone(peer):
                    raise _ConsumerGone(peer) from None
                if left <= GONE_POLL_S:
                    raise

    def _lose(self, cid: int, pair: ProducerPair, why: str) -> None:
        """Give up on consumer ``cid`` for the rest of this sync: nothing more is told or
        awaited, and the groups it had not finished are released for the others."""
        if cid in self.lost:
            return
        logger.warning(
            "vllm_dist: producer %d: consumer %d (rank %d) lost in sync %d, serving the others: %s",
            self.producer_id, cid, pair.peer_rank, self.engine._syncs, why,
        )  # fmt: skip
        self.lost.add(cid)
        pair.outbox = []
        while pair.pending:
            group = pair.pending.popleft()[1]
            if self._barrier is not None:
                self._barrier.arrive(group)

    def _announce_all(self) -> None:
        for pair in self._pairs.values():
            if pair.outbox:
                self._announce(pair)

    def _pack(
        self,
        slot: torch.Tensor,
        pair: ProducerPair,
        chunk: Chunk,
        tensors: Mapping[str, torch.Tensor],
    ) -> None:
        """Queue the copies of the chunk's items into its slot for ``_announce``."""
        self.engine._packed += 1
        dsts, srcs = pair.pack_views(slot, chunk, tensors, self._views)
        self._packs.append(pair.program(chunk, dsts, srcs))
        plan = pair.views[chunk.index]
        if pair.replay is not None and not plan.copies:  # a chain that copies: not replayed
            assert plan.program is not None  # the one ``_program`` just gave
            pair.replay.programs.append(plan.program[2])
