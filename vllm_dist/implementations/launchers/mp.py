"""MPLauncher: one local process per rank, started with multiprocessing (spawn by default).

Each worker gets torchrun's environment variables, its own process group (so a stop also reaches
anything it started), ``PR_SET_PDEATHSIG`` (so it dies with the parent, SIGKILL included), a
forked watcher that kills the worker's process group once the worker is gone (so what the worker
started dies with it, whoever killed it), a ``faulthandler`` stack dump on SIGUSR1 (read when a
launch times out), a file its coordinator records its last operation in, and its
stdout / stderr on pipes that the parent reads, prefixes with ``[rankN]:`` and writes to the
console and, when asked, to per-rank log files (``output.py``). The parent waits on result pipes
and process sentinels together, so a failed or vanished rank is seen at once and the others are
stopped without waiting for a collective timeout. A failed launch starts again as a whole, up to
``max_restarts`` times, as torchelastic restarts its worker group. Rejected alternative: torch's
``start_processes``, which re-raises only the first failure and owns the log redirection.
"""

from __future__ import annotations

import atexit
import atexit as _atexit
import contextlib
import ctypes
import faulthandler
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from vllm_dist import log, serialization
from vllm_dist.implementations.launchers import output
from vllm_dist.implementations.launchers.common import (
    WorkerOutcome,
    check_env,
    check_host,
    check_max_restarts,
    check_n_tasks,
    check_port,
    check_seconds,
    exit_failure,
    find_free_port,
    launch_retrying_taken_ports,
    looks_like_consequence,
    mark_causes,
    one_line,
    pack_launch,
    raised_failure,
    run_packed_task,
    spawn_guard_error,
    tries_failed,
    unguarded_launch_error,
    worker_env,
)
from vllm_dist.implementations.launchers.progress import (
    describe_progress,
    lagging_ranks,
    read_progress,
)
from vllm_dist.interfaces import (
    DistributedTask,
    Launcher,
    LaunchError,
    LaunchTimeoutError,
    WorkerFailure,
    WorkerInfo,
)
from vllm_dist.interfaces.launcher import PROGRESS_FILE_ENV, new_launch_id, new_secret

_PR_SET_PDEATHSIG = 1
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
START_METHOD_ENV = "VLLM_DIST_START_METHOD"  # the start method when MPLauncher is given none
# what a forkserver imports once, so that every worker it forks starts with them: the user's
# main module (multiprocessing's default), torch, and the launcher and tasks of vllm_dist
FORKSERVER_PRELOAD = (
    "__main__",
    "torch",
    "torch.distributed",
    "vllm_dist.implementations.launchers.mp",
    "vllm_dist.implementations.coordinators.torch_distributed",
    "vllm_dist.implementations.coordinators.store_coordinator",
    "vllm_dist.implementations.communicators.torch_distributed",
    "vllm_dist.implementations.communicators.pair_gloo",
    "vllm_dist.tasks.all_reduce",
    "vllm_dist.tasks.weight_transfer",
)
logger = log.get_logger(__name__)


