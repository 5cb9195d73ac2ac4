"""The fault matrix: kill or hang one role of a weight-sync fleet at one phase, and what follows.

One case is one launch of a producer and a consumer (ranks 0 and 1) on the CPU: the injected
rank ends itself with SIGKILL or stops forever (a sleep on its main thread) at set-up, in the
middle of sync 2, between syncs 1 and 2, or in sync 2 replayed (the READ path, which replays
every sync after the first). ``run_case`` reports what a user sees: the error's type, the rank it
lists first and what it says that rank was doing, each consumer's state (torn, version) as the
consumer itself reported it, and the worker processes left alive afterwards. Shared by
``tests/test_fault_matrix.py`` and ``benchmarks/faults.py``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from vllm_dist import CommunicatorType, CoordinatorType, Launcher, LaunchError, MPLauncher
from vllm_dist.examples.llama_tp import llama_shapes, tiny_llama_config
from vllm_dist.examples.weight_sync_demo import LlamaTransferTask
from vllm_dist.tasks.weight_transfer import (
    StateDictSource,
    TornModelError,
    TransferConfig,
    WeightConsumer,
    WeightProducer,
)

ROLES = ("producer", "consumer")
PHASES = ("setup", "mid_sync", "between_syncs", "replayed_sync")
FAULTS = ("kill", "hang")
TRANSPORTS = ("torch_distributed", "nixl_rdt")
FAULT_SYNC = 2  # the sync a mid-sync or replayed-sync fault hits (the first one is whole)
STALL_S = 3.0  # the transfers' stall timeout: how long a peer waits on a hung one
# the collectives' timeout per launcher (a set-up fault ends there; Ray actors start slower)
COORDINATOR_S = {"mp": 8.0, "ray": 15.0}


@dataclass(frozen=True)
class Case:
    """One fault: ``role`` is hit at ``phase`` by ``fault`` over ``transport``."""

    role: str
    phase: str
    fault: str
    transport: str
    launcher: str = "mp"

    @property
    def id(self) -> str:
        return f"{self.launcher}-{self.transport}-{self.role}-{self.phase}-{self.fault}"

    @property
    def rank(self) -> int:
        """The rank the fault hits: the producer (0) or the consumer (1)."""
        return 0 if self.role == "producer" else 1

    def valid(self) -> bool:
        """A replayed sync exists on the READ path only."""
        return self.phase != "replayed_sync" or self.transport == "nixl_rdt"


@dataclass
class Outcome:
    """What a case ended with, as a user sees it."""

    case: Case
    seconds: float
    error: str  # the exception type, or "none"
    first_rank: int | None
    first_kind: str
    first_last_op: str
    consumers: dict[int, str] = field(default_factory=dict)  # consumer index -> state
    leftovers: list[int] = field(default_factory=list)  # worker pids alive afterwards
    text: str = ""

    def row(self) -> dict[str, Any]:
        return {
            "fault": self.case.id,
            "seconds_to_error": round(self.seconds, 1),
            "error": self.error,
            "names": f"rank {self.first_rank} ({self.first_kind}): {self.first_last_op}",
            "consumers": "; ".join(f"c{c}: {s}" for c, s in sorted(self.consumers.items()))
            or "stopped by the launcher before reporting",
            "leftovers": len(self.leftovers),
        }


def _fault_here(fault: str) -> None:
    if fault == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(3600)  # hung: only the launcher ends it


class _Faults:
    """The fault a task was launched with, and whether this rank is the one it hits."""

    def __init__(self, spec: dict[str, Any], rank: int, pid_dir: str | None = None) -> None:
        self.spec = spec
        self.mine = rank == spec["rank"]
        if pid_dir is not None:
            with open(os.path.join(pid_dir, str(os.getpid())), "w"):
                pass  # the test looks for this pid afterwards
        os.environ[_FAULT_ENV] = json.dumps(spec)  # for the engine, built by the base task

    def hit(self, phase: str) -> None:
        if self.mine and self.spec["phase"] == phase:
            _fault_here(self.spec["fault"])


_FAULT_ENV = "VLLM_DIST_TEST_FAULT"


class FaultySource(StateDictSource):
    """A producer's source that faults at its second group of sync ``FAULT_SYNC``."""

    faults: _Faults
    armed = False  # set by the producer for sync ``FAULT_SYNC`` only
    opened = 0

    def open_group(self, names: Any) -> Any:
        self.opened += 1
        if self.armed and self.opened == 2:
            self.faults.hit("mid_sync")
        return super().open_group(names)

    def begin_sync(self) -> None:
        self.opened = 0
        super().begin_sync()


class FaultyProducer(WeightProducer):
    """A producer that arms its source for sync ``FAULT_SYNC`` only, and faults in that sync
    replayed once its consumers were told to read it."""

    def sync(self) -> Any:
        if isinstance(self.source, FaultySource):
            self.source.armed = self._syncs + 1 == FAULT_SYNC
        return super().sync()

    def _mark(self, event: str) -> None:
        super()._mark(event)
        source = self.source
        if event == "told" and isinstance(source, FaultySource) and source.armed:
            source.faults.hit("replayed_sync")  # its consumers were told to read the replay


