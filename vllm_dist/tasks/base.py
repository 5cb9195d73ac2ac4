"""Base tasks that build a coordinator and a communicator, then call one hook.

They name backends only through the registry, so the same task runs on every backend. A task
declares the operations it needs in ``required_ops``; a backend without one of them is refused
before any worker connects.
"""

from __future__ import annotations

import contextlib
from abc import abstractmethod
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

from vllm_dist import registry
from vllm_dist.interfaces import (
    CommOp,
    DeviceCommunicator,
    DistributedTask,
    WorkerCoordinator,
    WorkerInfo,
)


class GlobalCoordinatorDistributedTask(DistributedTask):
    """A coordinator and a communicator over the whole launch.

    ``run(coordinator_type=..., communicator_type=..., device=None, coordinator_options=None,
    communicator_options=None, **kwargs)`` builds ``self.coordinator`` (initialized),
    ``self.communicator`` and ``self.device``, returns ``self.post_init_distributed(**kwargs)``,
    and closes both afterwards.
    """

    required_ops: ClassVar[frozenset[CommOp]] = frozenset()

    coordinator: WorkerCoordinator
    communicator: DeviceCommunicator

    @classmethod
    def check_launch_kwargs(cls, world_size: int, **kwargs: Any) -> None:
        """Refuse unknown backend names and a malformed ``device`` in the parent, before any
        worker starts."""
        check_backend_names(kwargs)
        check_device_name(kwargs.get("device"))

    def run(  # type: ignore[override]
        self,
        *,
        coordinator_type: registry.CoordinatorKey,
        communicator_type: registry.CommunicatorKey,
        device: str | None = None,
        coordinator_options: dict[str, Any] | None = None,
        communicator_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        with open_backends(
            self.worker_info,
            coordinator_type=coordinator_type,
            communicator_type=communicator_type,
            required_ops=self.required_ops,
            device=device,
            coordinator_options=coordinator_options,
            communicator_options=communicator_options,
        ) as (self.coordinator, _, self.communicator):
            self.device = self.communicator.device
            return self.post_init_distributed(**kwargs)

    @abstractmethod
    def post_init_distributed(self, **kwargs: Any) -> Any:
        """The task's work, with ``self.coordinator`` and ``self.communicator`` ready."""


class GroupCoordinatorDistributedTask(DistributedTask):
    """A world coordinator plus a coordinator and a communicator over this rank's group.

    ``run(..., groups=[[0, 1], [2, 3]])``: every rank must be in exactly one group.
    ``self.global_coordinator`` spans the launch; ``self.coordinator`` and ``self.communicator``
    span this rank's group, whose ranks are renumbered from 0 in the order given.
    """

    required_ops: ClassVar[frozenset[CommOp]] = frozenset()

    global_coordinator: WorkerCoordinator
    coordinator: WorkerCoordinator
    communicator: DeviceCommunicator

    @classmethod
    def check_launch_kwargs(cls, world_size: int, **kwargs: Any) -> None:
        """Refuse unknown backend names, a malformed ``device`` and ``groups`` that do not
        partition the world."""
        check_backend_names(kwargs)
        check_device_name(kwargs.get("device"))
        if "groups" in kwargs:  # a subclass may compute its groups itself
            check_groups(kwargs["groups"], world_size)

    def run(  # type: ignore[override]
        self,
        *,
        coordinator_type: registry.CoordinatorKey,
        communicator_type: registry.CommunicatorKey,
        groups: Sequence[Sequence[int]],
        device: str | None = None,
        coordinator_options: dict[str, Any] | None = None,
        communicator_options: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Any:
        self.group_index, my_group = find_group(
            groups, self.worker_info.rank, self.worker_info.world_size
        )
        with open_backends(
            self.worker_info,
            coordinator_type=coordinator_type,
            communicator_type=communicator_type,
            required_ops=self.required_ops,
            device=device,
            coordinator_options=coordinator_options,
            communicator_options=communicator_options,
            group=my_group,
        ) as (self.global_coordinator, self.coordinator, self.communicator):
            self.device = self.communicator.device
            return self.post_init_distributed(**kwargs)

    @abstractmethod
    def post_init_distributed(self, **kwargs: Any) -> Any:
        """The task's work, with the group's coordinator and communicator ready."""


def check_backend_names(kwargs: dict[str, Any]) -> None:
    """Resolve ``coordinator_type`` / ``communicator_type`` through the registry (names only,
    nothing imported): an unknown name raises ``ValueError`` listing the known ones. A missing
    one is left to ``run`` (a subclass may pass its own)."""
    for key, reg in (
        ("coordinator_type", registry.coordinators),
        ("communicator_type", registry.communicators),
    ):
        if key not in kwargs:
            continue
        try:
            reg.resolve_name(kwargs[key])
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"{key}: {exc}") from None


def check_device_name(device: Any) -> None:
    """Refuse a ``device`` that names no torch device ("gpu", "cuda:x", 3): ``None``, "cpu",
    "cuda" and "cuda:N" pass. Whether the device exists is the launcher's question (a Ray
    driver may have no GPU while its workers do)."""
    if device is None:
        return
    import torch

    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a string such as 'cpu' or 'cuda:0', got {device!r}")
    try:
        torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(
            f"device={device!r} names no torch device; use 'cpu', 'cuda' or 'cuda:N'"
        ) from None


def check_groups(groups: Any, world_size: int) -> dict[int, int]:
    """Each rank's group index; ``ValueError`` unless ``groups`` partition the world's ranks."""
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence):
        raise TypeError(f"groups must be a list of lists of ranks, got {groups!r}")
    seen: dict[int, int] = {}
    for i, group in enumerate(groups):
        if isinstance(group, (str, bytes)) or not isinstance(group, Sequence):
            raise TypeError(f"groups[{i}] must be a list of ranks, got {group!r}")
        if not group:
            raise ValueError(f"groups[{i}] is empty; every group needs at least one rank")
        for r in group:
            if type(r) is not int or not 0 <= r < world_size:
                raise ValueError(
                    f"groups[{i}] has rank {r!r}, outside the world of {world_size}: "
                    f"ranks are ints in 0..{world_size - 1}"
                )
            if r in seen:
                raise ValueError(
                    f"rank {r} is in groups[{seen[r]}] and groups[{i}]; put it in one group"
                )
            seen[r] = i
    missing = sorted(set(range(world_size)) - set(seen))
    if missing:
        raise ValueError(
            f"ranks {missing} are in no group; groups must cover all {world_size} ranks"
        )
    return seen


