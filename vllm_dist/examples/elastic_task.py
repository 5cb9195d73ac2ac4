"""ElasticTransferTask: a launch of producers or consumers that joins a running elastic fleet.

It composes the fleet's membership (``implementations.coordinators``), the communicator and the
elastic engines (``tasks.weight_transfer.elastic``); tasks import no implementation, so the
composition lives here, beside the demo that drives it.

Each launch is its own ``MPLauncher`` (or any launcher) launch: a trainer launch of the ``P``
producers, and any number of consumer launches (an inference replica each, ``workers_per_replica``
workers in slots ``slot .. slot + n - 1``) that come, die and come back while the producers keep
syncing. The fleet's store is served outside every launch (``AuthStoreServer``: a small store
process or the driver), so any launch may die. A consumer reports itself not ready until its
first complete sync (``Member.set_ready``). The hooks are ``WeightTransferTask``'s.

The producers run until ``request_stop`` is set in the store (or ``max_syncs``): producer 0 then
publishes the number of the last sync, and every consumer stops after it. ``request_leave``
lets one consumer leave cleanly between syncs (scale in); a consumer that dies is found by its
lease instead.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from vllm_dist import registry
from vllm_dist.implementations.communicators.common import cuda_device_count
from vllm_dist.implementations.communicators.pair_gloo import PairGlooCommunicator
from vllm_dist.implementations.coordinators.membership import (
    Fleet,
    FleetView,
    Member,
    MemberInfo,
    MembershipConfig,
    MembershipTimeoutError,
)
from vllm_dist.implementations.coordinators.store_coordinator import StoreCoordinator
from vllm_dist.interfaces import DeviceCommunicator
from vllm_dist.tasks.weight_transfer.config import TransferConfig
from vllm_dist.tasks.weight_transfer.elastic import (
    ElasticConsumer,
    ElasticPeers,
    ElasticProducer,
    SlotCoordinator,
    slot_fleet,
    wait_for_producers,
    watch_producers,
)
from vllm_dist.tasks.weight_transfer.task import ConsumerSpec, WeightTransferTask, _token_bytes

STOP_KEY = "wt/stop"
FINAL_KEY = "wt/final"
LEAVE_KEY = "wt/leave"
JOINS_KEY = "wt/joins"  # a consumer publishes how often it joined (a producer restart: again)


@dataclass(frozen=True, kw_only=True, slots=True)
class ElasticSpec:
    """Where a launch finds its elastic fleet and which slots it takes.

    Args:
        host: the fleet store's address.
        port: the fleet store's port.
        role: ``"producer"`` (the trainer launch) or ``"consumer"``.
        slot: the slot of the launch's rank 0 (rank r takes ``slot + r``).
        num_producers: producers of the fleet.
        capacity: consumer slots of the fleet (a multiple of ``workers_per_replica``).
        token: the fleet's secret (hex or bytes, as ``JoinSpec``); never printed.
        membership: heartbeats, leases and message bounds (``MembershipConfig``).
    """

    host: str
    port: int
    role: str
    slot: int
    num_producers: int
    capacity: int
    token: str | bytes = field(repr=False, compare=False)
    membership: MembershipConfig = field(default_factory=MembershipConfig)

    def __post_init__(self) -> None:
        if self.role not in ("producer", "consumer"):
            raise ValueError(f"role must be 'producer' or 'consumer', got {self.role!r}")
        if self.num_producers < 1 or self.capacity < 1 or self.slot < 0:
            raise ValueError("an elastic fleet needs producers, consumer slots and a slot >= 0")
        _token_bytes(self.token, "ElasticSpec(token=...)")

    def secret(self) -> bytes:
        return _token_bytes(self.token, "ElasticSpec(token=...)")


def request_stop(fleet: Fleet) -> None:
    """Ask the producers to end after their next sync (any holder of the secret may)."""
    fleet.store.set(fleet.k(STOP_KEY), b"1")


def request_leave(fleet: Fleet, slot: int) -> None:
    """Ask the consumer in ``slot`` to leave the fleet cleanly after its current sync."""
    fleet.store.set(fleet.k(f"{LEAVE_KEY}/{slot}"), b"1")


def elastic_config(config: TransferConfig | None) -> TransferConfig:
    """``config`` as an elastic fleet runs it: without replayed syncs (a replay waits on every
    consumer at once, and a consumer that left mid-sync must be given up on alone)."""
    return replace(config or TransferConfig(), replay=False)


def elastic_communicator(
    key: registry.CommunicatorKey, device: str | None = None
) -> type[DeviceCommunicator]:
    """The communicator class an elastic fleet uses for ``key`` on ``device`` (None: CUDA where
    there is one): ``torch_distributed`` is a group per pair, as a fleet-wide group takes no new
    member: ``PairGlooCommunicator`` on the CPU, ``PairNcclCommunicator`` on CUDA."""
    cls = registry.get_communicator_class(key)
    if cls is registry.get_communicator_class("torch_distributed"):
        on_cuda = torch.device(device).type == "cuda" if device else cuda_device_count() > 0
        if on_cuda:
            from vllm_dist.implementations.communicators.pynccl.pair import PairNcclCommunicator

            return PairNcclCommunicator
        return PairGlooCommunicator
    if not issubclass(cls, ElasticPeers):
        raise ValueError(
            f"{cls.__name__} cannot take peers in at run time (no add_peer/remove_peer): use "
            "nixl_rdt or torch_distributed for an elastic fleet"
        )
    return cls


class ElasticTransferTask(WeightTransferTask):
    """``launch(..., elastic=ElasticSpec(...), communicator_type=..., device=None,
    communicator_options=None, config=None, pace_s=0.05, max_syncs=100000, **task_kwargs)``.

    Returns per rank a dict: the role, slot, member id, per-sync stats, the hooks' outputs,
    fleet changes seen by producers (``events``), and for a consumer ``started``/``ready``
    (``time.time()`` at its start and at the end of its first complete sync), ``version`` and
    ``errors`` (the failures it joined again after: a producer restart).
    """

    @classmethod
    def check_launch_kwargs(cls, world_size: int, **kwargs: Any) -> None:
        spec = kwargs.get("elastic")
        if not isinstance(spec, ElasticSpec):
            raise TypeError(f"elastic must be an ElasticSpec, got {type(spec).__name__}")
        elastic_communicator(kwargs["communicator_type"], kwargs.get("device"))

    def run(  # type: ignore[override]
        self,
        *,
        elastic: ElasticSpec,
        communicator_type: registry.CommunicatorKey,
        device: str | None = None,
        communicator_options: dict[str, Any] | None = None,
        config: TransferConfig | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        started = time.time()
        info = self.worker_info
        slot = elastic.slot + info.rank
        config = elastic_config(config)
        coord = SlotCoordinator(
            elastic.role,
            slot,
            num_producers=elastic.num_producers,
            capacity=elastic.capacity,
            timeout=config.stall_timeout,
            local_rank=info.local_rank,
            local_world_size=info.local_world_size,
        )
        comm_cls = elastic_communicator(communicator_type, device)
        if elastic.role == "consumer":  # a dead producer fails a wait within about a lease
            comm_cls = watch_producers(comm_cls, coord)
        self.communicator = comm_cls(coord, device=device, **(communicator_options or {}))  # type: ignore[call-arg]
        self.device = self.communicator.device
        fleet = Fleet(elastic.host, elastic.port, elastic.secret(), elastic.membership)
        member = fleet.join(elastic.role, slot)
        coord.attach(member)
        try:
            if elastic.role == "producer":
                out = self._produce(member, coord, config, **kwargs)
            else:
                out = self._consume(member, coord, config, **kwargs)
        finally:
            # off the roster first: producers waiting on this member give up on it at once,
            # not after its data plane is torn down (a NCCL pair's abort may take seconds)
            member.leave()
            self.communicator.close()
        return {**out, "slot": slot, "member": member.id, "started": started}

    def _produce(
        self,
        member: Member,
        coord: SlotCoordinator,
        config: TransferConfig,
        *,
        pace_s: float = 0.05,
        max_syncs: int = 100000,
        **kw: Any,
    ) -> dict[str, Any]:
        pid = coord.get_rank()
        wait_s = member.fleet.config.timeout_s
        producers = wait_for_producers(member, coord.num_producers, wait_s)
        group = StoreCoordinator.from_member(member, producers, timeout=config.stall_timeout)
        source = self.make_source(pid, coord.num_producers, **kw)
        engine = ElasticProducer(
            coord, self.communicator, fleet=slot_fleet(coord), source=source, config=config
        )
        stats: list[dict[str, Any]] = []
        events: list[dict[str, Any]] = []
        try:
            engine.setup_elastic(group)
            while True:
                decision = None
                if pid == 0:
                    stop = member.fleet.peek(STOP_KEY) is not None
                    decision = (member.view(), stop or engine._syncs + 1 >= max_syncs)
                # an all-gather, not a broadcast: the producers move in lockstep (same sync)
                view, last = group.all_gather_object(decision)[0]
                t0 = time.perf_counter()
                changes = engine.reconcile(view)
                if last and pid == 0:
                    member.publish(FINAL_KEY, engine._syncs + 1)
                self.before_producer_sync(engine._syncs, source, **kw)
                admit_s = time.perf_counter() - t0
                stats.append({**engine.sync().as_dict(), "admit_seconds": admit_s})
                lost = engine.drop_lost()
                if any(changes.values()) or lost:
                    events.append(
                        {"sync": engine._syncs, "at": time.time(), **changes, "lost": lost}
                    )
                if last:
                    break
                time.sleep(pace_s)
        finally:
            engine.close()
            group.close()
        return {
            "role": "producer",
            "index": pid,
            "syncs": stats,
            "events": events,
            "setup_seconds": engine.setup_seconds,
            "setup_phases": engine.setup_phases,  # admit's steps included, summed
        }

    def _consume(
        self, member: Member, coord: SlotCoordinator, config: TransferConfig, **kw: Any
    ) -> dict[str, Any]:
        kw.pop("pace_s", None)
        kw.pop("max_syncs", None)
        cid = coord.get_rank() - coord.num_producers
        wait_s = member.fleet.config.timeout_s
        producers = wait_for_producers(member, coord.num_producers, wait_s)
        spec = self.make_consumer(cid, coord.capacity, **kw)
        out: dict[str, Any] = {"role": "consumer", "index": cid, "syncs": [], "outputs": []}
        out.update(ready=None, joins=0, errors=[])
        while True:
            engine = ElasticConsumer(
                coord,
                self.communicator,
                fleet=slot_fleet(coord),
                params=spec.params,
                route=spec.route,
                config=config,
            )
            try:
                engine.join_fleet(producers)
                out["joins"] += 1
                member.publish(f"{JOINS_KEY}/{cid}", out["joins"])
                self._sync_until_done(member, engine, spec, out, kw)
                break
            except Exception as exc:
                out["errors"].append(f"{type(exc).__name__}: {exc}")
                member.set_ready(False)  # torn: no traffic until a whole version again
                restarted = producers_restarted(member, producers, wait_s)
                if restarted is None:
                    raise
                producers = restarted
            finally:
                engine.close()
                out.update(version=engine.version, setup_seconds=engine.setup_seconds)
        out["first_sync"] = out["syncs"][0]["seconds"] if out["syncs"] else None
        return out

    def _sync_until_done(
        self,
        member: Member,
        engine: ElasticConsumer,
        spec: ConsumerSpec,
        out: dict[str, Any],
        kw: dict[str, Any],
    ) -> None:
        """Sync until asked to leave or past the producers' last sync; ready after the first."""
        cid = engine.consumer_id
        first = True
        while True:
            step = engine._syncs
            self.before_consumer_sync(step, spec, **kw)
            out["syncs"].append({**engine.sync().as_dict(), "at": time.time()})
            out["outputs"].append(self.after_consumer_sync(step, spec, **kw))
            if first:
                member.set_ready(True)
                out["ready"] = out["ready"] or time.time()
                first = False
            if member.fleet.peek(f"{LEAVE_KEY}/{cid}") is not None:
                member.fleet.store.delete_key(member.fleet.k(f"{LEAVE_KEY}/{cid}"))
                return
            final = member.fleet.peek(f"pub/{FINAL_KEY}")
            if final is not None and engine._syncs >= int(member.read(FINAL_KEY, 5.0)):
                return


def producers_restarted(
    member: Member, producers: list[MemberInfo], timeout: float
) -> list[MemberInfo] | None:
    """After a failed sync or join: None when every producer of ``producers`` is still live (the
    failure was not theirs); else the new producers, once a whole new set is live (a producer
    launch restarted from its checkpoint)."""
    old = {m.id for m in producers}
    lease = member.fleet.config.lease_s
    try:  # a transport sees a dead peer before its lease runs out
        member.fleet.wait_for(lambda v: not old <= set(v.ids()), 2 * lease + 1.0)
    except MembershipTimeoutError:
        return None
    count = len(producers)

    def renewed(view: FleetView) -> bool:
        live = view.role("producer")
        return len(live) == count and not old & {m.id for m in live}

    return member.fleet.wait_for(renewed, timeout).role("producer")