class FaultyConsumer(WeightConsumer):
    """Faults at its second unpack or first landed read of sync ``FAULT_SYNC`` (or as that sync
    begins, replayed); on a failed sync, raises a line with its own state beside the
    ``TornModelError``."""

    unpacks = 0

    @property
    def faults(self) -> _Faults | None:
        """The fault of this launch (the task sets it in this worker's environment)."""
        if "_faults" not in self.__dict__:
            spec = os.environ.get(_FAULT_ENV)
            rank = self.coordinator.get_rank()
            self.__dict__["_faults"] = None if spec is None else _Faults(json.loads(spec), rank)
        return self.__dict__["_faults"]  # type: ignore[no-any-return]

    def _unpacker(self, j: int) -> Any:
        self._count_unpack()
        return super()._unpacker(j)

    def _unpack_program(self, j: int) -> Any:
        self._count_unpack()
        return super()._unpack_program(j)

    def _mark(self, event: str) -> None:
        super()._mark(event)
        if event == "read done" and self._syncs == FAULT_SYNC and self.faults is not None:
            self.faults.hit("mid_sync")  # the READ path: a first batch has landed, unreported

    def _count_unpack(self) -> None:
        if self._syncs == FAULT_SYNC and self.faults is not None:
            self.unpacks += 1
            if self.unpacks == 2:
                self.faults.hit("mid_sync")

    def sync(self) -> Any:
        if self._syncs + 1 == FAULT_SYNC and self.faults is not None:
            self.faults.hit("replayed_sync")
        try:
            return super().sync()
        except TornModelError as exc:
            raise RuntimeError(
                f"STATE consumer={self.consumer_id} torn={self.torn} version={self.version} "
                f"target={exc.target} | {exc}"
            ) from exc


class FaultyTask(LlamaTransferTask):
    """The demo fleet with ``fault={"rank", "phase", "fault"}`` injected."""

    producer_class = FaultyProducer
    consumer_class = FaultyConsumer

    def _faults(self, fault: dict[str, Any], pid_dir: str) -> _Faults:
        return _Faults(fault, self.coordinator.get_rank(), pid_dir)

    def make_source(self, producer_idx: int, num_producers: int, **kw: Any) -> Any:
        faults = self._faults(kw["fault"], kw["pid_dir"])
        faults.hit("setup")
        super().make_source(producer_idx, num_producers, **kw)  # sets self._state
        source = FaultySource(self._state, held=None)
        source.faults = faults
        self._fault_state = faults
        return source

    def make_consumer(self, consumer_idx: int, num_consumers: int, **kw: Any) -> Any:
        faults = self._faults(kw["fault"], kw["pid_dir"])
        faults.hit("setup")
        self._fault_state = faults
        return super().make_consumer(consumer_idx, num_consumers, **kw)

    def before_producer_sync(self, step: int, source: Any, **kw: Any) -> None:
        if step == FAULT_SYNC - 1:
            self._fault_state.hit("between_syncs")
        super().before_producer_sync(step, source, **kw)

    def before_consumer_sync(self, step: int, spec: Any, **kw: Any) -> None:
        if step == FAULT_SYNC - 1:
            self._fault_state.hit("between_syncs")
        super().before_consumer_sync(step, spec, **kw)


def transfer_config(case: Case) -> TransferConfig:
    if case.transport == "nixl_rdt" and case.phase != "replayed_sync":
        return TransferConfig(stall_timeout=STALL_S, replay=False)  # chunk by chunk
    return TransferConfig(stall_timeout=STALL_S)


def make_launcher(case: Case, timeout: float) -> Launcher:
    if case.launcher == "ray":
        from vllm_dist import RayLauncher

        return RayLauncher(2, timeout=timeout)
    return MPLauncher(2, timeout=timeout)


_STATE = re.compile(r"STATE consumer=(\d+) torn=(\w+) version=(\w+) target=(\w+)")


def run_case(case: Case, timeout: float | None = None, gone_wait: float = 15.0) -> Outcome:
    """Launch ``case``'s fleet for three syncs, with its fault, and report what it ended with;
    ``timeout``: the launch's (default 60 s, 120 s under Ray, whose actors start slower)."""
    if timeout is None:
        timeout = 120.0 if case.launcher == "ray" else 60.0
    from tests.test_launcher import _wait_gone

    pid_dir = tempfile.mkdtemp(prefix="faults-")
    comm = CommunicatorType(case.transport)
    wait = COORDINATOR_S[case.launcher]
    kw: dict[str, Any] = {"coordinator_options": {"timeout": wait}}
    if comm == CommunicatorType.NIXL_RDT:
        kw["communicator_options"] = {"timeout": wait}
    spec = {"rank": case.rank, "phase": case.phase, "fault": case.fault}
    start = time.monotonic()
    error: BaseException | None = None
    try:
        make_launcher(case, timeout).launch(
            task_type=FaultyTask,
            coordinator_type=CoordinatorType.TORCH_DISTRIBUTED,
            communicator_type=comm,
            device="cpu",
            num_producers=1,
            num_consumers=1,
            tp_size=1,
            syncs=3,
            shapes=llama_shapes(tiny_llama_config()),
            config=transfer_config(case),
            fault=spec,
            pid_dir=pid_dir,
            **kw,
        )
    except LaunchError as exc:
        error = exc
    seconds = time.monotonic() - start
    pids = {int(p) for p in os.listdir(pid_dir)}
    left = sorted(_wait_gone(pids, timeout=gone_wait))
    for p in pids:
        os.unlink(os.path.join(pid_dir, str(p)))
    os.rmdir(pid_dir)
    first = error.failures[0] if isinstance(error, LaunchError) and error.failures else None
    text = str(error) if error is not None else ""
    states = {int(c): f"torn={t} version={v} target={g}" for c, t, v, g in _STATE.findall(text)}
    return Outcome(
        case=case,
        seconds=seconds,
        error=type(error).__name__ if error is not None else "none",
        first_rank=None if first is None else first.rank,
        first_kind="" if first is None else first.kind,
        first_last_op="" if first is None else first.last_op,
        consumers=states,
        leftovers=left,
        text=text,
    )
