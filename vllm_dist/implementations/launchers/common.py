"""What every launcher does the same way: pack a launch, run it inside a worker, name exits.

Launchers call these plain functions; there is no launcher base class with shared behaviour.
"""

from __future__ import annotations

import ast
import linecache
import math
import os
import random
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from vllm_dist import log, registry, serialization
from vllm_dist.interfaces import (
    DistributedTask,
    LaunchError,
    RendezvousPortTakenError,
    WorkerFailure,
    WorkerInfo,
)

T = TypeVar("T")
logger = log.get_logger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerOutcome:
    """What a worker sends back: a pickled return value, or its traceback."""

    ok: bool
    payload: bytes = b""
    traceback: str = ""
    port_taken: bool = False  # ended on RendezvousPortTakenError for the launch's own port
    failed_at: float = 0.0  # time.time() when the task raised, which orders the failures


def pack_launch(task_type: type[DistributedTask], kwargs: dict[str, Any]) -> bytes:
    """Pickle the task class, its keywords and the parent's registrations for the workers."""
    if not (isinstance(task_type, type) and issubclass(task_type, DistributedTask)):
        raise TypeError(f"task_type must be a DistributedTask subclass, got {task_type!r}")
    return serialization.dumps((task_type, kwargs, registry.snapshot()))


def run_packed_task(packed: bytes, info: WorkerInfo, *, rank_prefix: bool = False) -> WorkerOutcome:
    """Run one rank of a packed launch in this process; never raises.

    Configures the ``vllm_dist`` logger first (``vllm_dist.log.configure``); ``rank_prefix``
    puts the rank before each record, for a launcher whose output nobody prefixes.
    """
    os.environ.update(info.env())
    try:
        log.configure(rank=info.rank if rank_prefix else None)
        task_type, kwargs, snap = serialization.loads(packed)
        logger.debug(
            "rank %d of %d (try %d of launch %s): running %s",
            info.rank,
            info.world_size,
            info.restart_count,
            info.launch_id or "-",
            getattr(task_type, "__qualname__", task_type),
        )
        registry.restore(snap)
        result = task_type(info).run(**kwargs)
        return WorkerOutcome(ok=True, payload=serialization.dumps(result))
    except SystemExit as exc:
        if exits_cleanly(exc.code):  # sys.exit(0): a success without a result, as in torchrun
            return WorkerOutcome(ok=True, payload=serialization.dumps(None))
        return WorkerOutcome(ok=False, traceback=traceback.format_exc(), failed_at=time.time())
    except BaseException as exc:  # noqa: BLE001 - the traceback is the report
        at = time.time()
        taken = isinstance(exc, RendezvousPortTakenError) and exc.port == info.master_port
        text = traceback.format_exc() + busy_threads(exc, info.rank)
        return WorkerOutcome(ok=False, traceback=text, port_taken=taken, failed_at=at)


# where a thread that waits (for work, or on a peer) sits: not busy with work of its own
_IDLE_FILES = ("queue.py", "threading.py", "selectors.py", "concurrent/futures/thread.py")
_IDLE_CALLS = (".get(", ".wait(", ".recv(", ".poll(", ".select(")


def _waiting(frame: Any) -> bool:
    """Whether a thread's innermost Python frame is a wait (a queue get, an event, a poll)."""
    if frame.f_code.co_filename.endswith(_IDLE_FILES):
        return True
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
    return any(call in line for call in _IDLE_CALLS)


def busy_threads(exc: BaseException, rank: int) -> str:
    """After a timeout (a stalled transfer, a collective), this rank's other threads that were
    not idle, with their stacks: a receiver thread stuck in its own work (an unpack) shows here,
    so the error does not read as only the peer's fault. Empty otherwise."""
    chain: BaseException | None = exc
    while chain is not None and not isinstance(chain, TimeoutError):
        chain = chain.__cause__ or chain.__context__
    if chain is None:
        return ""
    me = threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident == me or _waiting(frame):
            continue
        stack = "".join(traceback.format_stack(frame))
        parts.append(f"thread {names.get(ident, ident)!s}:\n{stack}")
    if not parts:
        return ""
    head = f"\nthreads of rank {rank} still busy when it gave up (its own work, not a peer):\n"
    return head + "".join(parts)


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


