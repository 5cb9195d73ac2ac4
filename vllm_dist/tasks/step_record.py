"""The data-plane step a worker entered last, kept where its launcher looks for a hung rank.

Beside its coordinator's record (the last collective), a worker's progress file
(``PROGRESS_FILE_ENV``) holds one more fixed-size record at ``TASK_RECORD_OFFSET``: the step of
a weight sync it entered last and the peer ranks that step involves ("producer 0: serving group
12 to consumer 1 in sync 2", peers ``[3]``). When a sync stalls, the launcher reads both records
of every rank, names the rank(s) that the failed ranks were waiting for first, and says what each
was doing. One ``pwrite`` rewrites the record in place, written only when the step changes, so a
record costs a system call per step and nothing grows. Rejected: a record in the coordinator's
store, which needs a live connection exactly when a peer is hung.
"""

from __future__ import annotations

import contextlib
import os
import time
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

from vllm_dist.interfaces.launcher import PROGRESS_FILE_ENV, TASK_RECORD_BYTES, TASK_RECORD_OFFSET


class StepRecord:
    """The last step this worker entered (``enter``) or left (``leave``), for its launcher.

    Args:
        who: how the record names this worker (``"producer 0"``).
        path: the progress file; None = ``PROGRESS_FILE_ENV``, unset (torchrun): nothing is written.
    """

    def __init__(self, who: str, path: str | None = None) -> None:
        self.who = who
        self._fd = -1
        self._last: tuple[str, str] | None = None
        path = path if path is not None else os.environ.get(PROGRESS_FILE_ENV)
        if path:
            with contextlib.suppress(OSError):
                self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
                weakref.finalize(self, os.close, self._fd)

    def enter(self, step: str, peers: Iterable[int] = ()) -> None:
        """Record entering ``step``, which waits on or serves the global ranks ``peers``."""
        self._write("in", step, peers)

    def leave(self, step: str) -> None:
        """Record that ``step`` returned."""
        self._write("after", step, ())

    def _write(self, state: str, step: str, peers: Iterable[int]) -> None:
        if self._fd < 0 or self._last == (state, step):
            return
        self._last = (state, step)
        ranks = ", ".join(str(int(r)) for r in peers)
        record = f"{state} {self.who}: {step} peers=[{ranks}] t={time.time():.3f}"
        data = record.encode()[:TASK_RECORD_BYTES].ljust(TASK_RECORD_BYTES)
        with contextlib.suppress(OSError):
            os.pwrite(self._fd, data, TASK_RECORD_OFFSET)


class SyncSteps(StepRecord):
    """A weight-sync engine's steps (``sync_begins``, ``serving``, ``synced`` below are the
    one-line calls its engine makes).

    Args:
        role: ``"producer"`` or ``"consumer"``.
        index: the engine's producer or consumer index.
        peer_ranks: global rank of each peer index (the fleet's consumer ranks for a producer,
            its producer ranks for a consumer).
    """

    def __init__(
        self, role: str, index: int, peer_ranks: Sequence[int], path: str | None = None
    ) -> None:
        super().__init__(f"{role} {index}", path)
        self._peer_ranks = list(peer_ranks)
        self._peer_role = "consumer" if role == "producer" else "producer"
        self._serving: tuple[int, int, int] | None = None

    def sync_begins(self, sync: int, peers: Iterable[int]) -> None:
        """Entering sync ``sync`` with peer indices ``peers`` (a producer's consumers, a
        consumer's producers): a consumer waits on them from here on."""
        idx = sorted(peers)
        verb = "serving" if self._peer_role == "consumer" else "receiving from"
        self._serving = None
        self.enter(
            f"sync {sync}, {verb} {self._peer_role}(s) {idx}", (self._peer_ranks[i] for i in idx)
        )

    def serving(self, sync: int, group: int, consumer: int) -> None:
        """A producer serving ``group`` to ``consumer`` in sync ``sync`` (per chunk; cheap when
        nothing changed)."""
        key = (sync, group, consumer)
        if key != self._serving:
            self._serving = key
            self.enter(
                f"serving group {group} to consumer {consumer} in sync {sync}",
                (self._peer_ranks[consumer],),
            )

    def synced(self, sync: int) -> None:
        """Sync ``sync`` returned."""
        self._serving = None
        self.leave(f"sync {sync}")


def _steps(engine: Any) -> SyncSteps:
    """The engine's ``SyncSteps``, made at its first step (kept as ``engine.sync_steps``)."""
    steps: SyncSteps | None = getattr(engine, "sync_steps", None)
    if steps is None:
        fleet = engine.fleet
        if hasattr(engine, "producer_id"):
            steps = SyncSteps("producer", engine.producer_id, fleet.consumer_ranks)
        else:
            steps = SyncSteps("consumer", engine.consumer_id, fleet.producer_ranks)
        engine.sync_steps = steps
    return steps


def sync_begins(engine: Any) -> None:
    """Mark ``"sync"`` in the engine's trace and record that its next sync begins, with the
    peers it has pairs with (called before the engine counts the sync)."""
    engine._mark("sync")
    _steps(engine).sync_begins(engine._syncs + 1, engine._pairs)


def serving(engine: Any, group: int, consumer: int) -> None:
    """Record that a producer serves ``group`` to ``consumer`` in its current sync."""
    _steps(engine).serving(engine._syncs, group, consumer)


def synced(engine: Any) -> int:
    """Record that the engine's current sync returned; returns that sync's number."""
    steps = _steps(engine)
    steps.synced(engine._syncs)
    return int(engine._syncs)
