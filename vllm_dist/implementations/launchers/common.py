"""What every launcher does the same way: pack a launch, run it inside a worker, name exits.

Launchers call these plain functions; there is no launcher base class with shared behaviour.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import socket
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from vllm_dist import registry, serialization
from vllm_dist.interfaces import (
    DistributedTask,
    LaunchError,
    RendezvousPortTakenError,
    WorkerInfo,
)

T = TypeVar("T")
logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerOutcome:
    """What a worker sends back: a pickled return value, or its traceback."""

    ok: bool
    payload: bytes = b""
    traceback: str = ""
    port_taken: bool = False  # ended on RendezvousPortTakenError for the launch's own port


def pack_launch(task_type: type[DistributedTask], kwargs: dict[str, Any]) -> bytes:
    """Pickle the task class, its keywords and the parent's registrations for the workers."""
    if not (isinstance(task_type, type) and issubclass(task_type, DistributedTask)):
        raise TypeError(f"task_type must be a DistributedTask subclass, got {task_type!r}")
    return serialization.dumps((task_type, kwargs, registry.snapshot()))


def run_packed_task(packed: bytes, info: WorkerInfo) -> WorkerOutcome:
    """Run one rank of a packed launch in this process; never raises."""
    os.environ.update(info.env())
    try:
        task_type, kwargs, snap = serialization.loads(packed)
        registry.restore(snap)
        result = task_type(info).run(**kwargs)
        return WorkerOutcome(ok=True, payload=serialization.dumps(result))
    except SystemExit as exc:
        if exits_cleanly(exc.code):  # sys.exit(0): a success without a result, as in torchrun
            return WorkerOutcome(ok=True, payload=serialization.dumps(None))
        return WorkerOutcome(ok=False, traceback=traceback.format_exc())
    except BaseException as exc:  # noqa: BLE001 - the traceback is the report
        taken = isinstance(exc, RendezvousPortTakenError) and exc.port == info.master_port
        return WorkerOutcome(ok=False, traceback=traceback.format_exc(), port_taken=taken)


def exits_cleanly(code: Any) -> bool:
    """Whether ``sys.exit(code)`` ends a process with exit status 0 (``None``, 0, ``False``)."""
    return code is None or (type(code) in (int, bool) and code == 0)


def worker_env(env: dict[str, str], info: WorkerInfo) -> dict[str, str]:
    """``env`` for one worker: ``{rank}`` and ``{local_rank}`` in a value become the worker's own.

    Only those two names are replaced, so values holding other braces (JSON, ...) pass unchanged.
    """
    mine = {"{rank}": str(info.rank), "{local_rank}": str(info.local_rank)}
    out = {}
    for key, value in env.items():
        for name, number in mine.items():
            value = value.replace(name, number)
        out[key] = value
    return out


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free on ``host`` right now, outside the kernel's ephemeral range.

    The port is handed to rank 0, which binds it seconds later, after its interpreter starts.
    A port from the ephemeral range (what binding port 0 gives) can be taken in that window by
    any outgoing connection on the machine; ports outside it are only ever taken by an explicit
    bind. Ports are checked on the wildcard address, which is what torch's store listens on, so
    a service on one address of the machine does not hide. Falls back to an ephemeral port when
    none outside the range is free.
    """
    family = _family(host)
    low, high = _ephemeral_range()
    spans = [(a, b) for a, b in ((_PORT_FLOOR, low), (high + 1, 65536)) if b - a > 1]
    rng = random.Random()
    for _ in range(64 if spans else 0):
        port = rng.randrange(*rng.choice(spans))
        if _bindable(family, port):
            return port
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind(("::" if family == socket.AF_INET6 else "", 0))
        return int(s.getsockname()[1])


_PORT_FLOOR = 20000  # below this sit the well-known and registered services people run


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out for outgoing connections (Linux; the IANA range elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split()[:2])
            return low, high
    except (OSError, ValueError):
        return 32768, 60999


def _family(host: str) -> socket.AddressFamily:
    """IPv6 for an IPv6 address (or a name that only has one), else IPv4; resolved once."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return socket.AF_INET
    families = {info[0] for info in infos}
    return socket.AF_INET if socket.AF_INET in families or not families else socket.AF_INET6


def _bindable(family: socket.AddressFamily, port: int) -> bool:
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind(("::" if family == socket.AF_INET6 else "", port))
        except OSError:
            return False
    return True


PORT_ATTEMPTS = 3  # launches in all when the rendezvous port we picked is taken meanwhile


def launch_retrying_taken_ports(launch_once: Callable[[], T]) -> T:
    """``launch_once()``, again (up to ``PORT_ATTEMPTS`` in all) while it fails because the
    rendezvous port it picked was taken between the pick and rank 0's bind
    (``WorkerFailure.port_taken``).

    Rank 0 fails in its rendezvous and the others are stopped while they wait in theirs, so the
    work of the task has not started; only what a task does before it joins its coordinator
    runs again. Callers that fix the port themselves call ``launch_once`` directly: another try
    would meet the same port.
    """
    for attempt in range(1, PORT_ATTEMPTS + 1):
        try:
            return launch_once()
        except LaunchError as exc:
            taken = [f for f in exc.failures if f.port_taken]
            if not taken or attempt == PORT_ATTEMPTS:
                raise
            last = taken[0].traceback.strip().splitlines()[-1:] or [""]
            logger.warning(
                "launch attempt %d of %d: the rendezvous port was taken before rank %d bound it "
                "(%s); launching again on another port",
                attempt,
                PORT_ATTEMPTS,
                taken[0].rank,
                last[0],
            )
    raise AssertionError("unreachable")


def describe_exit(exitcode: int | None) -> str:
    """``exited with code 3`` / ``killed by signal SIGKILL`` / ``still running``."""
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"
