"""The one registry of launchers, coordinators and communicators, and the enums that name them.

One generic ``_Registry`` serves all three axes. Built-ins are lazy ``"module:Class"`` entries,
imported only when asked for, so a missing optional package (Ray, NIXL) fails only for the backend
that needs it, with the install command in the message. Plugins come from ``register_*`` or from
the entry-point groups ``vllm_dist.launchers`` / ``vllm_dist.coordinators`` /
``vllm_dist.communicators``.

User registrations are also recorded in a picklable snapshot that launchers send to every worker
(``snapshot()`` / ``restore()``), so a registration made in the parent before ``launch()`` is in
force in the workers. Rejected alternative: re-running registration code in each worker, which
breaks for classes defined in ``__main__`` or a test module.
"""

from __future__ import annotations

import enum
import importlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import metadata
from types import MappingProxyType
from typing import Any, Generic, TypeVar, Union

from vllm_dist.interfaces import (
    BackendUnavailableError,
    CommOp,
    DeviceCommunicator,
    Launcher,
    UnsupportedOperationError,
    WorkerCoordinator,
)

T = TypeVar("T")


class _BackendEnum(str, enum.Enum):
    """A str enum whose lookup by value is case-insensitive and lists valid values on error."""

    def __str__(self) -> str:
        return str(self.value)

    @classmethod
    def _missing_(cls, value: object) -> Any:
        if isinstance(value, str):
            for member in cls:
                if member.value == value.lower() or member.name == value.upper():
                    return member
        valid = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"{value!r} is not a valid {cls.__name__}; valid values: {valid}")


class LauncherType(_BackendEnum):
    MP = "mp"
    RAY = "ray"


class CoordinatorType(_BackendEnum):
    STORE = "store"
    TORCH_DISTRIBUTED = "torch_distributed"


class CommunicatorType(_BackendEnum):
    TORCH_DISTRIBUTED = "torch_distributed"
    PYNCCL = "pynccl"
    NIXL_RDT = "nixl_rdt"


@dataclass(frozen=True, kw_only=True, slots=True)
class _Entry:
    target: str | type  # "module:Class" or the class itself
    install_hint: str = ""  # how to get the packages a lazy target imports


_IMPL = "vllm_dist.implementations"
_BUILTIN_LAUNCHERS = {
    LauncherType.MP: _Entry(target=f"{_IMPL}.launchers.mp:MPLauncher"),
    LauncherType.RAY: _Entry(
        target=f"{_IMPL}.launchers.ray:RayLauncher", install_hint="pip install 'vllm_dist[ray]'"
    ),
}
_BUILTIN_COORDINATORS = {
    CoordinatorType.STORE: _Entry(
        target=f"{_IMPL}.coordinators.store_coordinator:StoreCoordinator"
    ),
    CoordinatorType.TORCH_DISTRIBUTED: _Entry(
        target=f"{_IMPL}.coordinators.torch_distributed:TorchDistributedCoordinator"
    ),
}
_BUILTIN_COMMUNICATORS = {
    CommunicatorType.NIXL_RDT: _Entry(
        target=f"{_IMPL}.communicators.nixl:NixlRdtCommunicator",
        install_hint="pip install 'vllm_dist[nixl]'",
    ),
    CommunicatorType.PYNCCL: _Entry(
        target=f"{_IMPL}.communicators.pynccl.communicator:PyNcclCommunicator",
        install_hint="pip install 'vllm_dist[nccl]' or set VLLM_DIST_NCCL_SO_PATH",
    ),
    CommunicatorType.TORCH_DISTRIBUTED: _Entry(
        target=f"{_IMPL}.communicators.torch_distributed:TorchDistributedCommunicator"
    ),
}


