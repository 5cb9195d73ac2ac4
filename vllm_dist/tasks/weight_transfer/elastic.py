"""Weight transfer over a fleet whose consumers come and go: the engines on fleet membership.

The engines keep their fixed ranks: rank ``p < P`` is producer ``p`` and rank ``P + s`` is
consumer slot ``s`` of a fleet of ``capacity`` slots. ``SlotCoordinator`` sends a rank's
messages to whichever member (``role/slot#incarnation``) holds that slot now, so the existing
late-join path (``WeightProducer.admit`` / ``WeightConsumer.join``) runs over fleet messages
instead of a process group, and a replacement's plan is never confused with the dead one's.

Between syncs the producers agree on one roster (producer 0's, broadcast), drop the pairs of
consumers that left (ring, exposures, NIXL peer) and admit the new ones one at a time; only
those pairs are planned again. Routing depends on ``consumer slot % workers_per_replica`` only
(``RdtRouter``), so a replica that joins or leaves changes no other pair's plan. Mid-sync, a
consumer that leaves is given up on (``ProducerRead.lost``) and the others are served on.
Rejected alternative: a new coordinator and communicator over every epoch's members, which
would re-plan and re-expose every pair and stall every consumer at each change.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from vllm_dist.interfaces import CoordinatorTimeoutError, WorkerCoordinator
from vllm_dist.tasks.weight_transfer.config import (
    Fleet,
    SyncStats,
    TornModelError,
    WeightTransferSetupError,
)
from vllm_dist.tasks.weight_transfer.consumer import WeightConsumer, torn_error
from vllm_dist.tasks.weight_transfer.index import ProducerFacts
from vllm_dist.tasks.weight_transfer.paths.base import ConsumerPath
from vllm_dist.tasks.weight_transfer.paths.push import ConsumerPush, ProducerPush
from vllm_dist.tasks.weight_transfer.producer import WeightProducer

logger = logging.getLogger("vllm_dist")

# A fleet member (``membership.Member``), its roster entries (``MemberInfo``) and views
# (``FleetView``), used by their attributes only: tasks import no implementation.
Member = Any
MemberInfo = Any
FleetView = Any

PEER_CHANNEL = "peer"  # data-plane peer introductions (agent metadata)
ENGINE_CHANNEL = "wt"  # the engines' control messages (admit, plans, verdicts, descriptors)
VIEW_CACHE_S = 0.2  # how stale a roster read may be when asking whether a peer is gone
FACTS_NAME = "wt/facts"  # producer 0 publishes (its member id, the producers' facts) under it


class SlotVacantError(RuntimeError):
    """A message was for (or from) a slot that no live member holds."""


class ProducerGoneError(RuntimeError):
    """A producer a consumer syncs from is no longer a live member (its lease ran out)."""


@runtime_checkable
class ElasticPeers(Protocol):
    """A communicator that takes peers in and lets them go at run time (``nixl_rdt``)."""

    def peer_info(self) -> Any:
        """What a new peer loads (``add_peer``) to reach this worker."""

    def add_peer(self, rank: int, info: Any) -> None:
        """Reach the worker that now holds ``rank`` (its ``peer_info()``)."""

    def remove_peer(self, rank: int) -> None:
        """Forget ``rank``: it left; release what was held for it."""


class SlotCoordinator(WorkerCoordinator):
    """Fixed ranks over the slots of an elastic fleet; messages go to the slot's current holder.

    Rank ``p < num_producers`` is ``producer/p``, rank ``num_producers + s`` is ``consumer/s``.
    ``bind(rank, member_id)`` pins the incarnation a rank's messages go to and come from (the
    producers bind a consumer when they admit it); an unbound rank resolves through the roster.
    Members meet pairwise, never collectively: ``all_gather_object`` returns this worker's
    object alone (``None`` at every other rank) and ``barrier``/``broadcast_object`` refuse.
    """

    def __init__(
        self,
        role: str,
        slot: int,
        *,
        num_producers: int,
        capacity: int,
        timeout: float = 60.0,
        local_rank: int = 0,
        local_world_size: int = 1,
    ) -> None:
        if role not in ("producer", "consumer") or num_producers < 1 or capacity < 1:
            raise ValueError(
                f"role={role!r}, num_producers={num_producers}, capacity={capacity}: a "
                "producer or consumer of a fleet of at least one of each"
            )
        limit = num_producers if role == "producer" else capacity
        if not 0 <= slot < limit:
            raise ValueError(f"{role} slot {slot} is outside 0..{limit - 1}")
        self.num_producers = num_producers
        self.capacity = capacity
        self.timeout = timeout
        self._local = (local_rank, local_world_size)  # within the worker's own launch
        self.member: Member | None = None
        self._rank = slot if role == "producer" else num_producers + slot
        self._bound: dict[int, str] = {}
        self._view: tuple[float, FleetView] | None = None

    def attach(self, member: Member) -> None:
        """Speak as ``member`` (joined once the data plane was made, so peers never wait)."""
        if self.slot_key(self._rank) != member.info.slot_key:
            raise ValueError(f"{member.id} does not hold {self.slot_key(self._rank)}")
        self.member = member

    def slot_key(self, rank: int) -> str:
        """``role/slot`` of fleet rank ``rank``."""
        p = self.num_producers
        return f"producer/{rank}" if rank < p else f"consumer/{rank - p}"

    def bind(self, rank: int, member_id: str) -> None:
        self._bound[rank] = member_id

    def unbind(self, rank: int) -> None:
        self._bound.pop(rank, None)

    def bound(self, rank: int) -> str | None:
        return self._bound.get(rank)

    def view(self, max_age: float = 0.0) -> FleetView:
        """The roster, read again when the last read is older than ``max_age`` seconds."""
        now = time.monotonic()
        if self._view is None or now - self._view[0] > max_age:
            self._view = (now, self._require().view())
        return self._view[1]

    def holder(self, rank: int) -> str:
        """The member id ``rank``'s messages go to: the bound one, else the slot's live one."""
        member_id = self._bound.get(rank)
        if member_id is not None:
            return member_id
        key = self.slot_key(rank)
        live = [m for m in self.view().members if m.slot_key == key]
        if not live:
            raise SlotVacantError(f"no live member holds {key} (rank {rank})")
        return live[0].id

    def producers_gone(self) -> list[str]:
        """The member ids of the bound producers no longer live (roster at most
        ``VIEW_CACHE_S`` old)."""
        ids = [self._bound.get(p) for p in range(self.num_producers)]
        view = self.view(VIEW_CACHE_S)
        return [i for i in ids if i is not None and view.find(i) is None]

    def gone(self, rank: int) -> bool:
        """Whether the member bound to ``rank`` is no longer live (roster at most
        ``VIEW_CACHE_S`` old)."""
        member_id = self._bound.get(rank)
        return member_id is not None and self.view(VIEW_CACHE_S).find(member_id) is None

    def _require(self) -> Member:
        if self.member is None:
            raise RuntimeError("SlotCoordinator: attach(member) first")
        return self.member

    # -- WorkerCoordinator -----------------------------------------------------------------------
    def initialize(self) -> None:
        return None

    def get_rank(self) -> int:
        return self._rank

    def get_world_size(self) -> int:
        return self.num_producers + self.capacity

    def get_local_rank(self) -> int:
        return self._local[0]

    def get_local_world_size(self) -> int:
        return self._local[1]

    def get_global_ranks(self) -> list[int]:
        return list(range(self.get_world_size()))

    def barrier(self, timeout: float | None = None) -> None:
        raise NotImplementedError("an elastic fleet has no fleet-wide barrier; use the roster")

    def broadcast_object(self, obj: Any, src: int) -> Any:
        raise NotImplementedError("an elastic fleet has no fleet-wide broadcast; use publish")

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.get_world_size()
        out[self._rank] = obj
        return out

    def send_object(self, obj: Any, dst: int) -> None:
        self._require().send(self.holder(dst), obj, channel=ENGINE_CHANNEL)

    def recv_object(self, src: int) -> Any:
        return self._require().recv(self.holder(src), self.timeout, channel=ENGINE_CHANNEL)

    def new_group(self, ranks: Sequence[int]) -> WorkerCoordinator:
        raise NotImplementedError("an elastic fleet makes sub-groups per epoch (StoreCoordinator)")

    def close(self) -> None:
        self.member = None


def slot_fleet(coordinator: SlotCoordinator) -> Fleet:
    """The engines' ``Fleet`` over every slot (producers first)."""
    return Fleet.split(coordinator.num_producers, coordinator.capacity)


