"""Base tasks that build a coordinator and a communicator, then call one hook.

They name backends only through the registry, so the same task runs on every backend. A task
declares the operations it needs in ``required_ops``; a backend without one of them is refused
before any worker connects.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

from vllm_dist import registry
from vllm_dist.interfaces import (
    CommOp,
    DeviceCommunicator,
    DistributedTask,
    WorkerCoordinator,
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
        comm_cls = _communicator_class(communicator_type, self.required_ops)
        coord_cls = registry.get_coordinator_class(coordinator_type)
        self.coordinator = coord_cls(self.worker_info, **(coordinator_options or {}))  # type: ignore[call-arg]
        try:
            self.coordinator.initialize()
            self.communicator = comm_cls(  # type: ignore[call-arg]
                self.coordinator, device=device, **(communicator_options or {})
            )
            try:
                self.device = self.communicator.device
                return self.post_init_distributed(**kwargs)
            finally:
                self.communicator.close()
        finally:
            self.coordinator.close()

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
        comm_cls = _communicator_class(communicator_type, self.required_ops)
        coord_cls = registry.get_coordinator_class(coordinator_type)
        self.global_coordinator = coord_cls(self.worker_info, **(coordinator_options or {}))  # type: ignore[call-arg]
        try:
            self.global_coordinator.initialize()
            self.coordinator = self.global_coordinator.new_group(my_group)
            self.communicator = comm_cls(  # type: ignore[call-arg]
                self.coordinator, device=device, **(communicator_options or {})
            )
            try:
                self.device = self.communicator.device
                return self.post_init_distributed(**kwargs)
            finally:
                self.communicator.close()
        finally:
            self.global_coordinator.close()

    @abstractmethod
    def post_init_distributed(self, **kwargs: Any) -> Any:
        """The task's work, with the group's coordinator and communicator ready."""


def find_group(
    groups: Sequence[Sequence[int]], rank: int, world_size: int
) -> tuple[int, list[int]]:
    """This rank's group index and ranks; ``ValueError`` unless ``groups`` partition the world."""
    seen: dict[int, int] = {}
    for i, group in enumerate(groups):
        if not group:
            raise ValueError(f"groups[{i}] is empty")
        for r in group:
            if not isinstance(r, int) or not 0 <= r < world_size:
                raise ValueError(f"groups[{i}] has rank {r!r}, outside the world of {world_size}")
            if r in seen:
                raise ValueError(f"rank {r} is in groups[{seen[r]}] and groups[{i}]")
            seen[r] = i
    missing = sorted(set(range(world_size)) - set(seen))
    if missing:
        raise ValueError(f"ranks {missing} are in no group; groups must cover all {world_size}")
    return seen[rank], list(groups[seen[rank]])


def _communicator_class(
    communicator_type: registry.CommunicatorKey, required: frozenset[CommOp]
) -> type[DeviceCommunicator]:
    registry.require_ops(communicator_type, required)
    return registry.get_communicator_class(communicator_type)