class _Registry(Generic[T]):
    """Names to classes for one axis, with lazy loading and entry-point plugins."""

    def __init__(
        self,
        axis: str,
        base: type,
        enum_type: type[_BackendEnum],
        builtins: Mapping[Any, _Entry],
    ) -> None:
        self._axis = axis
        self._base = base
        self._enum = enum_type
        self._entries: dict[str, _Entry] = {str(k): v for k, v in builtins.items()}
        self._builtin_names = frozenset(self._entries)
        self._user: dict[str, str | type] = {}
        self._entry_points_loaded = False
        self.entries = MappingProxyType(self._entries)

    @property
    def entry_point_group(self) -> str:
        return f"vllm_dist.{self._axis}s"

    def register(self, name: str, target: str | type, *, override: bool = False) -> None:
        name = self._check_name(name)
        if isinstance(target, str):
            if ":" not in target:
                raise ValueError(f"{target!r} is not a 'module:Class' path")
        elif not (isinstance(target, type) and issubclass(target, self._base)):
            raise TypeError(
                f"a {self._axis} must be a subclass of {self._base.__name__} or a "
                f"'module:Class' path, got {target!r}"
            )
        self._load_entry_points()
        if name in self._entries and not override:
            raise ValueError(
                f"{self._axis} {name!r} is already registered ({self._describe(name)}); "
                "pass override=True to replace it"
            )
        self._entries[name] = _Entry(target=target)
        self._user[name] = target

    def names(self) -> list[str]:
        self._load_entry_points()
        return sorted(self._entries)

    def resolve_name(self, key: str | _BackendEnum) -> str:
        """The registry name for an enum member or a string; raises for unknown names."""
        self._load_entry_points()
        if isinstance(key, enum.Enum):
            if not isinstance(key, self._enum):
                raise TypeError(
                    f"{key!r} names a {type(key).__name__}, not a {self._enum.__name__}"
                )
            return str(key.value)
        if not isinstance(key, str):
            raise TypeError(f"a {self._axis} type is a {self._enum.__name__} or a str, got {key!r}")
        for candidate in (key, key.lower()):
            if candidate in self._entries:
                return candidate
        raise ValueError(
            f"unknown {self._axis} {key!r}; known: {', '.join(self.names())}. Register a new one "
            f"with vllm_dist.register_{self._axis}(name, 'module:Class') or the entry-point "
            f"group {self.entry_point_group!r}"
        )

    def get(self, key: str | _BackendEnum) -> type[T]:
        name = self.resolve_name(key)
        entry = self._entries[name]
        if isinstance(entry.target, type):
            return entry.target  # type: ignore[return-value]
        cls = self._import(name, entry)
        self._entries[name] = _Entry(target=cls, install_hint=entry.install_hint)
        return cls

    def snapshot(self) -> dict[str, str | type]:
        """The user registrations, to be restored in a worker."""
        return dict(self._user)

    def restore(self, snapshot: Mapping[str, str | type]) -> None:
        for name, target in snapshot.items():
            self.register(name, target, override=True)

    def _import(self, name: str, entry: _Entry) -> type[T]:
        assert isinstance(entry.target, str)
        module_name, _, attr = entry.target.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            hint = f"; install it with: {entry.install_hint}" if entry.install_hint else ""
            raise BackendUnavailableError(
                f"{self._axis} {name!r} cannot be loaded from {entry.target!r}: {exc}{hint}"
            ) from exc
        try:
            cls = getattr(module, attr)
        except AttributeError:
            raise ValueError(
                f"{self._axis} {name!r}: module {module_name!r} has no attribute {attr!r}"
            ) from None
        if not (isinstance(cls, type) and issubclass(cls, self._base)):
            raise TypeError(f"{self._axis} {name!r}: {cls!r} is not a {self._base.__name__}")
        return cls  # type: ignore[return-value]

    def _load_entry_points(self) -> None:
        if self._entry_points_loaded:
            return
        self._entry_points_loaded = True
        for ep in metadata.entry_points(group=self.entry_point_group):
            if ep.name not in self._entries:
                self._entries[ep.name] = _Entry(target=ep.value)

    def _check_name(self, name: str) -> str:
        if isinstance(name, enum.Enum):
            name = str(name.value)
        if not isinstance(name, str) or not name or name != name.strip():
            raise ValueError(f"a {self._axis} name must be a non-empty string, got {name!r}")
        return name

    def _describe(self, name: str) -> str:
        target = self._entries[name].target
        return target if isinstance(target, str) else f"{target.__module__}.{target.__qualname__}"