class MPLauncher(Launcher):
    """Run a task in ``n_tasks`` local processes.

    Args:
        n_tasks: number of ranks.
        start_method: ``"spawn"`` (safe with CUDA), ``"forkserver"`` or ``"fork"``; None =
            ``$VLLM_DIST_START_METHOD``, else ``"spawn"``. A forkserver (``start_forkserver``)
            imports torch once and forks each worker from it, saving every worker the import;
            its workers see the parent's environment as it is at the launch, but modules it
            imported read theirs when it started (the first forkserver launch).
        timeout: seconds one try of a launch may take before every worker is stopped (each
            restart gets its own); None = no limit.
        master_addr: address of the rendezvous (loopback by default).
        master_port: rendezvous port; a free one is picked when None.
        env: extra environment variables for every worker; ``{rank}`` and ``{local_rank}`` in a
            value become that worker's own (``{"NCCL_HOSTID": "host-{rank}"}``).
        prefix_output: forward worker stdout / stderr with a ``[rankN]:`` prefix; when False
            (and no ``log_dir`` or ``console_ranks``) the workers write straight to the terminal.
        stop_grace: seconds between SIGTERM and SIGKILL when stopping workers.
        max_restarts: how many times a failed launch (a rank raised, died or hung) is stopped
            and started again as a whole, with fresh ports and secret; the worker reads its try
            from ``worker_info.restart_count`` (0 first). torchelastic's ``max_restarts``.
        log_dir: a folder for per-rank logs, laid out as torchelastic's
            (``<run>/attempt_<try>/<rank>/stdout.log``, ``stderr.log``, ``error.json`` for a
            failed rank); created when missing. ``last_run_dir`` names the launch's folder.
        tee: with ``log_dir``, the streams also shown on the console: False / ``"none"``,
            ``"stdout"``, ``"stderr"``, True / ``"all"`` (torchrun's ``--tee``).
        console_ranks: the ranks whose output the console shows; None = all (torchrun's
            ``--local-ranks-filter``).
    """

    def __init__(
        self,
        n_tasks: int,
        *,
        start_method: str | None = None,
        timeout: float | None = None,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
        env: Mapping[str, str] | None = None,
        prefix_output: bool = True,
        stop_grace: float = 2.0,
        max_restarts: int = 0,
        log_dir: str | os.PathLike[str] | None = None,
        tee: bool | str = False,
        console_ranks: Sequence[int] | None = None,
    ) -> None:
        self._n_tasks = check_n_tasks(n_tasks)
        if start_method is None:
            start_method = os.environ.get(START_METHOD_ENV) or "spawn"
            where = f"{START_METHOD_ENV}={start_method!r}"
        else:
            where = f"start_method {start_method!r}"
        if start_method not in mp.get_all_start_methods():
            raise ValueError(
                f"{where} is not available here; choose one of {mp.get_all_start_methods()}"
            )
        self._ctx = mp.get_context(start_method)
        self._timeout = check_seconds("timeout", timeout)
        self._master_addr = check_host(master_addr)
        self._master_port = check_port(master_port)
        self._env = check_env(env)
        if isinstance(stop_grace, bool) or not isinstance(stop_grace, (int, float)):
            raise ValueError(f"stop_grace must be a number of seconds >= 0, got {stop_grace!r}")
        if n_tasks > 1 and "OMP_NUM_THREADS" not in self._env | dict(os.environ):
            self._env["OMP_NUM_THREADS"] = "1"
        self._stop_grace = stop_grace
        self._max_restarts = check_max_restarts(max_restarts)
        self._output = output.OutputPlan(
            log_dir=output.check_log_dir(log_dir),
            tee=output.check_tee(tee),
            console_ranks=output.check_console_ranks(console_ranks, n_tasks),
            prefix=bool(prefix_output),
        )
        log.log_level({**os.environ, **self._env})  # a bad VLLM_DIST_LOG_LEVEL fails here
        self._last_run_dir: str | None = None

    @property
    def n_tasks(self) -> int:
        return self._n_tasks

    @property
    def last_run_dir(self) -> str | None:
        """The folder under ``log_dir`` where the last launch wrote its logs (None: none yet)."""
        return self._last_run_dir

    def launch(self, *, task_type: type[DistributedTask], **kwargs: Any) -> list[Any]:
        guard = spawn_guard_error() or unguarded_launch_error(self._ctx.get_start_method())
        if guard is not None:
            raise guard
        packed = pack_launch(task_type, kwargs)
        task_type.check_launch_kwargs(self._n_tasks, **kwargs)
        check_local_device(kwargs.get("device"))
        log.configure()
        run_dir = None
        if self._output.log_dir is not None:
            run_dir = self._last_run_dir = output.new_run_dir(self._output.log_dir)
            logger.info("per-rank logs of this launch go to %s", run_dir)
        errors: list[LaunchError] = []
        for attempt in range(self._max_restarts + 1):
            try:
                return self._launch_try(packed, attempt, run_dir)
            except LaunchError as exc:
                errors.append(exc)
                if attempt < self._max_restarts:
                    logger.warning(
                        "launch try %d of %d failed: %s; starting it again",
                        attempt + 1,
                        self._max_restarts + 1,
                        one_line(exc),
                    )
        raise tries_failed(errors, self._max_restarts)

    def _launch_try(self, packed: bytes, attempt: int, run_dir: str | None) -> list[Any]:
        """One try: on the fixed port, or on free ones, again while the port was taken."""
        started = time.monotonic()
        if self._master_port:
            return self._launch_once(packed, self._master_port, started, attempt, run_dir)
        return launch_retrying_taken_ports(
            lambda: self._launch_once(
                packed, find_free_port(self._master_addr), started, attempt, run_dir
            )
        )

    def _launch_once(
        self, packed: bytes, port: int, started: float, attempt: int, run_dir: str | None
    ) -> list[Any]:
        run = _Run(self, packed, port, started, attempt, run_dir)
        results = None
        try:
            run.start()
            results = run.wait()
        finally:
            # after success the workers are exiting on their own: give them time to finish
            run.stop(exit_wait=10.0 if results is not None else 0.0)
        late = run.exit_failures()
        if late:
            raise run.error(
                LaunchError,
                late,
                summary=f"rank(s) {[f.rank for f in late]} died after returning a result",
            )
        return results


