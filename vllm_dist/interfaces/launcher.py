"""Launcher and DistributedTask: who starts the workers, and what each worker runs.

A launcher owns processes (or actors); a task owns the work. The launcher hands every worker a
``WorkerInfo`` and the launch keywords, and gives back one return value per rank in rank order, or
one ``LaunchError`` that names every failed rank. Launcher-specific options go to the launcher's
constructor so that ``launch(**kwargs)`` means the same thing under every launcher.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

LAUNCH_ID_ENV = "VLLM_DIST_LAUNCH_ID"  # WorkerInfo.launch_id in a worker's environment
# a file where a worker's coordinator records the operation it entered last; the launcher reads it
# to name the rank that never arrived when a collective or the launch times out
PROGRESS_FILE_ENV = "VLLM_DIST_PROGRESS_FILE"
# the file's second record, from this byte on: the task's last data-plane step (the coordinator's
# record fills the bytes before it), ``in|after <who>: <step> peers=[<ranks>] t=<time.time()>``
TASK_RECORD_OFFSET = 200
TASK_RECORD_BYTES = 200
# the launch's shared secret (hex) for workers that a vllm_dist launcher did not start (torchrun,
# srun, mpirun); our launchers hand it over their own channel and never export it
SECRET_ENV = "VLLM_DIST_SECRET"


def new_launch_id() -> str:
    """A fresh ``WorkerInfo.launch_id``."""
    import secrets

    return secrets.token_hex(8)


def new_secret() -> bytes:
    """A fresh launch secret (``WorkerInfo.secret``): 32 random bytes."""
    import secrets

    return secrets.token_bytes(32)


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerInfo:
    """What a worker knows about its place in the launch (torchrun's variables, typed).

    ``local_*`` describe the worker's node: ``local_rank`` picks the worker's device.
    ``launch_id`` names one launch (one try of it): the coordinator keeps its rendezvous under
    it, so that a worker of another launch that reaches the same port (two launches that drew
    the same free port at once) cannot take a place in this one's rendezvous. Empty (torchrun's
    workers, a fleet that two launches join at a port they agreed on): no such fence.
    ``secret`` is what every member of the launch holds and a stranger does not: the coordinator
    admits a peer to the rendezvous, and believes its messages, only once it proved it holds it.
    Empty: no launcher handed one over (torchrun without ``VLLM_DIST_SECRET``), and the control
    plane is as open as torch's own. It is never printed and never exported to the environment.
    ``restart_count``: how many times the launcher restarted this launch before this try.
    """

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    node_rank: int = 0
    launch_id: str = ""
    secret: bytes = field(default=b"", repr=False, compare=False)
    restart_count: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world_size {self.world_size}")
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(
                f"local_rank {self.local_rank} is outside local_world_size {self.local_world_size}"
            )
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port {self.master_port} is not a TCP port")

    def env(self) -> dict[str, str]:
        """The torchrun environment variables that describe this worker."""
        return {
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node_rank),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(self.restart_count),
            **({LAUNCH_ID_ENV: self.launch_id} if self.launch_id else {}),
        }

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WorkerInfo:
        """This worker's place as the launcher that started it describes it: a vllm_dist
        launcher or torchrun (``RANK``, ...), SLURM's srun (``SLURM_PROCID``, ...; rank 0's
        host is the node list's first) or Open MPI's mpirun (``OMPI_COMM_WORLD_*``).

        Raises:
            ValueError: a variable is missing or malformed; the message names it and the fix.
        """
        import os

        from vllm_dist.interfaces.worker_env import worker_fields

        fields = worker_fields(os.environ if environ is None else environ)
        return cls(**fields)


@dataclass(frozen=True, kw_only=True, slots=True)
class WorkerFailure:
    """One failed worker: its rank, how it ended, and its own traceback when it had one.

    ``kind``: ``"raised"``, ``"exited"``, ``"signal"`` (killed), ``"exit_after_result"`` (died
    after returning its result), ``"hung"`` (still running at a timeout) or ``"other"``.
    ``exit_code`` / ``signal``: how the process ended, when known. ``at``: when the failure
    happened (``time.time()``, as the worker or else the parent saw it), which orders causes.
    ``cause``: False for a consequence of another rank's failure (a peer that closed its
    connection, a collective that timed out waiting for it). ``last_op``: the coordinator
    operation and the data-plane step the rank entered last, when the launcher knows them. ``port_taken``: the worker ended
    on ``RendezvousPortTakenError`` for the launch's own rendezvous port, so launching again on
    another port helps. ``log_files``: where the launcher wrote this rank's output and its error
    file, when it was asked to (``MPLauncher(log_dir=...)``).
    """

    rank: int
    reason: str
    traceback: str = ""
    port_taken: bool = False
    kind: str = "other"
    exit_code: int | None = None
    signal: int | None = None
    at: float = 0.0
    cause: bool = True
    last_op: str = ""
    log_files: tuple[str, ...] = ()


class LaunchError(RuntimeError):
    """One or more workers failed; every other worker of the launch has been stopped.

    Attributes:
        failures: one ``WorkerFailure`` per failed rank, causes first (the first rank to fail
            first), then the consequences, each group in the order the failures happened.
        ranks: the failed ranks, in rank order.
        earlier_tries: the errors of the tries before this one, oldest first, when the launcher
            restarted the launch (``MPLauncher(max_restarts=...)``); empty otherwise.
    """

    def __init__(
        self,
        failures: Sequence[WorkerFailure],
        summary: str = "",
        earlier_tries: Sequence[LaunchError] = (),
    ) -> None:
        self.failures = sorted(failures, key=lambda f: (not f.cause, f.at, f.rank))
        self.earlier_tries = list(earlier_tries)
        causes = [f.rank for f in self.failures if f.cause]
        head = summary or f"launch failed on rank(s) {self.ranks}"
        if summary == "" and causes and len(causes) < len(self.failures):
            head += f"; first to fail: rank(s) {causes}"
        parts = [head]
        waits = bool(causes) and self.failures[0].kind == "hung"  # the cause never arrived
        for f in self.failures:
            after = ""
            if not f.cause and causes:
                after = f" (waiting for rank {causes[0]})" if waits else ""
                after = after or f" (after rank {causes[0]} failed)"
            last = f" [last operation: {f.last_op}]" if f.last_op else ""
            parts.append(f"--- rank {f.rank}{after}: {f.reason}{last}")
            if f.log_files:
                parts.append(f"    logs: {', '.join(f.log_files)}")
            if f.traceback:
                parts.append(f.traceback.rstrip())
        super().__init__("\n".join(parts))

    @property
    def ranks(self) -> list[int]:
        return sorted(f.rank for f in self.failures)

    @property
    def first(self) -> WorkerFailure | None:
        """The failure listed first: the rank that failed first, or the one that never arrived."""
        return self.failures[0] if self.failures else None


class BackendUnavailableError(ImportError):
    """A registered backend cannot be used here: an optional package or library is missing.

    The message names what to install or set.
    """


class LaunchTimeoutError(LaunchError):
    """The launch ran past its ``timeout``; the ranks still running were stopped."""


class DistributedTask(ABC):
    """The job every worker runs. Subclasses override ``run`` (or a hook of a base task).

    The launcher constructs ``task_type(worker_info)`` in each worker and calls
    ``run(**launch_kwargs)``; the return value must be picklable and becomes that rank's entry in
    the launch result.
    """

    def __init__(self, worker_info: WorkerInfo) -> None:
        self.worker_info = worker_info

    @classmethod
    def check_launch_kwargs(cls, world_size: int, **kwargs: Any) -> None:
        """Refuse bad launch keywords in the parent, before any worker starts (default: none).

        Launchers call it with their ``n_tasks`` and the keywords of ``launch``. A task that
        overrides it raises ``ValueError`` / ``TypeError`` with one line naming the keyword and
        the fix; it must not start anything or touch a device.
        """
        return None

    @abstractmethod
    def run(self, **kwargs: Any) -> Any:
        """Do this worker's share of the work and return its result.

        Raises:
            Exception: anything; the launcher reports it as a ``LaunchError`` naming this rank.
        """


class Launcher(ABC):
    """Starts N workers, runs one ``DistributedTask`` in each and collects their results."""

    @property
    @abstractmethod
    def n_tasks(self) -> int:
        """How many workers one launch starts."""

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this launcher cannot run here (a missing package, with its install command);
        None when it can. Plugins whose dependencies may be missing override it."""
        return None

    @abstractmethod
    def launch(self, *, task_type: type[DistributedTask], **kwargs: Any) -> list[Any]:
        """Run ``task_type`` on every worker and block until all have returned.

        Args:
            task_type: the task class; it travels to the workers with cloudpickle (by value where
                its module does not exist there, see ``vllm_dist.serialization``).
            **kwargs: passed unchanged to ``task.run`` on every worker.

        Returns:
            The return value of every rank's ``run``, in rank order. A rank whose task ends with
            exit code 0 (``sys.exit(0)``, ``sys.exit()``) succeeded without a result: its entry
            is None. Any other exit code is a failure.

        Raises:
            LaunchError: a worker raised, exited or was killed; names the rank(s), the exit code or
                signal and the worker's traceback. No worker is left running.
            LaunchTimeoutError: the launch ran past the launcher's timeout.
        """
