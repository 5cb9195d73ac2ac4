"""The replayed READ path: a sync in which every tensor is where it was runs as the last one.

An RL trainer writes its weights in place, so from one sync to the next every tensor is the
same object at the same address. With a resident source a producer records the packs of each
complete sync per pair, and a consumer the reads and unpacks it posted. At the next sync the
producer compares objects and addresses with the recorded ones; if nothing moved it runs the
recorded packs as one program per consumer and sends each a single ``Replay`` message; the
consumer posts its recorded reads as one prepared set, unpacks, and answers once. A sync is
recorded only when replaying it is safe: no chain that copies, no more packs than ring slots,
no source seen for the first time, no staging slot used twice. Anything else falls back to the
chunk-by-chunk READ path (a consumer then reads a ``Replay`` as the last sync's announcements).
"""

from __future__ import annotations

import operator
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from vllm_dist.interfaces.dataplane import (
    OneSidedCommunicator,
    PreparedReadCommunicator,
    StridedReadCommunicator,
)
from vllm_dist.tasks.weight_transfer._memory import CopyProgram
from vllm_dist.tasks.weight_transfer.config import SyncStats
from vllm_dist.tasks.weight_transfer.messages import Replay, encode_replay
from vllm_dist.tasks.weight_transfer.onesided import device_synchronize, wait_read
from vllm_dist.tasks.weight_transfer.pairs import ProducerPair, Record
from vllm_dist.tasks.weight_transfer.ring import SerialWorker, Waitable, wait_or_stall

if TYPE_CHECKING:
    from vllm_dist.tasks.weight_transfer.consumer import WeightConsumer
    from vllm_dist.tasks.weight_transfer.paths.read_consumer import ConsumerRead
    from vllm_dist.tasks.weight_transfer.paths.read_producer import ProducerRead
    from vllm_dist.tasks.weight_transfer.producer import WeightProducer


