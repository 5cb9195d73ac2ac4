"""Reading a worker's progress records: what it entered last, and who lags behind.

A worker's progress file (``PROGRESS_FILE_ENV``) holds two fixed-size records rewritten in place:
its coordinator's last operation (``in barrier #3 group=[0, 1] t=...``) and, from
``TASK_RECORD_OFFSET``, the last data-plane step of its task (``in producer 0: serving group 12
to consumer 1 in sync 2 peers=[3] t=...``). When a launch fails on reactions only (a closed
connection, a stalled transfer) or times out, the launcher reads them to say what each rank was
doing and which rank(s) the others wait for. Rejected: asking the workers themselves, which a
hung worker cannot answer.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from vllm_dist.interfaces.launcher import TASK_RECORD_OFFSET

_COORDINATOR = re.compile(r"(in|after) (.+?) #(\d+) group=\[([\d, ]*)\] t=([\d.]+)")
_STEP = re.compile(r"(in|after) (.+?) peers=\[([\d, ]*)\] t=([\d.]+)")


def _ranks(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


@dataclass(frozen=True, slots=True)
class Progress:
    """A worker's records as read: ``coordinator`` is (state, operation, number, group, time),
    ``step`` is (state, step, peers, time); either is None when the worker wrote none."""

    coordinator: tuple[str, str, int, tuple[int, ...], float] | None = None
    step: tuple[str, str, tuple[int, ...], float] | None = None

    def waits_on(self) -> tuple[int, ...]:
        """The ranks this worker's unfinished data-plane step involves (none once it left)."""
        if self.step is None or self.step[0] != "in":
            return ()
        return self.step[2]


def read_progress(path: str) -> Progress | None:
    """Both records of the progress file at ``path``; None when it cannot be read."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    head = data[:TASK_RECORD_OFFSET].decode(errors="replace").strip()
    tail = data[TASK_RECORD_OFFSET:].decode(errors="replace").strip()
    coordinator = step = None
    m = _COORDINATOR.fullmatch(head)
    if m is not None:
        group = _ranks(m.group(4))
        coordinator = (m.group(1), m.group(2), int(m.group(3)), group, float(m.group(5)))
    s = _STEP.fullmatch(tail)
    if s is not None:
        step = (s.group(1), s.group(2), _ranks(s.group(3)), float(s.group(4)))
    return Progress(coordinator, step)


def describe_progress(progress: Progress | None) -> str:
    """One line for an error: the newest record first, each with how long ago it was written."""
    now = time.time()
    parts: list[tuple[float, int, str]] = []  # (time, 0 for the task's step, text)
    if progress is not None and progress.coordinator is not None:
        state, op, n, group, t = progress.coordinator
        where = "inside" if state == "in" else "returned from"
        ago = max(0.0, now - t)
        parts.append((t, 1, f"{where} {op} #{n} on ranks {list(group)}, {ago:.1f} s ago"))
    if progress is not None and progress.step is not None:
        state, step, _, t = progress.step
        where = "in" if state == "in" else "after"
        parts.append((t, 0, f"{where} {step}, {max(0.0, now - t):.1f} s ago"))
    if not parts:
        return "none entered yet"
    parts.sort(key=lambda p: (-p[0], p[1]))  # newest first; the step, more precise, on a tie
    if len(parts) == 1:
        return parts[0][2]
    return f"{parts[0][2]} (before that: {parts[1][2]})"


def lagging_ranks(
    records: Mapping[int, Progress | None], live: list[int], failed: Iterable[int] = ()
) -> list[int]:
    """Live ranks that the others wait for.

    First the ranks that a ``failed`` rank's unfinished data-plane step involves (it gave up
    waiting on them: a stalled sync names its peer). Else, by the coordinator records: live
    ranks not inside a coordinator operation while a peer of the group is, or inside an earlier
    one of the same group.
    """
    waited: set[int] = set()
    for f in failed:
        record = records.get(f)
        if record is not None:
            waited.update(record.waits_on())
    named = [r for r in live if r in waited]
    if named:
        return named
    coord = {r: p.coordinator for r, p in records.items() if p is not None}
    out = []
    for r in live:
        mine = coord.get(r)
        for peer, rec in coord.items():
            if peer == r or rec is None or rec[0] != "in" or r not in rec[3]:
                continue
            if mine is None or mine[0] != "in" or (mine[3] == rec[3] and mine[2] < rec[2]):
                out.append(r)
                break
    return out