# what a rank's error says when it only saw another rank go away or never arrive: a transport
# error anywhere in its traceback (the first group), or a timeout as its last line
_TRANSPORT_MARKERS = (
    "Connection closed by peer",  # gloo
    "Connection reset by peer",
    "Broken pipe",
    "TransferStallError",  # a weight sync that waited out its stall timeout on a peer
    "NixlTransferError",  # NIXL: the peer died or its endpoint broke
    "NixlTimeoutError",
    "nixlRemoteDisconnectError",
    "UCX endpoint",  # "UCX endpoint create failed": the peer's worker address went away
)
_CONSEQUENCE_MARKERS = (
    *_TRANSPORT_MARKERS,
    "CoordinatorTimeoutError",
    "DistNetworkError",
    "Socket Timeout",
    "timed out",
    "Timed out",
    "ECONNRESET",
    "EPIPE",
)


def looks_like_consequence(failure: WorkerFailure) -> bool:
    """Whether a rank's error reads as a reaction to a peer's failure, not a failure of its own:
    a transport error (closed connection, NIXL/UCX endpoint error, stalled transfer) or a
    timeout. A rank that died (signal, non-zero exit) without a traceback is never one."""
    if failure.kind != "raised" or not failure.traceback:
        return False
    last = failure.traceback.strip().splitlines()[-1:] or [""]
    return any(m in failure.traceback for m in _TRANSPORT_MARKERS) or any(
        m in last[0] for m in _CONSEQUENCE_MARKERS
    )


def mark_causes(failures: Sequence[WorkerFailure]) -> list[WorkerFailure]:
    """Mark the first rank to fail as the cause and the others as its consequences.

    "First" is the earliest failure whose error is not a reaction to a peer (a closed connection,
    a timeout), by the time it happened. When every error is such a reaction, the ranks still
    running that lag behind (``kind="hung"`` with ``cause``) are the cause; else the earliest.
    """
    done = [f for f in failures if f.kind != "hung"]
    own = [f for f in done if not looks_like_consequence(f)]
    lagging = [f for f in failures if f.kind == "hung" and f.cause]
    if own:
        first: WorkerFailure | None = min(own, key=lambda f: (f.at, f.rank))
    elif lagging or not done:
        first = None
    else:
        first = min(done, key=lambda f: (f.at, f.rank))
    out = []
    for f in failures:
        if f.kind == "hung":
            out.append(replace(f, cause=f.cause and not own))
        else:
            out.append(replace(f, cause=f is first))
    return out


def exit_failure(rank: int, exitcode: int | None, when: str, at: float) -> WorkerFailure:
    """A worker that ended without a traceback: its exit code or signal, named."""
    kind = "signal" if exitcode is not None and exitcode < 0 else "exited"
    if when == "after returning its result":
        kind = "exit_after_result"
    return WorkerFailure(
        rank=rank,
        reason=f"{describe_exit(exitcode)} {when}",
        kind=kind,
        exit_code=exitcode if exitcode is not None and exitcode >= 0 else None,
        signal=-exitcode if exitcode is not None and exitcode < 0 else None,
        at=at,
    )


def raised_failure(rank: int, outcome: WorkerOutcome, at: float) -> WorkerFailure:
    """A worker whose task raised: its traceback, and when it raised."""
    return WorkerFailure(
        rank=rank,
        reason="raised an exception",
        traceback=outcome.traceback,
        port_taken=outcome.port_taken,
        kind="raised",
        at=outcome.failed_at or at,
    )


# -- arguments, checked in the parent before any worker starts ---------------------------------
def check_n_tasks(value: Any) -> int:
    """``n_tasks`` as a positive int (a bool is not a count)."""
    if type(value) is not int or value < 1:
        raise ValueError(f"n_tasks must be a positive int (the number of ranks), got {value!r}")
    return value


def check_seconds(name: str, value: Any, *, allow_none: bool = True) -> float | None:
    """A finite, positive number of seconds (``None`` = no limit, where allowed)."""
    if value is None and allow_none:
        return None
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        limit = " or None for no limit" if allow_none else ""
        raise ValueError(f"{name} must be a finite number of seconds > 0{limit}, got {value!r}")
    return float(value)


def check_port(value: Any) -> int | None:
    """``master_port``: None (pick a free one) or an int TCP port."""
    if value is None:
        return None
    if type(value) is not int or not 0 < value < 65536:
        raise ValueError(
            f"master_port must be an int in 1..65535, or None to pick a free port, got {value!r}"
        )
    return value


def check_env(value: Any) -> dict[str, str]:
    """``env``: a mapping of str to str (``{"FOO": "1"}``, not ``{"FOO": 1}``)."""
    env = dict(value or {})
    for key, item in env.items():
        if not isinstance(key, str) or not isinstance(item, str):
            raise TypeError(
                f"env must map str to str; {key!r}: {item!r} is not: write {key!r}: {str(item)!r}"
            )
    return env