class ProducerReplay:
    """A producer's replays: the check that nothing moved, the recorded packs, one message."""

    def __init__(self, engine: WeightProducer, read: ProducerRead) -> None:
        self.engine = engine
        self.read = read
        self.config = engine.config
        self.communicator = engine.communicator
        self.producer_id = engine.producer_id
        self.source = engine.source
        self._pairs = engine._pairs
        # group -> (tensor objects, data pointers) when the recorded sync opened it
        self._seen_groups: dict[int, tuple[list[torch.Tensor], list[int]]] = {}
        # every served tensor as ``source.current`` gave it at the recorded sync (if it can)
        self._seen_current: tuple[list[torch.Tensor], list[int]] | None = None

    def begin(self, start: float, record: bool) -> SyncStats | None:
        """The whole sync as a replay where nothing moved (its stats), else None."""
        now = self._current() if record else None
        if self.replayable():
            # checked before the recorded packs run: a moved source may be freed memory
            names = self.engine._group_names
            if now is not None:
                self.engine._mark("checked")
                if same_tensors(now, self._seen_current):
                    return self.run(start, {}, self._replay_packs())
            else:
                every = {g: self.source.open_group(names[g]) for g in self.engine._group_order}
                self.engine._mark("opened")
                if self._unchanged(every):
                    return self.run(start, every, self._replay_packs())
                for g in self.engine._group_order:
                    self.source.release_group(names[g])
        self._seen_current = now
        return None

    def snapshot(self, group: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Record how the recorded sync opened ``group``."""
        self._seen_groups[group] = snapshot_of(tensors, self.engine._group_names[group])

    def replayable(self) -> bool:
        """Whether every pair's last sync was recorded and the source is resident
        (opening every group at once costs nothing), so this sync may run as that one."""
        pairs = [pair for pair in self._pairs.values() if pair.chunks]
        return (
            self.source.resident
            and bool(pairs)
            and all(p.replay is not None and p.replay.sync == self.engine._syncs - 1 for p in pairs)
        )

    def _current(self) -> tuple[list[torch.Tensor], list[int]] | None:
        """Every served tensor as the source holds it now and its address (C-speed passes over
        one list), or None when the source cannot say without opening its groups."""
        tensors = self.source.current(self.engine._served_names)
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
            objs, ptrs = snapshot_of(tensors, self.engine._group_names[g])
            if seen is None or ptrs != seen[1] or not all(map(operator.is_, objs, seen[0])):
                return False
        return True

    def _replay_packs(self) -> dict[int, Waitable | None]:
        """Launch every pair's recorded packs (the programs of its chunks merged into one:
        one CUDA graph on a GPU); the consumers that had packs, each with the handle of its
        packs where they run on a thread of their own (None: done, or queued on the GPU).

        On the CPU, with more than one consumer's packs, each runs on its pair's thread but the
        first, which this thread runs after launching the others: a copy releases the GIL, so
        the packs share the cores their consumers leave idle while they wait for their slots."""
        runs: list[tuple[int, ProducerPair, CopyProgram]] = []
        for cid, pair in self._pairs.items():
            rec = pair.replay
            if rec is not None and rec.programs:
                if rec.prepared is None:
                    rec.prepared = CopyProgram.merged(rec.programs, streams=self.engine.streams)
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

    def run(
        self,
        start: float,
        opened: Mapping[int, Mapping[str, torch.Tensor]],
        packs: dict[int, Waitable | None],
    ) -> SyncStats:
        """The steady state: every source is where it was, so every chunk is too. The recorded
        packs ran as one program per consumer, each consumer gets one message for the whole
        sync, as soon as its packs are through, and answers once it has read everything; no
        per-chunk work on this side."""
        self.engine._mark("replay")
        pairs = [(cid, pair, pair.replay) for cid, pair in self._pairs.items() if pair.replay]
        if packs:
            device_synchronize(self.communicator.device)
        for cid, pair, _ in pairs:
            handle = packs.get(cid)
            if handle is not None:
                what = f"producer {self.producer_id}: packs of the replayed sync for consumer {cid}"
                wait_or_stall(handle, self.config.stall_timeout, what)
            self.read._tell(pair, encode_replay(self.engine._syncs), "the replayed sync")
        self.engine._mark("told")
        for cid, pair, rec in pairs:
            self._await_done(cid, pair, rec.last_seq)
            rec.sync = self.engine._syncs
        for g in opened:
            self.source.release_group(self.engine._group_names[g])
        self.engine._mark("end")
        return SyncStats(
            seconds=time.perf_counter() - start,
            bytes=self.engine._sync_bytes,
            chunks=len(self.engine._schedule),
            path=self.engine.path,
            packed=sum(rec.packs for _, _, rec in pairs),
            replayed=True,
        )

    def _await_done(self, cid: int, pair: ProducerPair, last_seq: int) -> None:
        """Take consumer ``cid``'s 'done' messages until it has read chunk ``last_seq``."""
        what = f"producer {self.producer_id} waiting for consumer {cid} to read (replayed sync)"
        seen = -1
        while seen < last_seq:
            done = self.read._consumer_word(pair.peer_rank, what, block=True)
            assert done is not None
            sync, seq = done.sync, done.seq
            if sync != self.engine._syncs or not seen < seq <= last_seq:
                raise RuntimeError(f"{what}: unexpected 'done' for (sync, seq) {(sync, seq)}")
            seen = seq