class _Run:
    """The processes of one launch, and everything needed to stop them."""

    def __init__(
        self,
        launcher: MPLauncher,
        packed: bytes,
        port: int,
        started: float,
        attempt: int,
        run_dir: str | None,
    ) -> None:
        self._launcher = launcher
        self._attempt = attempt
        self._run_dir = run_dir
        # the timeout counts from the try's start: a launch again on a fresh port (a taken one)
        # does not restart it, a restart (max_restarts) does
        self._deadline = None if launcher._timeout is None else started + launcher._timeout
        self._packed = packed
        self._port = port
        self.procs: list[Any] = []
        self.results: list[mpc.Connection] = []
        self._output = launcher._output
        self._forwarder = output.OutputForwarder() if self._output.forwards else None
        self._stop_lock = threading.Lock()
        self._stopped = False
        self._dir = tempfile.mkdtemp(prefix="vllm_dist-")  # progress records and stack dumps
        self._exit_codes: list[int | None] = []  # as the workers ended by themselves
        self._parent_pid = os.getpid()  # the workers' parent: us, or our forkserver
        self._base_env: dict[str, str] | None = None

    def start(self) -> None:
        _stop_at_exit(self)
        n = self._launcher.n_tasks
        if self._launcher._ctx.get_start_method() == "forkserver":
            self._parent_pid = start_forkserver()
            self._base_env = dict(os.environ)  # the server's own is from when it started
        launch_id, secret = new_launch_id(), new_secret()  # the secret travels on our own pipe
        for rank in range(n):
            info = WorkerInfo(
                rank=rank,
                world_size=n,
                local_rank=rank,
                local_world_size=n,
                master_addr=self._launcher._master_addr,
                master_port=self._port,
                launch_id=launch_id,
                secret=secret,
                restart_count=self._attempt,
            )
            self._start_one(info)
        if self._forwarder is not None:
            self._forwarder.start()

    def _file(self, rank: int, what: str) -> str:
        return os.path.join(self._dir, f"rank{rank}.{what}")

    def _progress(self, rank: int) -> str:
        return self._file(rank, "progress")

    def _log_dir(self, rank: int) -> str | None:
        if self._run_dir is None:
            return None
        return output.rank_dir(self._run_dir, self._attempt, rank)

    def _sinks(self, rank: int, stream: str) -> list[output.Sink]:
        """Where one stream of ``rank`` goes: its log file, the console, both or neither."""
        sinks = []
        folder = self._log_dir(rank)
        if folder is not None:
            os.makedirs(folder, exist_ok=True)
            sinks.append(output.Sink(open(os.path.join(folder, f"{stream}.log"), "ab")))  # noqa: SIM115
        if self._output.to_console(rank, stream):
            prefix = f"[rank{rank}]:" if self._output.prefix else ""
            sinks.append(output.Sink(getattr(sys, stream), prefix=prefix))
        return sinks

    def error(
        self, cls: type[LaunchError], failures: list[WorkerFailure], summary: str = ""
    ) -> LaunchError:
        """The launch's error; with ``log_dir`` each failed rank's ``error.json`` is written
        first and every failure names its log files."""
        named = []
        for f in failures:
            folder = self._log_dir(f.rank)
            if folder is not None:
                pid = self.procs[f.rank].pid if f.rank < len(self.procs) else None
                err = output.write_error_file(folder, f, pid=pid, restart_count=self._attempt)
                logs = [os.path.join(folder, f"{s}.log") for s in output.STREAMS]
                f = replace(f, log_files=(*logs, err))
            named.append(f)
        return cls(named, summary=summary)

    def _start_one(self, info: WorkerInfo) -> None:
        ctx = self._launcher._ctx
        result_r, result_w = ctx.Pipe(duplex=False)
        out_w = err_w = None
        if self._forwarder is not None:
            out_r, out_w = ctx.Pipe(duplex=False)
            err_r, err_w = ctx.Pipe(duplex=False)
            sinks = {s: self._sinks(info.rank, s) for s in output.STREAMS}
        elif self._base_env is not None:
            out_w, err_w = _our_stdio()  # a forkserver's own are from when it started
        env = {
            **self._launcher._env,
            PROGRESS_FILE_ENV: self._progress(info.rank),
            RESTART_COUNT_ENV: str(info.restart_count),  # torchrun's, read by WorkerInfo.from_env
        }
        files = _WorkerFiles(stacks=self._file(info.rank, "stacks"))
        proc = ctx.Process(  # type: ignore[attr-defined]
            target=_worker_main,
            args=(self._packed, info, env, self._parent_pid, result_w, out_w, err_w, files),
            kwargs={"rank_prefix": not self._output.prefix, "base_env": self._base_env},
            name=f"vllm_dist-rank{info.rank}",
            daemon=False,
        )
        proc.start()
        for conn in (result_w, out_w, err_w):
            if conn is not None:
                conn.close()  # the child holds the write ends; EOF means it is gone
        if self._forwarder is not None:
            self._forwarder.add(out_r, sinks["stdout"])
            self._forwarder.add(err_r, sinks["stderr"])
        self.procs.append(proc)
        self.results.append(result_r)

    def wait(self) -> list[Any]:
        n = len(self.procs)
        outcomes: dict[int, WorkerOutcome] = {}
        failures: list[WorkerFailure] = []
        waitables: dict[Any, int] = {}
        for rank in range(n):
            waitables[self.results[rank]] = rank
            waitables[self.procs[rank].sentinel] = rank
        while len(outcomes) < n and not failures:
            ready = mpc.wait(list(waitables), timeout=self._remaining())
            if not ready:
                raise self._timeout_error(outcomes)
            seen = time.time()  # before the join in _read_outcome: a death's own time
            for obj in ready:
                if obj not in waitables or waitables[obj] in outcomes:
                    continue
                rank = waitables.pop(obj)
                outcome = self._read_outcome(rank)
                outcomes[rank] = outcome
                if not outcome.ok:
                    failures.append(self._failure(rank, outcome, seen))
                self._forget(waitables, rank)
        if failures:
            self._collect_more_failures(failures, outcomes)
            failures = [replace(f, last_op=self._last_op(f.rank)) for f in failures]
            if all(looks_like_consequence(f) for f in failures):  # a peer never arrived
                live = [r for r in range(n) if r not in outcomes and self.procs[r].is_alive()]
                failures += self._hung(live, failed=[f.rank for f in failures])
            raise self.error(LaunchError, mark_causes(failures))
        return [serialization.loads(outcomes[r].payload) for r in range(n)]

    def _last_op(self, rank: int) -> str:
        """What ``rank`` was doing when it failed, as its records say; empty without any."""
        progress = read_progress(self._progress(rank))
        if progress is None or (progress.coordinator is None and progress.step is None):
            return ""
        return describe_progress(progress)

    def _read_outcome(self, rank: int) -> WorkerOutcome:
        """Called when rank's result pipe or sentinel is ready: its result, or how it died."""
        try:
            if self.results[rank].poll():
                return self.results[rank].recv()  # type: ignore[no-any-return]
        except (EOFError, OSError):
            pass  # the worker closed its end without a result: it is exiting
        # the fds close a moment before the process becomes reapable; wait for its exit code
        self.procs[rank].join(timeout=5.0)
        if self.procs[rank].exitcode == 0:  # os._exit(0) in the task: success, no result
            return WorkerOutcome(ok=True, payload=serialization.dumps(None))
        return WorkerOutcome(ok=False)

    def _failure(self, rank: int, outcome: WorkerOutcome, at: float | None = None) -> WorkerFailure:
        """``rank``'s failure; ``at``: when its end was seen (default: now)."""
        at = time.time() if at is None else at
        if outcome.traceback:
            return raised_failure(rank, outcome, at)
        return exit_failure(rank, self.procs[rank].exitcode, "before returning a result", at)

    def _collect_more_failures(
        self, failures: list[WorkerFailure], outcomes: dict[int, WorkerOutcome]
    ) -> None:
        """Ranks that failed at about the same time are reported too (not ranks we stop)."""
        time.sleep(0.05)
        known = {f.rank for f in failures}
        for rank in range(len(self.procs)):
            if rank in known or rank in outcomes:
                continue
            conn = self.results[rank]
            try:
                if conn.poll():
                    outcome = conn.recv()
                    outcomes[rank] = outcome
                    if not outcome.ok:
                        failures.append(self._failure(rank, outcome))
                    continue
            except (EOFError, OSError):
                pass
            if not self.procs[rank].is_alive() and self.procs[rank].exitcode != 0:
                outcomes[rank] = WorkerOutcome(ok=False)
                failures.append(self._failure(rank, WorkerOutcome(ok=False)))

    def _hung(self, ranks: list[int], failed: Sequence[int] = ()) -> list[WorkerFailure]:
        """The ranks still running, each with its last operation and its stacks; ``cause``
        marks the ones that lag behind (the ``failed`` ranks waited for them, or they never
        arrived where the others wait)."""
        if not ranks:
            return []
        records = {r: read_progress(self._progress(r)) for r in range(len(self.procs))}
        stacks = _dump_stacks({r: self.procs[r] for r in ranks}, self._file)
        lagging = set(lagging_ranks(records, ranks, failed)) or set(ranks)
        now = time.time()
        return [
            WorkerFailure(
                rank=r,
                reason="still running (stopped by the launcher)",
                traceback=f"stacks of rank {r}:\n{stacks[r]}" if stacks.get(r) else "",
                kind="hung",
                at=now,
                cause=r in lagging,
                last_op=describe_progress(records.get(r)),
            )
            for r in ranks
        ]

    @staticmethod
    def _forget(waitables: dict[Any, int], rank: int) -> None:
        for obj in [o for o, r in waitables.items() if r == rank]:
            del waitables[obj]

    def _remaining(self) -> float | None:
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - time.monotonic())

    def _timeout_error(self, outcomes: dict[int, WorkerOutcome]) -> LaunchError:
        stuck = [r for r in range(len(self.procs)) if r not in outcomes]
        failures = mark_causes(self._hung(stuck))
        blamed = [f.rank for f in failures if f.cause]
        return self.error(
            LaunchTimeoutError,
            failures,
            summary=f"launch timed out after {self._launcher._timeout} s; "
            f"rank(s) {stuck} had not finished and were stopped; rank(s) {blamed} lag behind "
            "the others (listed first, with what they did last and their stacks)",
        )

    def exit_failures(self) -> list[WorkerFailure]:
        """Ranks that returned their result and then ended with a non-zero code by themselves."""
        now = time.time()
        return [
            exit_failure(rank, code, "after returning its result", now)
            for rank, code in enumerate(self._exit_codes)
            if code not in (None, 0)
        ]

    def stop(self, exit_wait: float) -> None:
        """Stop every worker still running and close the pipes.

        Waits ``exit_wait`` s for workers to exit by themselves, sends SIGTERM, waits the stop
        grace, then SIGKILLs each worker's process group (also reaching what a worker started).
        """
        with self._stop_lock:  # the launch's own thread, or the interpreter's exit
            if self._stopped:
                return
            self._stopped = True
            self._stop(exit_wait)
        _LIVE_RUNS.discard(self)

    def _stop(self, exit_wait: float) -> None:
        deadline = time.monotonic() + exit_wait
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self._exit_codes = [proc.exitcode for proc in self.procs]
        _signal_groups(self.procs, signal.SIGTERM)
        deadline = time.monotonic() + self._launcher._stop_grace
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        _signal_groups(self.procs, signal.SIGKILL, also_dead=True)
        for proc in self.procs:
            proc.join(timeout=5.0)
        if self._forwarder is not None:
            self._forwarder.close(timeout=2.0)
        for conn in self.results:
            conn.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _dump_stacks(procs: Mapping[int, Any], path_of: Any, wait: float = 2.0) -> dict[int, str]:
    """Ask each live worker for its Python stacks (SIGUSR1 to the worker only) and read them."""
    for rank, proc in procs.items():
        with contextlib.suppress(OSError):
            os.truncate(path_of(rank, "stacks"), 0)
        with contextlib.suppress(ProcessLookupError, PermissionError, TypeError):
            os.kill(proc.pid, signal.SIGUSR1)

    def read_all() -> dict[int, str]:
        out = {}
        for rank in procs:
            try:
                with open(path_of(rank, "stacks"), errors="replace") as f:
                    out[rank] = f.read().rstrip()
            except OSError:
                out[rank] = ""
        return out

    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and not all(read_all().values()):
        time.sleep(0.05)
    time.sleep(0.1)  # the handler writes in one go; let a dump in progress end
    return read_all()


