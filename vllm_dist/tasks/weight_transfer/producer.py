"""``WeightProducer``: serves a ``WeightSource`` to the fleet's consumers.

Set-up, collective over the coordinator: producers all-gather their metadata and held names and
every rank builds the same ``ModelIndex``; each consumer sends every producer the requests routed
to it with a plan digest; the producer checks them (``PlanCheck``), rebuilds the pair's plan and
compares digests; everyone all-gathers the verdicts, so a refusal anywhere fails every rank. A
sync walks the schedule group by group and hands each chunk to the data path chosen at
construction (``paths``): one-sided READ where the communicator offers it, else push.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from vllm_dist.interfaces import DeviceCommunicator, WorkerCoordinator
from vllm_dist.interfaces.dataplane import AsyncSendRecvCommunicator
from vllm_dist.tasks import step_record
from vllm_dist.tasks.weight_transfer import progress
from vllm_dist.tasks.weight_transfer._memory import shared_empty
from vllm_dist.tasks.weight_transfer.config import (
    Fleet,
    SyncStats,
    TransferConfig,
    WeightTransferSetupError,
)
from vllm_dist.tasks.weight_transfer.exposure import Exposures, share_source
from vllm_dist.tasks.weight_transfer.index import ModelIndex, ProducerFacts
from vllm_dist.tasks.weight_transfer.messages import AdmitMessage, PlanMessage
from vllm_dist.tasks.weight_transfer.onesided import ring_name
from vllm_dist.tasks.weight_transfer.ops import UnsafeOpError
from vllm_dist.tasks.weight_transfer.pairs import PackPlan, ProducerPair
from vllm_dist.tasks.weight_transfer.paths.base import ProducerPath
from vllm_dist.tasks.weight_transfer.paths.push import (
    ProducerPushOrdered,
    ProducerPushThreaded,
    reworded,
)
from vllm_dist.tasks.weight_transfer.paths.read_producer import ProducerRead
from vllm_dist.tasks.weight_transfer.plan import (
    PlanMismatchError,
    Request,
    buffer_alloc_bytes,
    cut_chunks,
    decode_requests,
    plan_digest,
    slot_bytes,
)
from vllm_dist.tasks.weight_transfer.ring import FreeBarrier, ServeRing
from vllm_dist.tasks.weight_transfer.setup import (
    EngineBase,
    PlanCheck,
    gather_verdicts,
    gc_paused,
    item_table,
    pair_layout,
    shared_splits,
)
from vllm_dist.tasks.weight_transfer.source import WeightSource
from vllm_dist.tasks.weight_transfer.views import ViewCache


class WeightProducer(EngineBase):
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
        self._generation = 0  # serve rings exposed by ``admit``
        self._pairs: dict[int, ProducerPair] = {}
        self._views = ViewCache()
        self._group_counts: dict[int, int] = {}
        self._group_names: dict[int, list[str]] = {}
        self._group_order: list[int] = []
        self._served_names: list[str] = []
        self._sync_bytes = 0
        self._exposures: Exposures | None = None
        self._read: ProducerRead | None = None
        # admit(): producer 0 sends the producers' facts to a joining consumer (False: the
        # consumer had them already, see WeightConsumer.prepare_join)
        self.ship_facts = True
        self._path: ProducerPath
        if self._one_sided is not None:
            self._exposures = Exposures(self._one_sided)
            self._path = self._read = ProducerRead(self, self._one_sided, self._exposures)
        else:
            asynchronous = (
                communicator if isinstance(communicator, AsyncSendRecvCommunicator) else None
            )
            push = ProducerPushThreaded if self._threads else ProducerPushOrdered
            self._path = push(self, asynchronous)
        self._checks = PlanCheck(self.producer_id, self.layout, self._shapes)

    @gc_paused
    def setup(self) -> None:
        """Join the fleet's set-up; raises on any rank's refusal (see module docstring)."""
        start = self._phase_start = time.perf_counter()
        held = self.source.held_names()
        facts = ProducerFacts(
            metadata=tuple(self.source.metadata()), held=held, ships_metadata=self.producer_id == 0
        )
        index = self._index(facts)
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
        gather_verdicts(self.coordinator, error)
        self._build_schedule()
        self._phase("verdicts, schedule")
        self._share_weights()
        if self._read is not None:
            self._read.expose_rings()
            self._phase("expose")
        self.setup_seconds = time.perf_counter() - start
        progress.setup_done(self)

    def _share_weights(self) -> None:
        """``TransferConfig.share_cpu_weights`` / ``share_gpu_weights``: at set-up, before any
        address is recorded."""
        kind = self.communicator.device.type
        wanted = {"cpu": self.config.share_cpu_weights, "cuda": self.config.share_gpu_weights}
        if not (
            self._read is not None
            and wanted.get(kind, False)
            and self.source.resident
            and any(pair.maps for pair in self._pairs.values())
        ):
            return
        tensors = self.source.current(self._served_names)
        if tensors is None:
            return
        pairs = self._pairs.values()
        device = self.communicator.device
        self.shared_bytes = share_source(tensors, self._served_names, pairs, device, self.arenas)
        self._phase("share weights")

    @gc_paused
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
        self._phase_start = time.perf_counter()  # admit's steps add up in setup_phases
        facts = self.producer_facts if self.producer_id == 0 and self.ship_facts else None
        self.coordinator.send_object(AdmitMessage(self.producer_id, self._syncs, facts), crank)
        plan_msg = self.coordinator.recv_object(crank)
        reserve_msg = self.coordinator.recv_object(crank)
        self._phase("admit: wait for the plan")
        self._drop_pair(consumer_id)
        error: Exception | None = None
        try:
            self._accept(consumer_id, crank, index, plan_msg, reserve_msg)
        except Exception as exc:  # reported to the consumer, then raised here
            error = exc
        self._phase("admit: check the plan")
        self.coordinator.send_object(
            None if error is None else f"{type(error).__name__}: {error}", crank
        )
        verdict = self.coordinator.recv_object(crank)  # the consumer's: every producer agreed?
        if error is not None or verdict is not None:
            self._drop_pair(consumer_id)
            self._pairs[consumer_id] = ProducerPair(peer_rank=crank, chunks=[], slot_bytes=0)
            self._build_schedule()
            if error is not None:
                raise error
            raise WeightTransferSetupError(f"consumer {consumer_id} was not admitted: {verdict}")
        self._build_schedule()
        pair = self._pairs[consumer_id]
        if self._exposures is not None and pair.ring is not None:
            self._generation += 1
            name = f"{ring_name(self.producer_id, consumer_id)}-g{self._generation}"
            desc = self._exposures.expose(pair.ring.buffer, name)
            pair.remote_name = name
            self.coordinator.send_object(desc, crank)
        self._phase("admit: verdicts, ring")

    def _drop_pair(self, consumer_id: int) -> None:
        """Release what this producer holds for one consumer (its ring, sender, exposure)."""
        pair = self._pairs.pop(consumer_id, None)
        if pair is None:
            return
        pair.close()
        name = pair.remote_name or ring_name(self.producer_id, consumer_id)
        if pair.ring is not None and self._exposures is not None and name in self._exposures:
            self._exposures.unexpose(name)

    def _accept(
        self, cid: int, crank: int, index: ModelIndex, plan_msg: Any, reserve_msg: Any
    ) -> None:
        if not isinstance(plan_msg, PlanMessage) or plan_msg.consumer_id != cid:
            raise RuntimeError(f"expected a plan from consumer {cid}, got {plan_msg!r:.80}")
        payload, path = plan_msg.requests, plan_msg.path
        strided, maps = plan_msg.strided, plan_msg.maps
        if isinstance(payload, str):  # the consumer failed its own set-up
            self._pairs[cid] = ProducerPair(peer_rank=crank, chunks=[], slot_bytes=0)
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
        pos = self._checks.check_names(cid, index, names)
        sizes = self._checks.check_kinds(cid, index, kinds, names, ids, pos)
        layout = pair_layout(self.layout, strided is True)  # strided reads: see there
        chunks = cut_chunks(
            index.group_ids[pos],
            index.class_ids[pos],
            np.full(len(pos), self.producer_id),
            sizes[ids],
            layout,
        )
        encoded = (kinds, names, ids.tobytes())
        digest = plan_digest(cid, self.producer_id, chunks, encoded, index.router, layout)
        self._checks.compare(cid, chunks, digest, reserve_msg)
        slot = slot_bytes(chunks, self.producer_id, self.layout.align)
        pair = ProducerPair(peer_rank=crank, chunks=chunks, slot_bytes=slot, names=names)
        pair.strided = self._read is not None and strided is True
        pair.maps = pair.strided and maps is True
        items = item_table([Request("", *k) for k in kinds])
        prefixes = shared_splits([Request("", *k) for k in kinds], 0)
        id_list = ids.tolist()
        pair.items = [items[k] for k in id_list]
        pair.prefixes = [prefixes[k] for k in id_list]
        pair.views = {
            c.index: PackPlan(
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
            pair.worker = self._path.pair_worker(cid)
        self._pairs[cid] = pair

    def _build_schedule(self) -> None:
        self._schedule = self._path.schedule(self._pairs)
        for pair in self._pairs.values():
            pair.sync_bytes = sum(c.nbytes for c in pair.chunks)
        self._group_counts = {}
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

    @gc_paused
    def sync(self) -> SyncStats:
        """Serve one version of the weights to every consumer; returns this rank's stats."""
        start = time.perf_counter()
        if self.trace is not None:
            self.trace.clear()
        step_record.sync_begins(self)
        self.source.begin_sync()
        self._syncs += 1
        self._packed = 0
        path = self._path
        replayed = path.begin(start)
        if replayed is not None:
            step_record.synced(self)
            return replayed
        barrier = FreeBarrier(self._group_counts)
        serve = path.serve
        opened: dict[int, Mapping[str, torch.Tensor]] = {}
        moved = 0
        path.reset()
        for g, cid, i in self._schedule:
            self._release(barrier, opened)
            if g not in opened:
                path.new_group(barrier)
                self._mark(f"open {g}")
                opened[g] = self.source.open_group(self._group_names[g])
                path.opened(g, opened[g])
                self._mark(f"opened {g}")
            pair = self._pairs[cid]
            chunk = pair.chunks[i]
            step_record.serving(self, g, cid)
            serve(cid, pair, chunk, opened[g], barrier)
            moved += chunk.nbytes
        self._mark("drain")
        path.finish(barrier)
        self._release(barrier, opened)
        self._raise_pair_errors()
        self._mark("end")
        path.end()
        step_record.synced(self)
        return SyncStats(
            seconds=time.perf_counter() - start,
            bytes=moved,
            chunks=len(self._schedule),
            path=self.path,
            packed=self._packed,
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
            raise reworded(error, msg)

    def _release(self, barrier: FreeBarrier, opened: dict[int, Mapping[str, torch.Tensor]]) -> None:
        for g in barrier.pop_free():
            if opened.pop(g, None) is not None:
                self.source.release_group(self._group_names[g])

    def close(self) -> None:
        """Stop the pairs' threads and unexpose everything this producer exposed."""
        for pair in self._pairs.values():
            pair.close()
        self._pairs.clear()
        self._path.close()
        if self._exposures is not None:
            self._exposures.close()
