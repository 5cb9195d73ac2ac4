"""The one-sided READ path, consumer side: read what producers announce, unpack, answer.

The consumer turns everything announced into one batched read per producer (straight into its
parameters where the destination allows, else into staging slots), keeps up to
``BATCHES_IN_FLIGHT`` batches posted, completes them in plan order with one unpack launch per
batch, and answers 'done up to seq' whenever it runs out of finished reads. Where it maps the
producer's memory it reads strided source views in place, through its own re-layout, straight
into its parameters (``route``, ``gather``). Messages are taken in plan order; a ``Replay``
hands the sync to ``ConsumerReplay``.
"""

from __future__ import annotations

import time
from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from vllm_dist.interfaces.dataplane import (
    ExposedDescriptor,
    OneSidedCommunicator,
    PreparedReadCommunicator,
    StridedReadCommunicator,
)
from vllm_dist.tasks.weight_transfer.config import BATCHES_IN_FLIGHT, MAX_PINNED
from vllm_dist.tasks.weight_transfer.exposure import Exposures
from vllm_dist.tasks.weight_transfer.messages import (
    SPREAD,
    Announcement,
    ReadyCodec,
    Replay,
    encode_alive,
    encode_done,
)
from vllm_dist.tasks.weight_transfer.onesided import (
    device_synchronize,
    poll_message,
    ring_name,
    wait_message,
    wait_read,
)
from vllm_dist.tasks.weight_transfer.pairs import ConsumerPair, Record, close_prepared
from vllm_dist.tasks.weight_transfer.paths.base import ConsumerPath
from vllm_dist.tasks.weight_transfer.paths.replay import ConsumerReplay
from vllm_dist.tasks.weight_transfer.plan import Chunk
from vllm_dist.tasks.weight_transfer.views import contiguous_strides, slot_views

if TYPE_CHECKING:
    from vllm_dist.tasks.weight_transfer.consumer import WeightConsumer