def find_group(
    groups: Sequence[Sequence[int]], rank: int, world_size: int
) -> tuple[int, list[int]]:
    """This rank's group index and ranks; ``ValueError`` unless ``groups`` partition the world."""
    seen = check_groups(groups, world_size)
    return seen[rank], list(groups[seen[rank]])


@contextlib.contextmanager
def open_backends(
    worker_info: WorkerInfo,
    *,
    coordinator_type: registry.CoordinatorKey,
    communicator_type: registry.CommunicatorKey,
    required_ops: frozenset[CommOp] = frozenset(),
    device: str | None = None,
    coordinator_options: dict[str, Any] | None = None,
    communicator_options: dict[str, Any] | None = None,
    group: list[int] | None = None,
) -> Iterator[tuple[WorkerCoordinator, WorkerCoordinator, DeviceCommunicator]]:
    """Yield ``(world coordinator, group coordinator, communicator over the group)``, then close.

    ``group=None`` means the whole world (both coordinators are the same object). A backend
    lacking one of ``required_ops`` is refused before any connection is made.
    """
    registry.require_ops(communicator_type, required_ops)
    comm_cls = registry.get_communicator_class(communicator_type)
    coord_cls = registry.get_coordinator_class(coordinator_type)
    world = coord_cls(worker_info, **(coordinator_options or {}))  # type: ignore[call-arg]
    try:
        world.initialize()
        local = world if group is None else world.new_group(group)
        comm = comm_cls(local, device=device, **(communicator_options or {}))  # type: ignore[call-arg]
        try:
            yield world, local, comm
        finally:
            comm.close()
    finally:
        world.close()
