"""The push data path: producers send each chunk, consumers receive it (send/recv).

Producers walk their chunks group by group, consumers taking turns within a group, so a ring
full for one consumer leaves the others fed. With pair threads (``TransferConfig.push_threads``)
every (producer, consumer) pair has a sender thread on the producer and a receiver thread on
the consumer, so a blocking send holds up only its pair. Without (NCCL: not thread-safe, and a
send or recv holds its stream until the peer's match) every rank issues its transfers from its
own thread in one fleet-wide order, (group, consumer, the consumer's plan), which keeps the
stream-ordered transfers deadlock-free. Every consumer confirms each sync with a receipt.
"""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from vllm_dist.interfaces import DeviceCommunicator
from vllm_dist.interfaces.dataplane import AsyncSendRecvCommunicator
from vllm_dist.tasks.weight_transfer.config import RECV_AHEAD, TransferConfig
from vllm_dist.tasks.weight_transfer.onesided import wait_device
from vllm_dist.tasks.weight_transfer.pairs import ConsumerPair, ProducerPair
from vllm_dist.tasks.weight_transfer.paths.base import ConsumerPath, ProducerPath
from vllm_dist.tasks.weight_transfer.plan import Chunk
from vllm_dist.tasks.weight_transfer.ring import (
    FreeBarrier,
    SerialWorker,
    TransferStallError,
    Waitable,
    wait_or_stall,
)
from vllm_dist.tasks.weight_transfer.views import as_bytes

if TYPE_CHECKING:
    from vllm_dist.tasks.weight_transfer.consumer import WeightConsumer
    from vllm_dist.tasks.weight_transfer.producer import WeightProducer


