"""The one-sided READ path, producer side: announce where each chunk is, let consumers read.

A producer exposes every serve ring once at set-up. Each sync it announces every chunk to its
consumer (``messages.Announcement``): a chunk whose source view can be read in place is
announced there (``SourceExposure``), any other is packed into the pair's next ring slot once
that slot's last reader is done. Announcements are batched until the next group, the next wait,
or a byte budget, and one device synchronization covers every pack behind them. Consumers
answer 'done up to seq'; a group is released once every chunk of it is read. Everything runs on
the calling thread (a one-sided communicator need not be thread-safe). Rejected: producers
WRITE into consumer buffers, which would move every byte for every consumer on this thread.
"""

from __future__ import annotations

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
from vllm_dist.tasks.weight_transfer.ring import FreeBarrier

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
        for pair in self._pairs.values():
            pair.slot_seq.clear()  # the last sync drained every slot
            pair.packs = 0
            pair.announced = 0
            if pair.replay is not None:
                pair.replay.close()
            pair.replay = Record() if self._record and pair.chunks else None

    def new_group(self, barrier: FreeBarrier) -> None:
        if self.config.announce_bytes == 0:  # what the last group queued goes out
            self._announce_all()
        self._poll_done(barrier)

    def opened(self, group: int, tensors: Mapping[str, torch.Tensor]) -> None:
        self._dirty = True  # opening may queue device work (a gather): sync before telling
        if self._record and self.replay is not None:
            self.replay.snapshot(group, tensors)

    def finish(self, barrier: FreeBarrier) -> None:
        """Announce what is left and take every 'done'."""
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
        if block:
            self._announce_all()  # never wait on a consumer that has not been told everything
            self.engine._mark(f"wait done {pair.peer_rank}")
            done = self._consumer_word(pair.peer_rank, what, block=True)
            self.engine._mark(f"got done {pair.peer_rank}")
        else:
            done = self._consumer_word(pair.peer_rank, what, block=False)
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
            if sync > self.engine._syncs:
                raise RuntimeError(
                    f"{what}: 'alive' for sync {sync}, this is sync {self.engine._syncs}"
                )
            if sync == self.engine._syncs:
                self.engine._mark(f"alive {peer}")
                deadline = time.monotonic() + stall

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
