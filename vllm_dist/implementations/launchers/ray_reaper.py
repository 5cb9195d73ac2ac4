"""Stop every process of a private Ray when the driver that started it dies, SIGKILL included.

Ray ties its GCS and raylet to the driver that started them, but the raylet's dashboard and
runtime-env agents outlive a killed driver: they poll for their parent and stay up, listening,
for about a minute. ``RayReaper`` is a small stdlib-only Python process started after
``ray.init``: it keeps a fresh list of the Ray node processes and everything they started (read
from ``/proc`` every ``POLL_S`` seconds, each pid with its start time, so a reused pid is never
hit) and blocks on a pipe whose only write end the driver holds. EOF means the driver is gone,
however it ended (or ``close()``d it after ``ray.shutdown``): the reaper SIGKILLs what is left of
that list and exits. Rejected: a forked watcher (the driver already runs Ray's threads, and a
fork of a threaded process may only call async-signal-safe functions), and the agents' own
parent polling, which is what takes a minute.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterable
from typing import Any

POLL_S = 0.25  # how often the reaper refreshes its list of Ray's processes

_REAPER = r"""
import os, select, signal, sys

roots = {int(p) for p in sys.argv[2:]}
poll = float(sys.argv[1])


def table():
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
                out[int(name)] = (int(fields[1]), fields[19])  # parent, start time
            except (OSError, IndexError, ValueError):
                pass
    return out


def tree(known):
    procs = table()
    found = {p for p in roots if p in procs}
    grew = True
    while grew:
        grew = False
        for pid, (parent, _) in procs.items():
            if parent in found and pid not in found:
                found.add(pid)
                grew = True
    for pid in found:
        known.setdefault(pid, procs[pid][1])
    return known


known = tree({})
while True:
    ready, _, _ = select.select([0], [], [], poll)
    if ready and not os.read(0, 1):
        break
    tree(known)
procs = table()
for pid, start in tree(known).items():
    if pid in procs and procs[pid][1] == start:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
"""


class RayReaper:
    """The reaper of one private Ray; ``close()`` (after ``ray.shutdown``) ends it.

    Args:
        roots: pids of the Ray node processes (GCS, raylet, monitors) this driver started.
    """

    def __init__(self, roots: Iterable[int]) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        pids = [str(int(p)) for p in roots]
        if not pids or not os.path.isdir("/proc"):
            return
        self._proc = subprocess.Popen(  # noqa: S603 - our own code, no shell
            [sys.executable, "-I", "-c", _REAPER, str(POLL_S), *pids],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            close_fds=True,
            start_new_session=True,  # a Ctrl-C to the driver's group does not end it early
        )

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def close(self, wait: float = 5.0) -> None:
        """Have the reaper stop whatever of Ray is left, and wait for it."""
        if self._proc is None:
            return
        proc, self._proc = self._proc, None
        with contextlib.suppress(OSError):
            assert proc.stdin is not None
            proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=wait)


def ray_node_pids(ray: Any) -> list[int]:
    """The pids of the Ray node processes this driver started; empty when Ray's private
    bookkeeping moved (the reaper then has nothing to watch)."""
    try:
        node = ray._private.worker._global_node
        return [p.process.pid for procs in node.all_processes.values() for p in procs]
    except AttributeError:
        return []
