"""vllm_dist: launchers, coordinators and device communicators for distributed LLM systems.

Importing this package imports neither torch.cuda state, Ray nor NIXL; backends load when their
enum is resolved. ``RayLauncher`` is resolved on first access for the same reason.
"""

from typing import Any

from vllm_dist.implementations.launchers.mp import MPLauncher
from vllm_dist.interfaces import (
    AuthenticationError,
    BackendUnavailableError,
    CommOp,
    CoordinatorTimeoutError,
    DeviceCommunicator,
    DistributedTask,
    Launcher,
    LaunchError,
    LaunchTimeoutError,
    ReduceOp,
    RendezvousPortTakenError,
    UnsupportedOperationError,
    WorkerCoordinator,
    WorkerFailure,
    WorkerInfo,
)
from vllm_dist.registry import (
    CommunicatorType,
    CoordinatorType,
    LauncherType,
    get_communicator_class,
    get_coordinator_class,
    get_launcher_class,
    register_communicator,
    register_coordinator,
    register_launcher,
)
from vllm_dist.run import run_task
from vllm_dist.tasks.base import GlobalCoordinatorDistributedTask, GroupCoordinatorDistributedTask

__version__ = "0.1.0"  # the one place the version lives; setup.cfg reads it

__all__ = [
    "AuthenticationError",
    "BackendUnavailableError",
    "CommOp",
    "CommunicatorType",
    "CoordinatorTimeoutError",
    "CoordinatorType",
    "DeviceCommunicator",
    "DistributedTask",
    "GlobalCoordinatorDistributedTask",
    "GroupCoordinatorDistributedTask",
    "LaunchError",
    "LaunchTimeoutError",
    "Launcher",
    "LauncherType",
    "MPLauncher",
    "RayLauncher",
    "ReduceOp",
    "RendezvousPortTakenError",
    "UnsupportedOperationError",
    "WorkerCoordinator",
    "WorkerFailure",
    "WorkerInfo",
    "get_communicator_class",
    "get_coordinator_class",
    "get_launcher_class",
    "register_communicator",
    "register_coordinator",
    "register_launcher",
    "run_task",
]


def __getattr__(name: str) -> Any:
    if name == "RayLauncher":
        return get_launcher_class(LauncherType.RAY)
    raise AttributeError(f"module 'vllm_dist' has no attribute {name!r}")
