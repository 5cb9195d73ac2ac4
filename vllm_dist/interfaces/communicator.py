"""DeviceCommunicator: the data plane for tensors on one device, built on a coordinator.

A hardware vendor adds a backend by implementing this class (and registering it); coordination
stays untouched. Each backend declares the operations it supports in ``supported_ops`` so that a
task asking for a missing one fails at set-up, naming the backends that have it.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch


class _StrEnum(str, enum.Enum):
    """``enum.StrEnum`` for Python 3.10."""

    def __str__(self) -> str:
        return str(self.value)


class ReduceOp(_StrEnum):
    """Element-wise reduction of a collective."""

    SUM = "sum"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    AVG = "avg"


class CommOp(_StrEnum):
    """The operations a communicator may support."""

    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    BROADCAST = "broadcast"
    SEND = "send"
    RECV = "recv"
    READ = "read"  # one-sided: pull a peer's exposed buffer
    WRITE = "write"  # one-sided: push into a peer's exposed buffer
    CUDA_GRAPH = "cuda_graph"  # collectives may be captured into a CUDA graph


class UnsupportedOperationError(NotImplementedError):
    """A communicator was asked for an operation it does not declare in ``supported_ops``."""


class DeviceCommunicator(ABC):
    """Tensor collectives and point-to-point transfers among the members of a coordinator.

    Implementations are constructed as ``cls(coordinator, device=None, **options)`` by every
    member of the coordinator's group; ``device=None`` means the worker's default device
    (``cuda:<local rank>`` when CUDA is present, else CPU). Ranks are group ranks of the
    coordinator. Every tensor must be contiguous and on ``self.device``; a violation raises
    ``ValueError`` before the backend sees it.
    """

    supported_ops: ClassVar[frozenset[CommOp]] = frozenset()

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """The device whose memory this communicator moves."""

    @abstractmethod
    def all_reduce(
        self,
        tensor_in: torch.Tensor,
        tensor_out: torch.Tensor | None = None,
        op: ReduceOp = ReduceOp.SUM,
    ) -> torch.Tensor:
        """Reduce ``tensor_in`` over the group.

        In place when ``tensor_out`` is None; otherwise ``tensor_in`` is left untouched and the
        result is written to ``tensor_out`` (same shape and dtype). Returns the result tensor.
        """

    @abstractmethod
    def all_gather(
        self, tensor_in: torch.Tensor, tensor_out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Concatenate every member's ``tensor_in`` along dim 0, in rank order.

        ``tensor_out`` has shape ``(world_size * tensor_in.shape[0], *tensor_in.shape[1:])``;
        allocated when None. Returns it.
        """

    @abstractmethod
    def reduce_scatter(
        self,
        tensor_in: torch.Tensor,
        tensor_out: torch.Tensor | None = None,
        op: ReduceOp = ReduceOp.SUM,
    ) -> torch.Tensor:
        """Reduce ``tensor_in`` over the group and keep this rank's slice of dim 0.

        ``tensor_in.shape[0]`` must be divisible by the world size; ``tensor_out`` has shape
        ``(tensor_in.shape[0] // world_size, *tensor_in.shape[1:])``, allocated when None.
        """

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Overwrite ``tensor`` on every member with its value on rank ``src``; returns it."""

    @abstractmethod
    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send ``tensor`` to rank ``dst``; matched by order with ``recv`` on ``dst``."""

    @abstractmethod
    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Receive into ``tensor`` (its shape and dtype must match the send) from ``src``."""

    @abstractmethod
    def close(self) -> None:
        """Release the backend's resources; idempotent and never blocks on a dead peer."""

    @classmethod
    def unavailable_reason(cls, device_type: str) -> str | None:
        """Why this backend cannot run on ``device_type`` (``"cpu"``/``"cuda"``) here; None if it can.

        Used by ``vllm-dist info`` and by the conformance suite to pick backends. Must not create
        a CUDA context.
        """
        return None

    def describe(self) -> dict[str, Any]:
        """Backend facts for logs and benchmarks (library version, transport). Optional."""
        return {}