def check_host(value: Any) -> str:
    """``master_addr``: a name or address that resolves here."""
    if not isinstance(value, str) or not value:
        raise TypeError(f"master_addr must be a host name or address, got {value!r}")
    try:
        socket.getaddrinfo(value.strip("[]"), None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ValueError(
            f"master_addr {value!r} does not resolve ({exc}); give an address of this machine "
            "such as '127.0.0.1'"
        ) from None
    return value


def spawn_guard_error() -> SystemExit | None:
    """The error for a launch started while a spawned worker re-imports the user's script.

    A ``SystemExit`` with one sentence: the worker prints it alone (no traceback through
    multiprocessing's bootstrap) and exits with code 1, which the parent reports.
    """
    import multiprocessing

    if not getattr(multiprocessing.current_process(), "_inheriting", False):
        return None
    return SystemExit(
        "vllm_dist: launch() ran while a worker was importing your script; put the code that "
        'launches under `if __name__ == "__main__":` (the spawn start method imports the '
        "script again in every worker)"
    )


def unguarded_launch_error(start_method: str) -> RuntimeError | None:
    """The error for a launch called from the top level of a script without the
    ``if __name__ == "__main__":`` guard, found in the parent before any worker starts.

    With spawn or forkserver every worker imports the main script again (as multiprocessing's
    ``prepare`` does) and would launch again. Looks for the main module's frame on the stack and
    reads the script with ``ast``: a statement at the top level, not inside any ``if``, is
    unguarded. Anything it cannot read (no script, an ``if`` of another kind) is let through;
    a worker that reaches a launch is still stopped by ``spawn_guard_error``.
    """
    if start_method == "fork":
        return None
    main = sys.modules.get("__main__")
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    path = getattr(main, "__file__", None)
    if spec_name is not None and (spec_name == "__main__" or spec_name.endswith(".__main__")):
        return None  # ``python -m pkg``: multiprocessing does not run pkg/__main__.py again
    if not isinstance(path, str) or os.path.splitext(os.path.basename(path))[0] == "ipython":
        return None
    frame = sys._getframe(1)
    while frame is not None and not (
        frame.f_globals is vars(main) and frame.f_code.co_name == "<module>"
    ):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None or os.path.abspath(frame.f_code.co_filename) != os.path.abspath(path):
        return None  # not the script's own code (exec of other text): nothing to read
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None
    if guarded_line(tree, frame.f_lineno):
        return None
    return RuntimeError(
        f"launch() runs at the top level of {os.path.basename(path)} (line {frame.f_lineno}), "
        "which every worker imports again: put the code that launches under `if __name__ == "
        '"__main__":` (the spawn start method imports the script again in every worker)'
    )


def guarded_line(tree: ast.Module, line: int) -> bool:
    """Whether top-level code at ``line`` sits inside an ``if`` (or ``match``), or is not found."""
    node: ast.AST = tree
    while True:
        inner = [
            child
            for child in ast.iter_child_nodes(node)
            if isinstance(child, (ast.stmt, ast.excepthandler, ast.match_case))
            and getattr(child, "lineno", line + 1) <= line <= (getattr(child, "end_lineno", 0) or 0)
        ]
        if not inner:
            return node is tree  # a line no statement holds: the source changed; let it through
        node = inner[0]
        if isinstance(node, (ast.If, ast.Match)):
            return True
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return True  # its body runs when called; only a decorator line would run now


# -- restarts ------------------------------------------------------------------------------------
def check_max_restarts(value: Any) -> int:
    """``max_restarts``: an int >= 0 (a bool is not a count)."""
    if type(value) is not int or value < 0:
        raise ValueError(
            f"max_restarts must be an int >= 0 (how many times a failed launch starts again), "
            f"got {value!r}"
        )
    return value


def one_line(error: LaunchError) -> str:
    """A failed try in one line: the first rank to fail, how, and its error's last line."""
    first = error.first
    if first is None:
        return str(error).splitlines()[0]
    last = first.traceback.strip().splitlines()[-1:] or [""]
    return f"rank {first.rank} {first.reason}" + (f" ({last[0]})" if last[0] else "")


def tries_failed(errors: Sequence[LaunchError], max_restarts: int) -> LaunchError:
    """The error of a launch whose every try failed: the last try's failures (and error type),
    a summary that counts the tries and gives each earlier one in a line, and
    ``earlier_tries``. One try only: its own error, unchanged."""
    last = errors[-1]
    if len(errors) == 1:
        return last
    lines = [f"launch failed on all {len(errors)} tries (max_restarts={max_restarts}):"]
    lines += [f"  try {i}: {one_line(e)}" for i, e in enumerate(errors[:-1], 1)]
    lines.append(f"  try {len(errors)} (below): {str(last).splitlines()[0]}")
    summary = "\n".join(lines)
    return type(last)(last.failures, summary=summary, earlier_tries=errors[:-1])