launchers: _Registry[Launcher] = _Registry("launcher", Launcher, LauncherType, _BUILTIN_LAUNCHERS)
coordinators: _Registry[WorkerCoordinator] = _Registry(
    "coordinator", WorkerCoordinator, CoordinatorType, _BUILTIN_COORDINATORS
)
communicators: _Registry[DeviceCommunicator] = _Registry(
    "communicator", DeviceCommunicator, CommunicatorType, _BUILTIN_COMMUNICATORS
)

LauncherKey = Union[LauncherType, str]  # noqa: UP007 - a runtime alias on Python 3.10
CoordinatorKey = Union[CoordinatorType, str]  # noqa: UP007
CommunicatorKey = Union[CommunicatorType, str]  # noqa: UP007


def get_launcher_class(launcher_type: LauncherKey) -> type[Launcher]:
    """The launcher class for an enum member or a registered name."""
    return launchers.get(launcher_type)


def get_coordinator_class(coordinator_type: CoordinatorKey) -> type[WorkerCoordinator]:
    """The coordinator class for an enum member or a registered name."""
    return coordinators.get(coordinator_type)


def get_communicator_class(communicator_type: CommunicatorKey) -> type[DeviceCommunicator]:
    """The communicator class for an enum member or a registered name."""
    return communicators.get(communicator_type)


def register_launcher(name: str, target: str | type, *, override: bool = False) -> None:
    """Register a launcher class (or lazy ``"module:Class"``) under ``name``."""
    launchers.register(name, target, override=override)


def register_coordinator(name: str, target: str | type, *, override: bool = False) -> None:
    """Register a coordinator class (or lazy ``"module:Class"``) under ``name``."""
    coordinators.register(name, target, override=override)


def register_communicator(name: str, target: str | type, *, override: bool = False) -> None:
    """Register a communicator class (or lazy ``"module:Class"``) under ``name``."""
    communicators.register(name, target, override=override)


def backends_supporting(op: CommOp) -> list[str]:
    """Names of the loadable communicators that declare ``op`` (unloadable ones are skipped)."""
    found = []
    for name in communicators.names():
        try:
            cls = communicators.get(name)
        except (ImportError, ValueError, TypeError):
            continue
        if op in cls.supported_ops:
            found.append(name)
    return found


def require_ops(communicator_type: CommunicatorKey, ops: Iterable[CommOp]) -> None:
    """Raise ``UnsupportedOperationError`` at set-up if the backend lacks any of ``ops``."""
    cls = get_communicator_class(communicator_type)
    for op in ops:
        if op not in cls.supported_ops:
            raise unsupported_operation(cls, op)


def unsupported_operation(cls: type[DeviceCommunicator], op: CommOp) -> Exception:
    """The error a communicator raises for an operation it does not support."""
    others = [n for n in backends_supporting(op)]
    where = ", ".join(others) if others else "none of the loadable backends"
    return UnsupportedOperationError(
        f"{cls.__name__} does not support {op.value}; communicators that do: {where}"
    )


def snapshot() -> dict[str, dict[str, str | type]]:
    """Every user registration, for a launcher to ship to its workers."""
    return {
        "launcher": launchers.snapshot(),
        "coordinator": coordinators.snapshot(),
        "communicator": communicators.snapshot(),
    }


def restore(snap: Mapping[str, Mapping[str, str | type]]) -> None:
    """Apply a ``snapshot()`` taken in the parent process."""
    launchers.restore(snap.get("launcher", {}))
    coordinators.restore(snap.get("coordinator", {}))
    communicators.restore(snap.get("communicator", {}))