# launches whose workers may still run; stopped when the interpreter exits (a launch left on a
# daemon thread, such as a test's that timed out), before multiprocessing's own exit handler
# would join those workers, which are not daemons, for as long as their tasks run
_LIVE_RUNS: weakref.WeakSet[_Run] = weakref.WeakSet()
_EXIT_HOOKED = False
_EXIT_LOCK = threading.Lock()


def _stop_at_exit(run: _Run) -> None:
    global _EXIT_HOOKED
    with _EXIT_LOCK:
        _LIVE_RUNS.add(run)
        if not _EXIT_HOOKED:  # registered after multiprocessing's handler: runs before it
            atexit.register(_stop_live_runs)
            _EXIT_HOOKED = True


def _stop_live_runs() -> None:
    for run in list(_LIVE_RUNS):
        run.stop(exit_wait=0.0)


def _signal_groups(procs: list[Any], sig: int, also_dead: bool = False) -> None:
    """Signal each worker's process group (the worker and anything it started)."""
    for proc in procs:
        if proc.pid is None or (proc.exitcode is not None and not also_dead):
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)


@dataclass(frozen=True, slots=True)
class _WorkerFiles:
    """Files the parent reads from a worker: where SIGUSR1 dumps its stacks."""

    stacks: str


def _worker_main(
    packed: bytes,
    info: WorkerInfo,
    env: Mapping[str, str],
    parent_pid: int,
    result_conn: mpc.Connection,
    out_conn: mpc.Connection | None,
    err_conn: mpc.Connection | None,
    files: _WorkerFiles,
    rank_prefix: bool = False,
    base_env: Mapping[str, str] | None = None,
) -> None:
    """Entry point of a worker process; ends the process once its outcome is delivered.
    ``parent_pid``: the process that started this one (the launcher's, or its forkserver's).
    ``rank_prefix``: the worker's output reaches the console unprefixed, so its log records
    carry the rank themselves. ``base_env``: the environment to start from instead of the
    inherited one (a forkserver's is from when it started)."""
    _leave_forkserver()
    _die_with_parent(parent_pid)
    if base_env is not None:
        os.environ.clear()
        os.environ.update(base_env)
    os.setpgid(0, 0)
    _watch_group()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    stacks = open(files.stacks, "w")  # noqa: SIM115 - open until the process ends
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    if out_conn is not None and err_conn is not None:
        _redirect(out_conn, err_conn)
    os.environ.update(worker_env(dict(env), info))
    _apply_thread_count()
    outcome = run_packed_task(packed, info, rank_prefix=rank_prefix)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    result_conn.send(outcome)
    result_conn.close()
    _exit_after_result()