def _peers_of(engine: WeightProducer | WeightConsumer) -> ElasticPeers | None:
    comm = engine.communicator
    return comm if isinstance(comm, ElasticPeers) else None


class ElasticProducer(WeightProducer):
    """A producer of an elastic fleet: ``setup_elastic`` once, then ``reconcile`` (between
    syncs, the same roster on every producer) and ``sync`` in turn.

    Its coordinator must be a ``SlotCoordinator`` attached to this producer's member.
    """

    coordinator: SlotCoordinator

    def setup_elastic(self, producers: WorkerCoordinator) -> None:
        """The index from every producer's facts (gathered over ``producers``, a coordinator
        of the producers alone); no consumer yet: each is admitted as it joins."""
        start = self._phase_start = time.perf_counter()
        facts = ProducerFacts(metadata=tuple(self.source.metadata()), held=self.source.held_names())
        self._build_index(producers.all_gather_object(facts))
        if self.producer_id == 0:  # newcomers plan against these before they are admitted
            member = self.coordinator._require()
            member.publish(FACTS_NAME, (member.id, self.producer_facts))
        self.ship_facts = False
        self._build_schedule()
        if self._read is not None:
            self._read.gone = self.coordinator.gone
        elif isinstance(self._path, ProducerPush):  # stream-ordered: give up on the gone
            peers = _peers_of(self)
            self._path.gone = self.coordinator.gone
            self._path.abandon = None if peers is None else peers.remove_peer
        self._refused: set[str] = set()  # members that failed their admission: never again
        self._phase("index")
        self.setup_seconds = time.perf_counter() - start

    def reconcile(self, view: FleetView) -> dict[str, list[str]]:
        """Drop the pairs of consumers no longer in ``view``, admit the new ones (by slot);
        returns the member ids ``{"left": [...], "joined": [...], "refused": [...]}``."""
        coord = self.coordinator
        live = {m.slot: m for m in view.role("consumer") if m.slot < coord.capacity}
        out: dict[str, list[str]] = {"left": [], "joined": [], "refused": []}
        for cid in range(coord.capacity):
            rank = coord.num_producers + cid
            bound = coord.bound(rank)
            if bound is not None and (cid not in live or live[cid].id != bound):
                self.retire(cid)
                out["left"].append(bound)
        for cid, m in sorted(live.items()):
            if coord.bound(coord.num_producers + cid) is None and m.id not in self._refused:
                ok = self._welcome(cid, m)
                out["joined" if ok else "refused"].append(m.id)
        return out

    def retire(self, cid: int) -> None:
        """Release what this producer holds for consumer ``cid``: its ring, exposures, sender
        thread and data-plane peer; the schedule is rebuilt without it."""
        rank = self.coordinator.num_producers + cid
        self._drop_pair(cid)
        peers = _peers_of(self)
        if peers is not None:
            peers.remove_peer(rank)
        self.coordinator.unbind(rank)
        self._build_schedule()

    def _welcome(self, cid: int, m: MemberInfo) -> bool:
        """Introduce the data planes, then ``admit``; False (logged) when it failed."""
        coord, rank = self.coordinator, self.coordinator.num_producers + cid
        member = coord._require()
        coord.bind(rank, m.id)
        try:
            info = member.recv(m, coord.timeout, channel=PEER_CHANNEL)
            peers = _peers_of(self)
            # ours first: adding a peer may be a rendezvous with it (a pair gloo group)
            member.send(m, None if peers is None else peers.peer_info(), channel=PEER_CHANNEL)
            if peers is not None:
                peers.add_peer(rank, info)
            self.admit(cid)
        except Exception as exc:  # logged; the others are served on
            logger.warning(
                "vllm_dist: producer %d: %s was not admitted: %s: %s",
                self.producer_id, m.id, type(exc).__name__, exc,
            )  # fmt: skip
            if not isinstance(exc, CoordinatorTimeoutError):  # a slow one is tried again
                self._refused.add(m.id)
            self.retire(cid)
            return False
        return True

    def sync(self) -> SyncStats:
        """``WeightProducer.sync``; on the push path a sync that failed only for consumers that
        left the fleet (within a lease or two) counts them lost and returns."""
        self._push_lost: set[int] = set()
        try:
            return super().sync()
        except Exception:
            failed = [cid for cid, pair in self._pairs.items() if pair.error is not None]
            if self._read is not None or not failed or not self._all_gone(failed):
                raise
            self._push_lost = set(failed)
            return SyncStats(seconds=0.0, bytes=0, chunks=0, path=self.path)

    def _all_gone(self, cids: list[int]) -> bool:
        """Whether every consumer of ``cids`` left the fleet, waiting up to two leases."""
        coord, member = self.coordinator, self.coordinator._require()
        deadline = time.monotonic() + 2 * member.fleet.config.lease_s
        ranks = [coord.num_producers + cid for cid in cids]
        while not all(coord.gone(r) for r in ranks):
            if time.monotonic() > deadline:
                return False
            time.sleep(VIEW_CACHE_S)
        return True

    def drop_lost(self) -> list[str]:
        """Retire the consumers the last sync gave up on (they left mid-sync); their member
        ids, which are never admitted again."""
        lost = sorted(self._read.lost) if self._read is not None else []
        lost = sorted({*lost, *getattr(self, "_push_lost", ())})
        ids = []
        for cid in lost:
            member_id = self.coordinator.bound(self.coordinator.num_producers + cid)
            if member_id is not None:
                ids.append(member_id)
                self._refused.add(member_id)
            self.retire(cid)
        return ids