class ProducerPush(ProducerPath):
    """A producer's side of the push path: pack where needed, send, take the receipts."""

    name = "send_recv"

    def __init__(
        self, engine: WeightProducer, asynchronous: AsyncSendRecvCommunicator | None
    ) -> None:
        self.engine = engine
        self.config = engine.config
        self.communicator = engine.communicator
        self.producer_id = engine.producer_id
        self._pairs = engine._pairs
        self._views = engine._views
        self._async = asynchronous
        # CUDA: (event behind a queued transfer, its consumer) of this sync
        self._queued: list[tuple[torch.cuda.Event, int]] = []
        # not CUDA: consumer -> (receive of its receipt still posted, its buffer)
        self._receipts_posted: dict[int, tuple[Any, torch.Tensor]] = {}
        # elastic fleets: ``gone(peer rank)`` says a consumer left the fleet; ``abandon(peer
        # rank)`` releases its pair on the data plane, ending what is queued for it
        self.gone: Callable[[int], bool] | None = None
        self.abandon: Callable[[int], None] | None = None

    def reset(self) -> None:
        for pair in self._pairs.values():
            pair.failed = threading.Event()  # a failed chunk stops the pair's later ones
            pair.error = None
            if pair.replay is not None:
                pair.replay.close()
            pair.replay = None

    def finish(self, barrier: FreeBarrier) -> None:
        """Wait for every send, then for every consumer's receipt."""
        timeout = self.config.stall_timeout
        for cid, pair in self._pairs.items():
            if pair.ring is not None:
                try:
                    pair.ring.drain(timeout, f"producer {self.producer_id} -> consumer {cid}")
                except Exception as exc:  # noqa: BLE001 - raised once the others are drained
                    pair.error = pair.error or exc
        barrier.wait_all(timeout)  # every send done or failed
        self.take_receipts()

    def serve(
        self,
        cid: int,
        pair: ProducerPair,
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

    @abstractmethod
    def _push_chunk(
        self,
        cid: int,
        pair: ProducerPair,
        chunk: Chunk,
        tensors: Mapping[str, torch.Tensor],
        barrier: FreeBarrier,
    ) -> None:
        """Pack (where needed) and send one chunk."""

    def _queued_mark(self, cid: int) -> None:
        """On a stream-ordered communicator: an event behind the transfer just queued for
        consumer ``cid``, so that a stall names whose transfer stopped the stream."""
        device = self.communicator.device
        if device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            self._queued.append((event, cid))

    def take_receipts(self) -> None:
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
            what = f"{what} of sync {self.engine._syncs}"
            try:
                if device.type == "cuda":
                    receipt = pair.receipt_buffer(device)
                    recv_bounded(
                        self.communicator, self._async, receipt, pair.peer_rank, self.config, what
                    )
                    self._queued_mark(cid)
                    waiting.append((cid, pair))
                else:
                    self._await_receipt(cid, pair, what)
            except Exception as exc:  # noqa: BLE001 - raised once the others are heard
                pair.error = pair.error or reworded(exc, f"{what}: {exc}")
        poll = self._give_up_on_gone if self.gone is not None else None
        try:
            wait_device(device, self.config.stall_timeout, f"producer {self.producer_id}", poll)
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
            if pair.error is not None:  # given up on while the stream was waited for
                continue
            got = int(pair.receipt_buffer(device).item())
            if got != self.engine._syncs:
                pair.error = RuntimeError(
                    f"consumer {cid} confirmed its sync {got}, expected {self.engine._syncs}: it fell "
                    "out of step with this producer (restart it: join() and admit())"
                )

    def _give_up_on_gone(self) -> None:
        """Elastic, stream-ordered: a consumer whose transfers are still queued and that left
        the fleet is given up on (its pair abandoned, so its queued transfers end and the
        others' behind them go on); the sync then fails for it alone."""
        assert self.gone is not None
        for event, cid in self._queued:
            pair = self._pairs[cid]
            if pair.error is not None or event.query() or not self.gone(pair.peer_rank):
                continue
            pair.error = RuntimeError(
                f"producer {self.producer_id}: consumer {cid} left the fleet in sync "
                f"{self.engine._syncs}; given up on"
            )
            if self.abandon is not None:
                self.abandon(pair.peer_rank)

    def _await_receipt(self, cid: int, pair: ProducerPair, what: str) -> None:
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
            if got == self.engine._syncs:
                return
            if got > self.engine._syncs:
                raise RuntimeError(
                    f"consumer {cid} confirmed sync {got}, ahead of this producer's "
                    f"{self.engine._syncs}: restart it (join() and admit())"
                )

    def _direct_view(
        self, pair: ProducerPair, chunk: Chunk, tensors: Mapping[str, torch.Tensor]
    ) -> torch.Tensor | None:
        """The source bytes of a one-item chunk when they are contiguous: sent without a pack."""
        if len(chunk.items) != 1:
            return None
        srcs = pair.sources(chunk, tensors, self._views)
        return as_bytes(srcs[0]) if srcs[0].is_contiguous() else None

    def _sender(
        self,
        cid: int,
        pair: ProducerPair,
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
                send_bounded(comm, asynchronous, tensor, peer, config, what)
            except Exception as exc:
                if not failed.is_set():
                    pair.error = pair.error or exc  # the cause, not a later skipped chunk
                failed.set()
                raise

        return send

    def _packer(
        self,
        slot: torch.Tensor,
        pair: ProducerPair,
        chunk: Chunk,
        tensors: Mapping[str, torch.Tensor],
    ) -> Callable[[], None]:
        """What packs the chunk into ``slot`` (push path)."""
        dsts, srcs = pair.pack_views(slot, chunk, tensors, self._views)
        return pair.program(chunk, dsts, srcs)


class ConsumerPush(ConsumerPath):
    """A consumer's side of the push path: receive each chunk, unpack it, confirm the sync."""

    def __init__(
        self, engine: WeightConsumer, asynchronous: AsyncSendRecvCommunicator | None
    ) -> None:
        self.engine = engine
        self.config = engine.config
        self.communicator = engine.communicator
        self.consumer_id = engine.consumer_id
        self._pairs = engine._pairs
        self._async = asynchronous
        self.chunks = engine.chunks
        self._direct = engine._direct
        self._broken = ""  # why a sync failed mid-transfer (no sync after it)
        # elastic fleets, as on ``ProducerPush``: a producer that left is abandoned, the sync fails
        self.gone: Callable[[int], bool] | None = None
        self.abandon: Callable[[int], None] | None = None

    def receive(self) -> bool:
        """One sync; never a replay."""
        if self._broken:
            raise RuntimeError(
                f"consumer {self.consumer_id}: an earlier sync failed mid-transfer "
                f"({self._broken}); receives it posted may still be pending, so this "
                "consumer cannot tell its producers' messages apart any more: restart it "
                "(a new WeightConsumer calling join(), with admit() on the producers)"
            )
        try:
            self._receive()
        except BaseException as exc:
            self._broken = f"{type(exc).__name__}: {exc}"
            raise
        return False

    @abstractmethod
    def _receive(self) -> None:
        """Take every chunk of the sync, unpack, send the receipts."""

    def _send_receipts(self) -> None:
        """Tell each producer of this sync's chunks that they are in place (the sync's number,
        which ``join`` took from the producers), in producer order; on a stream, behind the
        last unpack."""
        device = self.communicator.device
        for p in sorted({c.producer for c in self.chunks}):
            pair = self._pairs[p]
            receipt = pair.receipt_buffer(device)
            receipt.fill_(self.engine._syncs)
            what = f"consumer {self.consumer_id} -> producer {p} (receipt of sync {self.engine._syncs})"
            send_bounded(self.communicator, self._async, receipt, pair.peer_rank, self.config, what)

    def _receive_from(
        self,
        pair: ConsumerPair,
        chunks: list[int],
        done: list[Future[None]],
        failed: threading.Event,
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
                self.engine._unpacker(j)()
                staged -= 1
            done[j].set_result(None)

        try:
            for j in chunks:
                if failed.is_set():
                    raise RuntimeError("an earlier chunk of this sync failed")
                is_staged = self._direct[j] is None
                while posted and (len(posted) >= ahead or (is_staged and staged)):
                    finish()
                target = self.engine._target(j)
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


class ProducerPushOrdered(ProducerPush):
    """Every transfer from this thread, in the fleet-wide order (NCCL: stream-ordered)."""

    def _push_chunk(
        self,
        cid: int,
        pair: ProducerPair,
        chunk: Chunk,
        tensors: Mapping[str, torch.Tensor],
        barrier: FreeBarrier,
    ) -> None:
        # a slot is reused only after its last send returned (blocking) or behind it on the
        # stream (NCCL)
        assert pair.ring is not None
        direct = self._direct_view(pair, chunk, tensors)
        if direct is None:
            self.engine._packed += 1
            direct = pair.ring.acquire(chunk.seq, chunk.nbytes, 0.0, "")  # nothing in flight
            self._packer(direct, pair, chunk, tensors)()
        what = f"producer {self.producer_id} -> consumer {cid} (chunk {chunk.seq})"
        send_bounded(self.communicator, self._async, direct, pair.peer_rank, self.config, what)
        self._queued_mark(cid)
        barrier.arrive(chunk.group)


class ProducerPushThreaded(ProducerPush):
    """A sender thread per consumer: a blocking send holds up only its pair (gloo)."""

    def pair_worker(self, cid: int) -> SerialWorker | None:
        return SerialWorker(f"wt-serve-c{cid}")

    def schedule(self, pairs: Mapping[int, ProducerPair]) -> list[tuple[int, int, int]]:
        # consumers take turns within a group (the pair's chunk i of every consumer before
        # chunk i + 1 of any), so a ring full for one leaves the others fed
        turns = [(c.group, c.seq, cid, c.index) for cid, p in pairs.items() for c in p.chunks]
        return [(g, cid, i) for g, _, cid, i in sorted(turns)]

    def _push_chunk(
        self,
        cid: int,
        pair: ProducerPair,
        chunk: Chunk,
        tensors: Mapping[str, torch.Tensor],
        barrier: FreeBarrier,
    ) -> None:
        assert pair.ring is not None and pair.worker is not None
        direct = self._direct_view(pair, chunk, tensors)
        if direct is not None:
            handle = pair.worker.submit(self._sender(cid, pair, chunk, direct))
        else:
            what = f"producer {self.producer_id} -> consumer {cid}"
            timeout = self.config.stall_timeout
            slot = pair.ring.acquire(chunk.seq, chunk.nbytes, timeout, what)
            self.engine._packed += 1
            # packed by the sender thread right before its send: no hand-over between threads
            # per chunk (on a busy host each costs a wake-up), and the slot's last send is over
            pack = self._packer(slot, pair, chunk, tensors)
            handle = pair.worker.submit(self._sender(cid, pair, chunk, slot, pack))
            pair.ring.in_flight(chunk.seq, handle)
        handle.add_done_callback(_arrival(barrier, chunk.group))


class ConsumerPushOrdered(ConsumerPush):
    """Every receive from this thread, in plan order (the fleet-wide order)."""

    def _receive(self) -> None:
        timeout = self.config.stall_timeout
        for j, chunk in enumerate(self.chunks):
            target = self.engine._target(j)
            peer = self._pairs[chunk.producer].peer_rank
            what = f"consumer {self.consumer_id} <- producer {chunk.producer} (chunk {chunk.seq})"
            recv_bounded(self.communicator, self._async, target, peer, self.config, what)
            if self._direct[j] is None:  # behind the recv: a blocking one, or on its stream
                self.engine._unpacker(j)()
        self.engine._packed = sum(d is None for d in self._direct)
        self._send_receipts()
        poll = self._fail_on_gone if self.gone is not None else None
        wait_device(self.communicator.device, timeout, f"consumer {self.consumer_id}", poll)

    def _fail_on_gone(self) -> None:
        """Elastic, stream-ordered: a producer of this sync that left the fleet fails it. Every
        pair is abandoned first, so nothing queued on the stream waits on a producer any more
        (the consumer joins its producers again before its next sync)."""
        assert self.gone is not None
        gone = [p for p, pair in sorted(self._pairs.items()) if self.gone(pair.peer_rank)]
        if not gone:
            return
        if self.abandon is not None:
            for pair in self._pairs.values():
                self.abandon(pair.peer_rank)
        raise RuntimeError(
            f"consumer {self.consumer_id}: producer(s) {gone} left the fleet during sync "
            f"{self.engine._syncs}"
        )


class ConsumerPushThreaded(ConsumerPush):
    """A receiver thread per producer takes that producer's chunks in order and unpacks each
    right after it lands; this thread only waits for them, chunk by chunk."""

    def _receive(self) -> None:
        timeout = self.config.stall_timeout
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
        self.engine._packed = sum(d is None for d in self._direct)
        self._send_receipts()
        wait_device(self.communicator.device, timeout, f"consumer {self.consumer_id}")


def reworded(error: Exception, msg: str) -> Exception:
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


def send_bounded(
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


def recv_bounded(
    comm: DeviceCommunicator,
    asynchronous: AsyncSendRecvCommunicator | None,
    tensor: torch.Tensor,
    peer: int,
    config: TransferConfig,
    what: str,
) -> None:
    """``comm.recv``, bounded like ``send_bounded``."""
    if asynchronous is None or tensor.device.type == "cuda":
        comm.recv(tensor, peer)
    else:
        wait_or_stall(asynchronous.irecv(tensor, peer), config.stall_timeout, what)