def _exit_after_result() -> None:
    """End the worker once its result is delivered: the user's exit handlers run, then
    ``os._exit``. An interpreter's normal shutdown would also destroy the C++ objects of
    gloo, NIXL or UCX, whose threads can still be joinable then ("terminate called without
    an active exception"); there is nothing left to clean up that the process's end does not.
    A crash in an exit handler still shows: the launcher checks exit codes after the results."""
    code = 0
    try:
        _atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - reported like the interpreter would
        code = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _watch_group() -> None:
    """Fork a watcher that SIGKILLs this worker's process group once the worker is gone.

    The watcher blocks on a pipe whose only write end this worker holds: EOF means the worker
    ended, however it ended (``PR_SET_PDEATHSIG`` after the parent's SIGKILL included), and the
    group's other members (what the task started) are stopped with it.
    """
    if not hasattr(os, "fork"):
        return
    r, w = os.pipe()
    if os.fork() == 0:  # the watcher: no threads, no Python objects used past this point
        try:
            os.closerange(0, r)
            os.closerange(r + 1, 1 << 16)
            while os.read(r, 1):
                pass
            os.killpg(0, signal.SIGKILL)
        finally:
            os._exit(0)
    os.close(r)
    os.set_inheritable(w, False)


def _apply_thread_count() -> None:
    """Give torch the ``OMP_NUM_THREADS`` of the worker's env: unpickling the task imported torch
    (and OpenMP read its environment) before that env was set."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def _our_stdio() -> tuple[mpc.Connection, mpc.Connection] | tuple[None, None]:
    """Copies of this process's fds 1 and 2, to become a forkserver worker's own (as a spawned
    worker inherits them); (None, None) when one is closed."""
    try:
        return mpc.Connection(os.dup(1)), mpc.Connection(os.dup(2))
    except OSError:
        return None, None


def start_forkserver() -> int:
    """Start multiprocessing's forkserver with ``FORKSERVER_PRELOAD`` imported, unless it runs
    already, and return its pid. It ends when this process ends; CUDA is never initialised in it.
    """
    from multiprocessing import forkserver

    mp.get_context("forkserver").set_forkserver_preload(list(FORKSERVER_PRELOAD))
    forkserver.ensure_running()
    server: Any = forkserver._forkserver  # private: its pid has no public access
    return int(server._forkserver_pid)


def _leave_forkserver() -> None:
    """In a worker forked by a forkserver: close the inherited end of the pipe that keeps the
    server running while its clients live (kept for starts of our own), so that the server, and
    with it this worker (``PR_SET_PDEATHSIG``), ends when the launching process ends."""
    from multiprocessing import forkserver

    server: Any = forkserver._forkserver  # private: its fields have no public access
    if server.get_inherited_fds() is None or server._forkserver_alive_fd is None:
        return  # not started by a forkserver
    os.close(server._forkserver_alive_fd)
    server._forkserver_alive_fd = None


def _die_with_parent(parent_pid: int) -> None:
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def _redirect(out_conn: mpc.Connection, err_conn: mpc.Connection) -> None:
    for conn, fd, stream in ((out_conn, 1, sys.stdout), (err_conn, 2, sys.stderr)):
        stream.flush()
        os.dup2(conn.fileno(), fd)
        conn.close()
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(line_buffering=True)


def check_local_device(device: Any) -> None:
    """Refuse a CUDA ``device`` this machine does not have, before any worker starts: the
    workers of this launcher run here. ``torch.cuda.device_count`` asks NVML where it can, so
    the parent creates no CUDA context (a later fork stays safe)."""
    if device is None:
        return
    import torch

    dev = torch.device(device)  # check_launch_kwargs has refused what does not parse
    if dev.type != "cuda":
        return
    count = torch.cuda.device_count()
    if count == 0:
        raise ValueError(
            f"device={str(device)!r}: this machine has no CUDA device (torch sees none); "
            "use device='cpu', or launch on a GPU machine with a CUDA build of torch"
        )
    if dev.index is not None and dev.index >= count:
        raise ValueError(
            f"device={str(device)!r}: this machine has {count} CUDA device(s), "
            f"cuda:0..cuda:{count - 1}; pick one of those or use device='cuda'"
        )
