"""WorkerCoordinator: the CPU control plane between the workers of a launch.

Tiny messages only (plans, metadata, unique ids, barriers); tensors go through a
``DeviceCommunicator``. Ranks are given to a coordinator explicitly (a ``WorkerInfo``), never read
from a process-global group, so several coordinators can live in one process.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any


class CoordinatorTimeoutError(TimeoutError):
    """A coordinator operation did not complete within its timeout (a peer is slow or dead)."""


class AuthenticationError(RuntimeError):
    """A peer could not prove it holds the launch's (or fleet's) secret, or a message failed its
    check. Nothing the peer sent was believed; the message names the peer and the fix (the same
    ``JoinSpec(token=...)`` on both launches, or a port that belongs to another launch).
    """


class RendezvousPortTakenError(RuntimeError):
    """Rank 0 could not listen on the rendezvous port ``port``: another process holds it.

    Not a timeout: waiting longer does not help. A launcher that picked the port itself launches
    again on another one when this ends rank 0 (``WorkerFailure.port_taken``); a caller that
    fixed the port should pick a free one.
    """

    def __init__(self, message: str, *, port: int) -> None:
        super().__init__(message)
        self.port = port


class WorkerCoordinator(ABC):
    """Rank facts and object collectives over one group of workers.

    Implementations are constructed as ``cls(worker_info, *, timeout=...)`` and are usable after
    ``initialize()``. Every collective must be called by every member of the group, in the same
    order. Ranks in arguments and results are ranks *within this coordinator's group*.
    """

    @abstractmethod
    def initialize(self) -> None:
        """Connect to the other members. Idempotent.

        Raises:
            CoordinatorTimeoutError: the other members did not show up within the timeout.
        """

    @abstractmethod
    def get_rank(self) -> int:
        """This worker's rank in the group, ``0 <= rank < get_world_size()``."""

    @abstractmethod
    def get_world_size(self) -> int:
        """Number of workers in the group."""

    @abstractmethod
    def get_local_rank(self) -> int:
        """This worker's rank on its node; it selects the worker's device."""

    @abstractmethod
    def get_local_world_size(self) -> int:
        """Number of workers of the launch on this worker's node."""

    @abstractmethod
    def get_global_ranks(self) -> list[int]:
        """The launch-wide ranks of the group's members, indexed by group rank."""

    @abstractmethod
    def barrier(self, timeout: float | None = None) -> None:
        """Block until every member has reached the barrier.

        Raises:
            CoordinatorTimeoutError: not every member arrived within ``timeout`` seconds (default:
                the coordinator's timeout); the message names the missing ranks where known.
        """

    @abstractmethod
    def broadcast_object(self, obj: Any, src: int) -> Any:
        """Send ``obj`` from group rank ``src`` to every member; returns it on every member."""

    @abstractmethod
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every member's ``obj``, indexed by group rank."""

    @abstractmethod
    def send_object(self, obj: Any, dst: int) -> None:
        """Send ``obj`` to group rank ``dst`` (matched by order with ``recv_object``)."""

    @abstractmethod
    def recv_object(self, src: int) -> Any:
        """Receive the next object that group rank ``src`` sent to this worker."""

    @abstractmethod
    def new_group(self, ranks: Sequence[int]) -> WorkerCoordinator:
        """A coordinator over a subset of this group, already initialized.

        Called by the members of ``ranks`` only (not a collective over this group).

        Args:
            ranks: group ranks of this coordinator; this worker must be one of them.

        Raises:
            ValueError: ``ranks`` is empty, has duplicates, is out of range or omits this worker.
        """

    @abstractmethod
    def close(self) -> None:
        """Release connections; idempotent. Sub-groups are closed before their parent."""