class ConsumerReplay:
    """A consumer's replays: the record being made, the recorded reads posted as one set."""

    def __init__(
        self,
        engine: WeightConsumer,
        read: ConsumerRead,
        one_sided: OneSidedCommunicator,
        strided_comm: StridedReadCommunicator | None,
        preparer: PreparedReadCommunicator | None,
    ) -> None:
        self.engine = engine
        self.read = read
        self.config = engine.config
        self.consumer_id = engine.consumer_id
        self._pairs = engine._pairs
        self._one = one_sided
        self._strided_comm = strided_comm
        self._preparer = preparer
        # this sync: the record being made per producer, the replays whose reads are in
        # flight (producer -> handles), the producers whose message was a replay
        self.recording: dict[int, Record] = {}
        self.replaying: dict[int, list[Any]] = {}
        self.replayed_from: set[int] = set()

    def reset(self) -> None:
        """A sync starts: a fresh record for every producer with chunks."""
        self.recording = {p: Record() for p, pair in self._pairs.items() if pair.chunks}
        self.replaying = {}
        self.replayed_from = set()

    def keep(self) -> bool:
        """The sync ended: keep what was recorded; True when every producer replayed."""
        replayed = bool(self.recording) and self.replayed_from == set(self.recording)
        for p, rec in self.recording.items():
            pair = self._pairs[p]
            if p in self.replayed_from:
                continue  # its record stays (and was replayed)
            if pair.replay is not None:
                pair.replay.close()
            rec.last_seq = pair.last_seq
            rec.sync = self.engine._syncs if rec.ok else -1
            pair.replay = rec
        return replayed

    def start(self, p: int, msg: Replay, what: str) -> bool:
        """Post producer ``p``'s recorded reads if ``msg`` is a replay of a sync recorded here
        (the last one); False when it is not (then it is read chunk by chunk)."""
        pair = self._pairs[p]
        rec = pair.replay
        if rec is None or rec.sync != self.engine._syncs - 1:
            return False
        self.check(msg, what)
        if rec.prepared is None:
            rec.prepared = self._merged_reads(pair.peer_rank, rec)
        if rec.prepared is None:
            rec.prepared = self.prepare_reads(pair.peer_rank, rec)
        self.engine._mark(f"replay {pair.peer_rank}")
        posted = rec.prepared.post()
        self.replaying[p] = posted if isinstance(posted, list) else [posted]
        self.replayed_from.add(p)
        return True

    def _merged_reads(self, peer: int, rec: Record) -> Any:
        """The recorded reads as the chunks' own prepared sets merged (nothing planned again;
        ``merge_prepared``), where those sets are all of them; else None."""
        if self._preparer is None or rec.plain or not rec.sets or rec.gathered != len(rec.strided):
            return None
        return self._preparer.merge_prepared(peer, rec.sets)

    def prepare_reads(self, peer: int, rec: Record) -> Any:
        if self._preparer is not None:
            return self._preparer.prepare_reads(peer, rec.plain, rec.strided)
        strided_comm = self._strided_comm
        return Reposter(self._one, strided_comm, peer, rec.plain, rec.strided)

    def finish(self, *, block: bool) -> None:
        """Finish the replays whose reads have landed (every one when ``block``, waiting):
        unpack what was staged, tell the producer."""
        for p in list(self.replaying):
            handles = self.replaying[p]
            if not block and not all(h.done() for h in handles):
                continue
            del self.replaying[p]
            pair = self._pairs[p]
            rec = pair.replay
            assert rec is not None
            what = f"consumer {self.consumer_id}: replayed reads from producer {p}"
            for handle in handles:
                wait_read(handle, self.config.stall_timeout, what)
            self.engine._mark("read done")
            if rec.programs:
                if rec.unpack is None:
                    rec.unpack = CopyProgram.merged(rec.programs, streams=self.engine.streams)
                rec.unpack.run()
                self.engine._packed += rec.packs
            self.read._tell_done(p, rec.last_seq)
            rec.sync = self.engine._syncs

    def check(self, msg: Replay, what: str) -> None:
        if msg.sync != self.engine._syncs:
            raise RuntimeError(f"{what}: replay message for sync {msg.sync}")


class Reposter:
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


def snapshot_of(
    tensors: Mapping[str, torch.Tensor], names: list[str]
) -> tuple[list[torch.Tensor], list[int]]:
    objs = [tensors[n] for n in names]
    return objs, [t.data_ptr() for t in objs]


def same_tensors(
    now: tuple[list[torch.Tensor], list[int]], seen: tuple[list[torch.Tensor], list[int]] | None
) -> bool:
    """Whether ``now`` holds the very objects of ``seen``, at the same addresses."""
    return now is seen or (
        seen is not None
        and now[1] == seen[1]
        and len(now[0]) == len(seen[0])
        and all(map(operator.is_, now[0], seen[0]))
    )
