"""Where the output of MPLauncher's workers goes: the console, per-rank log files, error files.

The layout under ``log_dir`` is torchelastic's, so tools written for torchrun's ``--log-dir`` find
their way: ``<log_dir>/<run>/attempt_<try>/<rank>/stdout.log``, ``stderr.log`` and, for a failed
rank, ``error.json`` (rank, pid, host, exit code or signal, time, traceback). The parent reads
each worker's stdout and stderr from a pipe and writes every chunk to the sinks that want it (its
file; the console with a ``[rankN]:`` prefix), so one thread serves the files, ``tee`` and the
rank filter. Rejected alternative: pointing the worker's descriptors at its files and tailing
them for the console (torchelastic's tee), which needs a polling reader per file.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing.connection as mpc
import os
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import IO, Any

from vllm_dist.interfaces import WorkerFailure

STREAMS = ("stdout", "stderr")
_TEE = {
    False: frozenset(),
    "none": frozenset(),
    "stdout": frozenset({"stdout"}),
    "stderr": frozenset({"stderr"}),
    True: frozenset(STREAMS),
    "all": frozenset(STREAMS),
}


def check_log_dir(value: Any) -> str | None:
    """``log_dir``: None, or a folder that exists and is writable or can be created."""
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise TypeError(f"log_dir must be a folder path or None, got {value!r}")
    path = os.path.abspath(os.fspath(value))
    probe = path
    while not os.path.exists(probe):  # the nearest folder that exists will hold the new ones
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ValueError(f"log_dir {path!r}: {probe!r} is a file, not a folder; give a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(
            f"log_dir {path!r}: cannot write in {probe!r} (permission denied); give a folder "
            "you can write to"
        )
    return path


def check_tee(value: Any) -> frozenset[str]:
    """``tee``: which of a rank's streams also reach the console when ``log_dir`` is given."""
    try:
        return _TEE[value]
    except (KeyError, TypeError):
        raise ValueError(
            f"tee must be one of False/'none', 'stdout', 'stderr', True/'all', got {value!r}"
        ) from None


def check_console_ranks(value: Any, n_tasks: int) -> frozenset[int] | None:
    """``console_ranks``: None (every rank) or the ranks whose output the console shows."""
    if value is None:
        return None
    try:
        ranks = list(value)
    except TypeError:
        raise TypeError(f"console_ranks must be a list of ranks or None, got {value!r}") from None
    bad = [r for r in ranks if type(r) is not int or not 0 <= r < n_tasks]
    if bad:
        raise ValueError(
            f"console_ranks: {bad} are not ranks of a launch of n_tasks={n_tasks} "
            f"(give ints in 0..{n_tasks - 1})"
        )
    return frozenset(ranks)


@dataclass(frozen=True, kw_only=True, slots=True)
class OutputPlan:
    """Where each rank's stdout and stderr go.

    ``log_dir``: the folder of the per-rank files (None: no files). ``tee``: the streams that also
    reach the console when there are files. ``console_ranks``: the ranks the console shows (None:
    all). ``prefix``: console lines carry ``[rankN]:``.
    """

    log_dir: str | None = None
    tee: frozenset[str] = frozenset()
    console_ranks: frozenset[int] | None = None
    prefix: bool = True

    @property
    def forwards(self) -> bool:
        """Whether workers write to pipes the parent reads (else straight to its terminal)."""
        return self.prefix or self.log_dir is not None or self.console_ranks is not None

    def to_console(self, rank: int, stream: str) -> bool:
        """Whether ``stream`` of ``rank`` is shown on the parent's console."""
        if self.console_ranks is not None and rank not in self.console_ranks:
            return False
        return self.log_dir is None or stream in self.tee


def new_run_dir(log_dir: str) -> str:
    """A fresh folder under ``log_dir`` for one launch (all its tries); created now."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = os.path.join(log_dir, f"run_{stamp}_{secrets.token_hex(3)}")
    os.makedirs(path)
    return path


def rank_dir(run_dir: str, attempt: int, rank: int) -> str:
    """The folder of one rank's files in one try (torchelastic's ``attempt_<n>/<rank>``)."""
    return os.path.join(run_dir, f"attempt_{attempt}", str(rank))


def write_error_file(
    folder: str, failure: WorkerFailure, *, pid: int | None, restart_count: int
) -> str:
    """Write ``error.json`` for a failed rank into its folder; returns its path."""
    path = os.path.join(folder, "error.json")
    record = {
        "rank": failure.rank,
        "pid": pid,
        "host": socket.gethostname(),
        "exit_code": failure.exit_code,
        "signal": failure.signal,
        "time": failure.at or time.time(),
        "restart_count": restart_count,
        "reason": failure.reason,
        "kind": failure.kind,
        "cause": failure.cause,
        "last_op": failure.last_op,
        "traceback": failure.traceback,
    }
    os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
    return path


@dataclass(slots=True)
class Sink:
    """One place a stream goes: a text console with a line prefix, or a binary file."""

    stream: IO[Any]
    prefix: str | None = None  # None: a file, written as the bytes arrive
    pending: list[bytes] = field(default_factory=list)  # a console's unfinished line


class OutputForwarder:
    """One thread that copies each worker stream to its sinks (console lines get a prefix)."""

    def __init__(self) -> None:
        self._sel = selectors.DefaultSelector()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._files: list[IO[Any]] = []
        self._wake_r, self._wake_w = os.pipe()
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)

    def add(self, conn: mpc.Connection, sinks: Iterable[Sink]) -> None:
        """Read ``conn`` until EOF into ``sinks`` (none: the stream is read and dropped)."""
        sinks = list(sinks)
        self._files += [s.stream for s in sinks if s.prefix is None]
        with self._lock:
            self._sel.register(conn.fileno(), selectors.EVENT_READ, (conn, sinks))

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="vllm_dist-output", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._lock:
                if len(self._sel.get_map()) <= 1:
                    return
            for key, _ in self._sel.select(timeout=0.5):
                if key.data is None:
                    return
                conn, sinks = key.data
                chunk = os.read(key.fd, 65536)
                for sink in sinks:
                    _emit(sink, chunk, final=not chunk)
                if not chunk:
                    with self._lock:
                        self._sel.unregister(key.fd)
                    conn.close()

    def close(self, timeout: float) -> None:
        if self._thread is not None:
            self._thread.join(timeout=timeout)
            if self._thread.is_alive():
                os.write(self._wake_w, b"x")  # a grandchild still holds a pipe: stop reading
                self._thread.join(timeout=1.0)
        os.close(self._wake_w)
        os.close(self._wake_r)
        self._sel.close()
        for f in self._files:
            with contextlib.suppress(OSError):
                f.close()


def _emit(sink: Sink, chunk: bytes, final: bool) -> None:
    try:
        if sink.prefix is None:
            if chunk:
                sink.stream.write(chunk)
            sink.stream.flush()
            return
        _emit_lines(sink, chunk, final)
    except (ValueError, OSError):
        pass  # the stream is closed or its disk full: drop the output rather than fail the launch


def _emit_lines(sink: Sink, chunk: bytes, final: bool) -> None:
    data = b"".join(sink.pending) + chunk
    lines = data.split(b"\n")
    rest = lines.pop()
    if final and rest:
        lines.append(rest)
        rest = b""
    sink.pending[:] = [rest] if rest else []
    if not lines:
        return
    text = "".join(f"{sink.prefix}{ln.decode(errors='replace')}\n" for ln in lines)
    sink.stream.write(text)
    sink.stream.flush()
