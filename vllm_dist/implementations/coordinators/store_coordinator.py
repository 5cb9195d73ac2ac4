"""StoreCoordinator: the control plane over the fleet store, with no process group.

A coordinator is a fixed snapshot of the fleet's roster: rank i is the i-th member in (role,
slot) order at one epoch. Every collective is keys in the authenticated store (a barrier is one
key per rank, a broadcast one value, an all-gather one value per rank; the last reader deletes
them), every payload is tagged like a fleet message and checked before unpickling, and every
wait is cut into short store waits between which the roster is read: a member that died, left
or was replaced is named at once instead of after the timeout. Nothing process-global is
touched, so any number of coordinators live in one process. When membership changes, build a
new coordinator over the new view (``from_member``); the old one fails fast naming the gone.

Rejected alternative: a gloo group per epoch, which a dead member breaks and which every member
must rebuild together.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import time
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from vllm_dist.implementations.coordinators.auth_store import AuthStoreServer
from vllm_dist.implementations.coordinators.membership import (
    POLL_S,
    Fleet,
    FleetView,
    Member,
    MemberInfo,
    MembershipConfig,
    PeerGoneError,
    seal,
    unseal,
)
from vllm_dist.implementations.coordinators.torch_distributed import check_group_ranks
from vllm_dist.interfaces import (
    CoordinatorTimeoutError,
    RendezvousPortTakenError,
    WorkerCoordinator,
    WorkerInfo,
)
from vllm_dist.interfaces.launcher import SECRET_ENV

DEFAULT_TIMEOUT_S = 300.0
_ROLE = "rank"  # the role of a launch's workers in its own fleet


class StoreCoordinator(WorkerCoordinator):
    """A coordinator over a fixed snapshot of fleet members.

    Built by the registry as ``StoreCoordinator(worker_info, timeout=...)``: rank 0 serves the
    store on ``master_addr:master_port``, every worker joins as ``rank``/``<its rank>`` and the
    group is the ``world_size`` members. ``from_member(member, members)`` builds one over any
    members of a running fleet.

    Args:
        worker_info: this worker's place in the launch; it must carry the launch secret.
        timeout: seconds any operation may wait for a peer.
        heartbeat_interval_s, lease_s: the membership's (``MembershipConfig``).
    """

    def __init__(
        self,
        worker_info: WorkerInfo | None,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        heartbeat_interval_s: float = 1.0,
        lease_s: float = 10.0,
    ) -> None:
        self._info = worker_info
        self._timeout = timeout
        self._config = MembershipConfig(
            fleet=f"launch-{worker_info.launch_id}"
            if worker_info and worker_info.launch_id
            else "launch",
            heartbeat_interval_s=heartbeat_interval_s,
            lease_s=lease_s,
            timeout_s=timeout,
        )
        self._member: Member | None = None
        self._server: AuthStoreServer | None = None
        self._members: list[MemberInfo] = []
        self._global_ranks: list[int] = []
        self._scope = ""
        self._ops = 0
        self._group_counts: dict[tuple[int, ...], int] = {}
        self._children: list[StoreCoordinator] = []
        self._owns_member = False
        self._closed = False

    @classmethod
    def from_member(
        cls,
        member: Member,
        members: Sequence[MemberInfo],
        *,
        name: str = "",
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> StoreCoordinator:
        """A coordinator over ``members`` (sorted by (role, slot); ``member`` among them), which
        every one of them builds with the same list, for example ``view.role("consumer")``.
        ``name`` tells apart coordinators built more than once over the same members."""
        if "/" in name:
            raise ValueError(f"name={name!r}: a name without '/'")
        coord = cls(None, timeout=timeout)
        coord._adopt(member, sorted(members, key=lambda m: (m.role, m.slot)))
        coord._scope += f"/{name}" if name else ""
        return coord

    def _adopt(self, member: Member, members: list[MemberInfo]) -> None:
        if member.info.id not in [m.id for m in members]:
            raise ValueError(f"{member.id} is not one of the group's members {members}")
        self._member = member
        self._members = members
        self._global_ranks = list(range(len(members)))
        self._scope = "g/" + ",".join(m.id for m in members)

    # -- set-up ----------------------------------------------------------------------------------
    def initialize(self) -> None:
        if self._member is not None:
            return
        info = self._info
        assert info is not None
        if not info.secret:
            raise ValueError(
                f"the store coordinator needs the launch secret; set {SECRET_ENV} for workers "
                "that torchrun, srun or mpirun starts (MPLauncher and RayLauncher hand one over)"
            )
        if info.rank == 0:
            try:
                self._server = AuthStoreServer(info.master_addr, info.master_port, info.secret)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
                raise RendezvousPortTakenError(
                    f"rank 0: port {info.master_port} on {info.master_addr} is held by another "
                    f"process; pick a free port: {exc}",
                    port=info.master_port,
                ) from exc
        try:
            fleet = Fleet(info.master_addr, info.master_port, info.secret, self._config)
            member = fleet.join(_ROLE, info.rank)
        except (ConnectionError, OSError, dist.DistStoreError) as exc:
            self._close_server()
            raise CoordinatorTimeoutError(
                f"rank {info.rank}: could not join the store at {info.master_addr}:"
                f"{info.master_port} within {self._timeout} s: {exc}"
            ) from exc
        try:
            view = fleet.wait_for(lambda v: len(v.role(_ROLE)) >= info.world_size, self._timeout)
        except TimeoutError as exc:
            member.leave()
            self._close_server()
            raise CoordinatorTimeoutError(
                f"rank {info.rank}: the launch's {info.world_size} workers did not all join the "
                f"store at {info.master_addr}:{info.master_port} within {self._timeout} s: {exc}"
            ) from exc
        self._adopt(member, view.role(_ROLE)[: info.world_size])
        self._owns_member = True

    # -- rank facts ------------------------------------------------------------------------------
    def get_rank(self) -> int:
        return [m.id for m in self._members].index(self._require().id)

    def get_world_size(self) -> int:
        return len(self._members)

    def get_local_rank(self) -> int:
        if self._info is not None:
            return self._info.local_rank
        me = self._require().info
        return [m.id for m in self._members if m.host == me.host].index(me.id)

    def get_local_world_size(self) -> int:
        if self._info is not None:
            return self._info.local_world_size
        me = self._require().info
        return sum(m.host == me.host for m in self._members)

    def get_global_ranks(self) -> list[int]:
        return list(self._global_ranks)

    @property
    def members(self) -> list[MemberInfo]:
        """The group's members, by group rank."""
        return list(self._members)

    @property
    def timeout(self) -> float:
        return self._timeout

    # -- collectives -----------------------------------------------------------------------------
    def barrier(self, timeout: float | None = None) -> None:
        base, rank = self._next("barrier"), self.get_rank()
        fleet = self._require().fleet
        fleet.store.set(fleet.k(f"{base}/{rank}"), b"1")
        names = [f"{base}/{r}" for r in range(self.get_world_size())]
        self._await(names, "barrier", timeout, mine=names[rank])
        self._done(base, [str(r) for r in range(self.get_world_size())])

    def broadcast_object(self, obj: Any, src: int) -> Any:
        self._check_rank(src, "src")
        base, fleet = self._next("broadcast"), self._require().fleet
        if self.get_world_size() == 1:
            return obj
        header = self._header(base, src)
        if self.get_rank() == src:
            data = seal(fleet.tag_key, header, obj, fleet.config.max_message_bytes)
            fleet.store.set(fleet.k(f"{base}/value"), data)
            return obj
        (data,) = self._await([f"{base}/value"], f"broadcast_object(src={src})", None)
        out = unseal(
            fleet.tag_key,
            header,
            data,
            fleet.config.max_message_bytes,
            f"the broadcast from rank {src}",
        )
        self._done(base, ["value"], readers=self.get_world_size() - 1)
        return out

    def all_gather_object(self, obj: Any) -> list[Any]:
        base, fleet, rank = self._next("all_gather"), self._require().fleet, self.get_rank()
        world = self.get_world_size()
        data = seal(fleet.tag_key, self._header(base, rank), obj, fleet.config.max_message_bytes)
        fleet.store.set(fleet.k(f"{base}/{rank}"), data)
        names = [f"{base}/{r}" for r in range(world)]
        values = self._await(names, "all_gather_object", None, mine=names[rank])
        limit = fleet.config.max_message_bytes
        out = [
            obj
            if r == rank
            else unseal(fleet.tag_key, self._header(base, r), v, limit, f"rank {r}'s object")
            for r, v in enumerate(values)
        ]
        self._done(base, [str(r) for r in range(world)])
        return out

    def send_object(self, obj: Any, dst: int) -> None:
        self._check_rank(dst, "dst", peer=True)
        try:
            self._require().send(self._members[dst], obj, channel=self._scope)
        except PeerGoneError as exc:
            raise CoordinatorTimeoutError(f"send_object to rank {dst}: {exc}") from exc

    def recv_object(self, src: int) -> Any:
        self._check_rank(src, "src", peer=True)
        try:
            return self._require().recv(self._members[src], self._timeout, channel=self._scope)
        except (PeerGoneError, TimeoutError) as exc:
            raise CoordinatorTimeoutError(f"recv_object from rank {src}: {exc}") from exc

    # -- groups ----------------------------------------------------------------------------------
    def new_group(self, ranks: Sequence[int]) -> StoreCoordinator:
        ranks = list(ranks)
        member = self._require()
        check_group_ranks(ranks, self.get_world_size(), self.get_rank())
        n = self._group_counts[tuple(ranks)] = self._group_counts.get(tuple(ranks), 0) + 1
        child = StoreCoordinator(self._info, timeout=self._timeout)
        child._adopt(member, [self._members[r] for r in ranks])
        child._global_ranks = [self._global_ranks[r] for r in ranks]
        parent = hashlib.sha256(self._scope.encode()).hexdigest()[:16]
        child._scope += f"/sub{n}-{parent}"  # its own members first: Fleet.release finds it
        self._children.append(child)
        return child

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for child in self._children:
            child.close()
        member = self._member
        if member is not None and self._owns_member:
            if self._server is not None:  # serve the store until the others are gone
                others = {m.id for m in self._members} - {member.id}
                deadline = min(self._timeout, 60.0)
                with contextlib.suppress(TimeoutError):
                    member.fleet.wait_for(lambda v: not others & set(v.ids()), deadline)
            member.leave()
        self._close_server()

    # -- helpers ---------------------------------------------------------------------------------
    def _require(self) -> Member:
        if self._member is None or self._closed:
            state = "closed" if self._closed else "not initialized; call initialize() first"
            raise RuntimeError(f"store coordinator over {self._global_ranks} is {state}")
        return self._member

    def _next(self, op: str) -> str:
        self._ops += 1
        return f"coll/{self._scope}/{self._ops}/{op}"

    def _header(self, base: str, rank: int) -> list[bytes]:
        return [b"coll", base.encode(), self._members[rank].id.encode()]

    def _await(
        self, names: list[str], what: str, timeout: float | None, mine: str = ""
    ) -> list[bytes]:
        """The values of ``names`` once all exist; bounded, and naming a gone member at once
        (then this rank's own key ``mine`` is deleted: the operation will never complete)."""
        try:
            return self._await_all(names, what, timeout)
        except CoordinatorTimeoutError:
            if mine:
                self._require().fleet.store.delete_key(self._require().fleet.k(mine))
            raise

    def _await_all(self, names: list[str], what: str, timeout: float | None) -> list[bytes]:
        fleet = self._require().fleet
        seconds = self._timeout if timeout is None else timeout
        deadline = time.monotonic() + seconds
        for poll in itertools.count():
            values = [fleet.peek(n) for n in names]
            missing = [i for i, v in enumerate(values) if v is None]
            if not missing:
                return [v for v in values if v is not None]
            if poll % 4 == 3 or time.monotonic() > deadline:
                self._check_alive(fleet.view(), what)
            if time.monotonic() > deadline:
                raise CoordinatorTimeoutError(
                    f"{what} on group {self._global_ranks} (rank {self.get_rank()}) did not "
                    f"complete within {seconds} s; waiting for {[names[i] for i in missing]}"
                )
            left = max(min(deadline - time.monotonic(), POLL_S), 0.001)
            fleet.wait_key(names[missing[0]], left)
        raise AssertionError("unreachable")

    def _check_alive(self, view: FleetView, what: str) -> None:
        gone = [(r, m) for r, m in enumerate(self._members) if view.find(m) is None]
        if gone:
            names = ", ".join(f"rank {r} ({m.id}, pid {m.pid} on {m.host})" for r, m in gone)
            raise CoordinatorTimeoutError(
                f"{what} on group {self._global_ranks} cannot complete: {names} is no longer a "
                f"live member (it died, left or was replaced; fleet epoch {view.epoch}); build "
                "a coordinator over the new membership"
            )

    def _done(self, base: str, names: list[str], readers: int | None = None) -> None:
        """Count this reader out; the last one deletes the operation's keys."""
        fleet = self._require().fleet
        readers = self.get_world_size() if readers is None else readers
        if fleet.store.add(fleet.k(f"{base}/out"), 1) == readers:
            for name in [*names, "out"]:
                fleet.store.delete_key(fleet.k(f"{base}/{name}"))

    def _close_server(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None

    def _check_rank(self, rank: int, what: str, peer: bool = False) -> None:
        if not 0 <= rank < self.get_world_size():
            raise ValueError(f"{what}={rank} is outside this group of {self.get_world_size()}")
        if peer and rank == self.get_rank():
            raise ValueError(f"{what}={rank} is this worker itself")
