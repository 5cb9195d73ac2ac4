"""The abstract contracts of the three pluggable roles and the task that composes them.

Nothing here knows a backend: implementations live under ``vllm_dist.implementations`` and are
found through ``vllm_dist.registry``.
"""

from vllm_dist.interfaces.communicator import (
    CommOp,
    DeviceCommunicator,
    ReduceOp,
    UnsupportedOperationError,
)
from vllm_dist.interfaces.coordinator import (
    AuthenticationError,
    CoordinatorTimeoutError,
    RendezvousPortTakenError,
    WorkerCoordinator,
)
from vllm_dist.interfaces.dataplane import (
    AsyncSendRecvCommunicator,
    ExposedDescriptor,
    OneSidedCommunicator,
    PreparedReadCommunicator,
    PreparedReadSet,
    ReadHandle,
    StridedReadCommunicator,
    TransferHandle,
)
from vllm_dist.interfaces.launcher import (
    BackendUnavailableError,
    DistributedTask,
    Launcher,
    LaunchError,
    LaunchTimeoutError,
    WorkerFailure,
    WorkerInfo,
)

__all__ = [
    "AsyncSendRecvCommunicator",
    "AuthenticationError",
    "ExposedDescriptor",
    "OneSidedCommunicator",
    "PreparedReadCommunicator",
    "PreparedReadSet",
    "ReadHandle",
    "StridedReadCommunicator",
    "TransferHandle",
    "BackendUnavailableError",
    "CommOp",
    "CoordinatorTimeoutError",
    "DeviceCommunicator",
    "DistributedTask",
    "LaunchError",
    "LaunchTimeoutError",
    "Launcher",
    "ReduceOp",
    "RendezvousPortTakenError",
    "UnsupportedOperationError",
    "WorkerCoordinator",
    "WorkerFailure",
    "WorkerInfo",
]