class ElasticConsumer(WeightConsumer):
    """A consumer of an elastic fleet: ``join_fleet`` (while the producers ``admit`` it), then
    ``sync``. Its coordinator must be a ``SlotCoordinator`` attached to its member."""

    coordinator: SlotCoordinator

    def join_fleet(self, producers: list[MemberInfo]) -> None:
        """Introduce this worker's data plane to every producer, learn theirs, then ``join``."""
        coord = self.coordinator
        member = coord._require()
        if len(producers) != coord.num_producers:
            raise WeightTransferSetupError(
                f"the fleet has {len(producers)} producers live, the deployment names "
                f"{coord.num_producers}: wait for every producer before joining"
            )
        # planned ahead against producer 0's published facts: admission then holds the
        # producers (and so the other consumers' next sync) only while the plan is checked
        self.prepare_join(published_facts(member, producers[0].id, coord.timeout))
        peers = _peers_of(self)
        for m in producers:
            coord.bind(m.slot, m.id)
            member.send(m, None if peers is None else peers.peer_info(), channel=PEER_CHANNEL)
        for m in producers:
            info = member.recv(m, coord.timeout, channel=PEER_CHANNEL)
            if peers is not None:
                peers.add_peer(m.slot, info)
        self.join()

    def _make_rings(self) -> ConsumerPath:
        """The data path; on the stream-ordered push path a producer that left fails the sync
        within about a lease (its pair abandoned), not after the stall timeout."""
        path = super()._make_rings()
        if isinstance(path, ConsumerPush):
            peers = _peers_of(self)
            path.gone = self.coordinator.gone
            path.abandon = None if peers is None else peers.remove_peer
        return path

    def sync(self) -> SyncStats:
        """``WeightConsumer.sync``; a sync that failed while a producer died (a transport that
        saw it first, within two leases) names that producer in its ``TornModelError``."""
        try:
            return super().sync()
        except TornModelError as exc:
            if isinstance(exc.__cause__, ProducerGoneError):
                raise
            lease = self.coordinator._require().fleet.config.lease_s
            deadline = time.monotonic() + 2 * lease
            while not (gone := self.coordinator.producers_gone()):
                if time.monotonic() > deadline:
                    raise
                time.sleep(VIEW_CACHE_S)
            why = ProducerGoneError(
                f"producer(s) {', '.join(gone)} no longer live members of the fleet "
                f"({type(exc.__cause__).__name__}: {exc.__cause__})"
            )
            raise torn_error(
                self.consumer_id, exc.target, exc.held, why, intact=not self.torn
            ) from exc