class ConsumerRead(ConsumerPath):
    """A consumer's side of the READ path (and, through ``ConsumerReplay``, of replays)."""

    def __init__(
        self,
        engine: WeightConsumer,
        one_sided: OneSidedCommunicator,
        strided_comm: StridedReadCommunicator | None,
        preparer: PreparedReadCommunicator | None,
        exposures: Exposures,
    ) -> None:
        self.engine = engine
        self.config = engine.config
        self.communicator = engine.communicator
        self.coordinator = engine.coordinator
        self.consumer_id = engine.consumer_id
        self._pairs = engine._pairs
        self._views = engine._views
        self._one = one_sided
        self._strided_comm: StridedReadCommunicator  # used only where strided reads are
        if strided_comm is not None:
            self._strided_comm = strided_comm
        self.exposures = exposures
        self._codec = ReadyCodec()
        self._strided = engine._strided
        self._map_packs = engine._strided and self.config.mapped_unpack
        # the set-up tables (``WeightConsumer.setup`` builds them before this path)
        self.chunks = engine.chunks
        self._direct = engine._direct
        self._items = engine._items
        self._suffixes = engine._suffixes
        self._dests = engine._dests
        self._stage_slot = engine._stage_slot
        self._announced_as: list[Any] = [None] * len(self.chunks)  # this sync's announcements
        # chunk index -> ((source, offset, strides) it was last read from, how): see ``route``
        self._routes: dict[int, tuple[Any, tuple[str, int, Any, torch.Tensor, bool]]] = {}
        # chunk index -> (where it was announced, its items' strided reads from there or None,
        # those reads prepared, whether they land in staging): see ``gather``
        self._gathers: dict[int, tuple[Any, list[Any] | None, Any, bool]] = {}
        self._heard: set[int] = set()  # producers whose first message this sync came
        # this sync: producer -> the seq of its last 'done' (while not sent yet), and when each
        # producer last heard from this consumer (``_keep_alive``)
        self._owed: dict[int, int] = {}
        self._last_word: dict[int, float] = {}
        self.replay = ConsumerReplay(
            engine, self, one_sided, strided_comm if self._strided else None, preparer
        )

    def receive(self) -> bool:
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
        self.replay.reset()
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
                if chunk.producer in self.replay.replayed_from:
                    nxt += 1  # read as a whole
                    continue
                block = not flight and not batch
                if not self._announced(chunk, inbox, block=block):
                    break
                if chunk.producer in self.replay.replayed_from:
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
                self.engine._mark(f"pull x{len(batch)}")
                flight.append((batch, self._pull(batch, announcements)))
            if flight:
                self._complete(flight, staged, finished)
            self.replay.finish(block=False)
        self._report(finished)
        self.replay.finish(block=True)
        device_synchronize(comm.device)
        replayed = self.replay.keep()
        self.engine._mark("end")
        return replayed

    def import_ring(self, pair: ConsumerPair, desc: ExposedDescriptor) -> None:
        """Make a producer's serve ring, exposed for this consumer by ``admit``, addressable."""
        self._one.import_exposed(desc)
        pair.remote_name = desc.name

    def connect(self) -> None:
        """Learn the producers' rings (collective with ``ProducerRead.expose_rings``); pin local buffers.

        Staging slots and the parameters that direct chunks land in are exposed (registered)
        once here, so no sync pays for registering memory; peers never learn of them.
        """
        self._one.exchange_exposed()
        for p, pair in self._pairs.items():
            pair.remote_name = ring_name(p, self.consumer_id)
        self.pin()

    def pin(self) -> None:
        for p, pair in self._pairs.items():
            assert pair.ring is not None
            self.exposures.expose(pair.ring.buffer, f"wt-stage-c{self.consumer_id}-p{p}")
        pinned: set[int] = set()
        for i, direct in enumerate(self._direct):
            if len(pinned) >= MAX_PINNED:
                break
            if direct is None and not (self._strided and len(self.chunks[i].items) == 1):
                continue  # strided reads may land in place: their copies are cached if pinned
            param = self.engine._recv[self.engine._dest_params[self.chunks[i].items[0]]].data
            key = param.untyped_storage().data_ptr()
            if key not in pinned and param.is_contiguous():
                pinned.add(key)
                self.exposures.expose(param, f"wt-dest-c{self.consumer_id}-{len(pinned)}")

    def _take_message(self, p: int, msg: bytes, inbox: dict[int, deque[Any]], what: str) -> None:
        """Queue the announcements of producer ``p``'s message. A replay message starts the
        recorded reads when this consumer has a record of the last sync; otherwise it stands
        for the last sync's announcements (this consumer kept them), read chunk by chunk."""
        self._heard.add(p)
        message = self._codec.decode(msg, what)
        if isinstance(message, Replay):
            if self.replay.start(p, message, what):
                return
            self.replay.check(message, what)
            anns = [self._announced_as[c.index] for c in self._pairs[p].chunks]
            if any(a is None for a in anns):
                raise RuntimeError(f"{what}: a replay, but no earlier sync was read in full here")
            inbox[p].extend(
                Announcement(self.engine._syncs, a.seq, a.offset, a.nbytes, a.source, a.strides)
                for a in anns
                if a is not None
            )
            return
        announced = message.announcements
        for a in announced:  # sources exposed for us, first sight: addressable before reads
            if a.descriptor is not None:
                self._import_descriptor(a, what)
        inbox[p].extend(announced)

    def _import_descriptor(self, a: Announcement, what: str) -> None:
        """Import the descriptor ``a`` carries (the communicator decodes it; no pickle) and
        drop its bytes: announcements are kept for replays, descriptors are not needed again."""
        assert a.descriptor is not None
        try:
            desc = self._one.decode_exposed(a.descriptor)
        except ValueError as exc:
            raise RuntimeError(f"{what}: the descriptor of {a.source!r}: {exc}") from exc
        if desc.name != a.source:
            raise RuntimeError(f"{what}: a descriptor of {desc.name!r} announced for {a.source!r}")
        self._one.import_exposed(desc)
        a.descriptor = None

    def _announced(self, chunk: Chunk, inbox: dict[int, deque[Any]], *, block: bool) -> bool:
        """Whether ``chunk``'s announcement is in the inbox, fetching messages (waiting for
        one when ``block``), or its producer's message was a replay."""
        queue = inbox[chunk.producer]
        while not queue and chunk.producer not in self.replay.replayed_from:
            pair = self._pairs[chunk.producer]
            what = f"consumer {self.consumer_id} <- producer {chunk.producer} (chunk {chunk.seq})"
            if block:
                self.engine._mark(f"wait ready {pair.peer_rank}")
                msg: bytes | None = self._await_message(chunk.producer, inbox, what)
                self.engine._mark("got ready")
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
        if not others and not self.replay.replaying:
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
            self.replay.finish(block=False)
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
            if (sync, seq, nbytes) != (self.engine._syncs, chunk.seq, chunk.nbytes):
                raise RuntimeError(
                    f"consumer {self.consumer_id} <- producer {chunk.producer}: announced "
                    f"(sync, seq, nbytes) {(sync, seq, nbytes)}, expected "
                    f"{(self.engine._syncs, chunk.seq, chunk.nbytes)}"
                )
            rec = self.replay.recording[chunk.producer]
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
            request = (remote, offset, self.engine._target(j))
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
        wire_strides = strides if strides is not None else contiguous_strides(wire)
        offset = ann.offset
        view = None
        peer = self._pairs[chunk.producer].peer_rank
        if self._strided_comm.maps_exposed(peer, source):
            view = self._param_view(i, wire_strides)
        if view is not None:
            route = (source, offset + view[0], view[1], self._dests[i], True)
        else:
            staging = self.engine._target(j)[:nbytes].view(dtype).view(wire)
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
            close_prepared(hit[2])
        chunk = self.chunks[j]
        if spread:
            source, items = key
        else:
            source = key[0]
            items = [
                (key[1] + off, contiguous_strides(self._items[i][1]))
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
                self.engine._target(j), [self._items[i] for i in chunk.items], chunk.offsets
            )
            routes = [(source, off, st, w) for (off, st), w in zip(items, wires, strict=True)]
        prepared = None
        if routes is not None:
            prepared = self.replay.prepare_reads(pair.peer_rank, Record(strided=routes))
        self._gathers[j] = (key, routes, prepared, staged)
        return routes

    def _complete(
        self,
        flight: deque[tuple[list[int], list[Any]]],
        staged: set[tuple[int, int]],
        finished: dict[int, int],
    ) -> None:
        """Finish the oldest batch: unpack it, free its staging slots, report when idle."""
        batch, handles = flight.popleft()
        what = f"consumer {self.consumer_id}: batch of {len(batch)} chunks"
        self.engine._mark("wait read")
        for handle in handles:
            wait_read(handle, self.config.stall_timeout, what)
        self.engine._mark("read done")
        unpacked = 0
        for j in batch:
            chunk = self.chunks[j]
            finished[chunk.producer] = chunk.seq
            if self._staged(j, self._announced_as[j]):
                self.engine._packed += 1
                program = self.engine._unpack_program(j)
                program.run()
                unpacked += len(chunk.items)
                slot = (chunk.producer, self._stage_slot[j])
                staged.discard(slot)
                rec = self.replay.recording[chunk.producer]
                rec.programs.append(program)
                rec.packs += 1
                # replayed, every unpack runs after every read: each needs a slot of its own
                rec.ok = rec.ok and slot not in rec.slots
                rec.slots.add(slot)
        if unpacked:
            self.engine._mark(f"unpacked {unpacked}")
        if not flight or not all(h.done() for h in flight[0][1]):
            self._report(finished)  # nothing else is ready: let producers reuse their slots

    def _report(self, finished: dict[int, int]) -> None:
        self.engine._mark("report")
        for p, seq in finished.items():
            self._tell_done(p, seq)
        finished.clear()

    def _tell_done(self, p: int, seq: int) -> None:
        """'Done up to ``seq``' to producer ``p``."""
        message = encode_done(self.engine._syncs, seq)
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
                message = encode_alive(self.engine._syncs)
                self._one.notify(self._pairs[p].peer_rank, message)
                self._last_word[p] = now

    def close(self) -> None:
        gathers, self._gathers = self._gathers, {}
        for _key, _routes, prepared, _staged in gathers.values():
            close_prepared(prepared)
        super().close()