def watch_producers(cls: type[Any], coordinator: SlotCoordinator) -> type[Any]:
    """``cls`` (a consumer's communicator) whose waits for a producer's notification are cut
    into short slices between which the roster is asked whether that producer is still live:
    a dead producer fails the wait (``ProducerGoneError``) within about a lease, not after the
    stall timeout. A class without ``wait_notification`` is returned as is."""
    if not hasattr(cls, "wait_notification"):
        return cls

    class WatchedProducers(cls):  # type: ignore[misc, valid-type]
        def wait_notification(self, peer: int, timeout: float | None = None) -> Any:
            wait = super().wait_notification
            if timeout is None or timeout <= VIEW_CACHE_S or peer >= coordinator.num_producers:
                return wait(peer, timeout)
            deadline = time.monotonic() + timeout
            while True:
                left = deadline - time.monotonic()
                try:
                    return wait(peer, max(min(left, VIEW_CACHE_S), 0.0))
                except TimeoutError:
                    if coordinator.gone(peer):
                        raise ProducerGoneError(
                            f"producer {peer} ({coordinator.bound(peer)}) is no longer a live "
                            "member of the fleet (its lease ran out)"
                        ) from None
                    if left <= VIEW_CACHE_S:
                        raise

    WatchedProducers.__name__ = WatchedProducers.__qualname__ = cls.__name__
    return WatchedProducers


def published_facts(member: Member, producer0: str, timeout: float) -> list[ProducerFacts]:
    """The producers' facts as producer 0 (member ``producer0``) published them, waiting for
    its publication (an earlier producer 0's is skipped) up to ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            who, facts = member.read(FACTS_NAME, max(deadline - time.monotonic(), 0.0))
        except Exception:  # none yet, or a dead producer 0's (refused as stale): wait on
            if time.monotonic() > deadline:
                raise
            who, facts = None, None
        if who == producer0:
            return list(facts)
        if time.monotonic() > deadline:
            raise CoordinatorTimeoutError(
                f"producer 0 ({producer0}) published no facts within {timeout} s"
            )
        time.sleep(VIEW_CACHE_S)


def wait_for_producers(member: Member, num_producers: int, timeout: float) -> list[MemberInfo]:
    """The fleet's producers once all ``num_producers`` are live (a ``CoordinatorTimeoutError``
    when they are not within ``timeout``)."""
    view = member.fleet.wait_for(lambda v: len(v.role("producer")) >= num_producers, timeout)
    producers = view.role("producer")
    if len(producers) < num_producers:
        raise CoordinatorTimeoutError(f"only {len(producers)} of {num_producers} producers live")
    return producers
