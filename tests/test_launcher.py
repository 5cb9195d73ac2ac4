"""Launchers: results in rank order, the torchrun environment, failures, timeouts, no leftovers.

Every test takes ``make_launcher`` so it runs under each launcher kind (see conftest.py).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from typing import Any

import psutil
import pytest

from tests.utils import distributed_test
from vllm_dist import (
    CoordinatorType,
    DistributedTask,
    GlobalCoordinatorDistributedTask,
    LaunchError,
    LaunchTimeoutError,
    MPLauncher,
    WorkerInfo,
    get_coordinator_class,
)
from vllm_dist.implementations.launchers.common import _bindable, find_free_port
from vllm_dist.implementations.launchers.mp import START_METHOD_ENV


class EnvTask(DistributedTask):
    def run(self, **kwargs: Any) -> dict[str, Any]:
        keys = (
            "RANK",
            "WORLD_SIZE",
            "LOCAL_RANK",
            "LOCAL_WORLD_SIZE",
            "MASTER_ADDR",
            "MASTER_PORT",
            "VLLM_DIST_LAUNCH_ID",
            "VD_TEST_MINE",
            "VD_TEST_JSON",
            "VD_TEST_LATE",
        )
        return {
            "env": {k: os.environ.get(k) for k in keys},
            "info": self.worker_info,
            "kwargs": kwargs,
            "pid": os.getpid(),
        }


class FailTask(DistributedTask):
    def run(self, *, mode: str, bad_rank: int = 1, **_: Any) -> int:
        if self.worker_info.rank == bad_rank:
            if mode == "raise":
                raise RuntimeError(f"boom from rank {self.worker_info.rank}")
            if mode == "exit":
                os._exit(3)
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
        if mode == "hang" or self.worker_info.rank != bad_rank:
            time.sleep(600)  # the healthy ranks wait in "a collective" forever
        return self.worker_info.rank


class ChildSpawningTask(DistributedTask):
    """Starts a grandchild that would outlive the worker if nobody stopped its process group."""

    def run(self, **_: Any) -> int:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        if self.worker_info.rank == 0:
            raise RuntimeError(f"failing with grandchild {child.pid}")
        time.sleep(600)
        return 0


def _descendants() -> set[int]:
    """Our live descendants, less multiprocessing's resource tracker (one per parent process)."""
    found = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if "resource_tracker" not in " ".join(p.cmdline()):
                found.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return found


def _running(pid: int) -> bool:
    """Whether ``pid`` is alive and not a zombie (a process may exit while it is looked at)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_gone(pids: set[int], timeout: float = 5.0) -> set[int]:
    deadline = time.monotonic() + timeout
    alive = set(pids)
    while alive and time.monotonic() < deadline:
        alive = {p for p in alive if _running(p)}
        time.sleep(0.05)
    return alive


@distributed_test()
@pytest.mark.parametrize("n", [1, 2, 4])
def test_results_in_rank_order_with_torchrun_env(make_launcher, n: int) -> None:
    results = make_launcher(n).launch(task_type=EnvTask, alpha=1, beta=[2])
    assert [r["info"].rank for r in results] == list(range(n))
    ports = {r["env"]["MASTER_PORT"] for r in results}
    assert len(ports) == 1 and ports != {None}
    for rank, r in enumerate(results):
        assert r["env"]["RANK"] == str(rank)
        assert r["env"]["WORLD_SIZE"] == str(n)
        assert r["env"]["LOCAL_WORLD_SIZE"] == str(n)
        assert r["env"]["MASTER_ADDR"] == "127.0.0.1"
        assert r["kwargs"] == {"alpha": 1, "beta": [2]}
        assert WorkerInfo.from_env(r["env"]) == r["info"]
    assert len({r["pid"] for r in results}) == n
    assert len({r["info"].launch_id for r in results}) == 1 and results[0]["info"].launch_id


def _join_rendezvous(fields: dict[str, Any], timeout: float, out: Any) -> None:
    """A worker that joins the rendezvous ``fields`` name and gathers every rank's launch id."""
    from vllm_dist.implementations.coordinators.torch_distributed import (
        TorchDistributedCoordinator,
    )

    coordinator = TorchDistributedCoordinator(WorkerInfo(**fields), timeout=timeout)
    out.put((fields["launch_id"], "joining", None))
    try:
        coordinator.initialize()
        ids = coordinator.all_gather_object(fields["launch_id"])
        out.put((fields["launch_id"], "joined", ids))
        coordinator.barrier()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out.put((fields["launch_id"], "failed", type(exc).__name__))
    finally:
        coordinator.close()


@distributed_test(timeout=90)
def test_a_worker_of_another_launch_on_the_same_port_cannot_take_a_place() -> None:
    """Two launches that drew the same port: rank 0 of launch A listens, a rank 1 of launch B
    reaches the port before A's rank 1 does. The rendezvous is kept under each launch's id,
    so A's two ranks still meet each other (not the stray), and the stray times out (without
    the fence, it would take rank 1's place and A's own rank 1 would be the one left out)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = find_free_port()
    base = {"world_size": 2, "local_world_size": 2, "master_addr": "127.0.0.1", "master_port": port}
    rank0 = {**base, "rank": 0, "local_rank": 0, "launch_id": "launch-a"}
    stray = {**base, "rank": 1, "local_rank": 1, "launch_id": "launch-b"}
    rank1 = {**base, "rank": 1, "local_rank": 1, "launch_id": "launch-a"}
    procs = [ctx.Process(target=_join_rendezvous, args=(rank0, 30.0, out))]
    procs.append(ctx.Process(target=_join_rendezvous, args=(stray, 8.0, out)))
    try:
        procs[0].start()
        procs[1].start()
        seen = {out.get(timeout=30)[0] for _ in range(2)}  # both are about to join
        assert seen == {"launch-a", "launch-b"}
        time.sleep(1.0)  # the stray reaches the port first
        procs.append(ctx.Process(target=_join_rendezvous, args=(rank1, 30.0, out)))
        procs[2].start()
        reports = [out.get(timeout=40) for _ in range(4)]  # rank 1's joining, three verdicts
    finally:
        for p in procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    verdicts = sorted((who, what, str(x)) for who, what, x in reports if what != "joining")
    assert verdicts == [
        ("launch-a", "joined", str(["launch-a", "launch-a"])),
        ("launch-a", "joined", str(["launch-a", "launch-a"])),
        ("launch-b", "failed", "CoordinatorTimeoutError"),
    ], verdicts


@distributed_test()
def test_mp_env_names_each_workers_rank(monkeypatch) -> None:
    # set after the session's forkserver started: its workers see the parent's env as it is now
    monkeypatch.setenv("VD_TEST_LATE", "late")
    env = {"VD_TEST_MINE": "host-{rank}/{local_rank}", "VD_TEST_JSON": '{"a": {"b": 1}}'}
    results = MPLauncher(3, timeout=60, env=env).launch(task_type=EnvTask)
    assert [r["env"]["VD_TEST_MINE"] for r in results] == ["host-0/0", "host-1/1", "host-2/2"]
    assert {r["env"]["VD_TEST_JSON"] for r in results} == {'{"a": {"b": 1}}'}
    assert {r["env"]["VD_TEST_LATE"] for r in results} == {"late"}


class ThreadsTask(DistributedTask):
    def run(self, **kwargs: Any) -> tuple[str | None, int]:
        import torch

        return os.environ.get("OMP_NUM_THREADS"), torch.get_num_threads()


@distributed_test()
def test_mp_workers_get_their_omp_thread_count(monkeypatch) -> None:
    """torch (and OpenMP) are loaded before the worker's env is set: the count must still take,
    and as with torchrun a multi-worker launch defaults to one thread per worker."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert MPLauncher(2, timeout=60).launch(task_type=ThreadsTask) == [("1", 1)] * 2
    env = {"OMP_NUM_THREADS": "1"}  # a single worker gets no default: this one is the env's
    assert MPLauncher(1, timeout=60, env=env).launch(task_type=ThreadsTask) == [("1", 1)]
    assert MPLauncher(1, timeout=60).launch(task_type=ThreadsTask)[0][0] is None


@distributed_test(timeout=60)
@pytest.mark.parametrize("mode", ["raise", "exit", "kill"])
def test_failure_names_rank_and_stops_the_others(make_launcher, mode: str) -> None:
    before = _descendants()
    launcher = make_launcher(3)
    with pytest.raises(LaunchError) as err:
        launcher.launch(task_type=FailTask, mode=mode, bad_rank=1)
    assert err.value.ranks == [1]
    text = str(err.value)
    assert "rank 1" in text
    if mode == "raise":
        assert "boom from rank 1" in text and "Traceback" in text
    elif not isinstance(launcher, MPLauncher):
        assert "died" in text  # Ray does not expose a dead actor's exit code or signal
    elif mode == "exit":
        assert "exited with code 3" in text
    else:
        assert "SIGKILL" in text
    # reported on the failure, not at the launch timeout (that would be a LaunchTimeoutError)
    assert not isinstance(err.value, LaunchTimeoutError), text
    assert not _wait_gone(_descendants() - before), "workers left behind"


@distributed_test(timeout=60)
def test_failure_is_reported_within_seconds() -> None:
    """From a rank's failure to launch() raising: bounded by the stop grace, not a collective."""
    launcher = MPLauncher(2, timeout=60, stop_grace=2.0)
    with pytest.raises(LaunchError) as err:
        launcher.launch(task_type=FailTask, mode="raise", bad_rank=0)
    # the failure, not the 60 s launch timeout, ended the launch (seconds go in benchmarks)
    assert not isinstance(err.value, LaunchTimeoutError) and err.value.ranks == [0]


@distributed_test(timeout=60)
def test_timeout_stops_hung_workers(make_launcher) -> None:
    before = _descendants()
    with pytest.raises(LaunchTimeoutError) as err:
        make_launcher(2, timeout=3).launch(task_type=FailTask, mode="hang")
    assert err.value.ranks == [0, 1]
    assert "timed out" in str(err.value)
    assert not _wait_gone(_descendants() - before)


@distributed_test(timeout=60)
def test_grandchildren_are_stopped_too() -> None:
    before = _descendants()
    with pytest.raises(LaunchError, match="grandchild"):
        MPLauncher(2, timeout=30).launch(task_type=ChildSpawningTask)
    assert not _wait_gone(_descendants() - before)


class PrintTask(DistributedTask):
    def run(self, **_: Any) -> None:
        print(f"hello from {self.worker_info.rank}", flush=True)
        os.write(2, f"raw fd write {self.worker_info.rank}\n".encode())


@distributed_test()
def test_output_lines_carry_rank_prefix(capfd) -> None:
    MPLauncher(2, timeout=60).launch(task_type=PrintTask)
    out, err = capfd.readouterr()
    assert "[rank0]:hello from 0" in out and "[rank1]:hello from 1" in out
    assert "[rank0]:raw fd write 0" in err and "[rank1]:raw fd write 1" in err


# a program with a task whose workers write their pid into the folder argv[1] names and sleep
_SLEEP_TASK = textwrap.dedent(
    """
    import os, sys, threading, time
    from vllm_dist import MPLauncher, DistributedTask

    class Sleep(DistributedTask):
        def run(self):
            with open(os.path.join(sys.argv[1], f"{os.getpid()}.pid"), "w") as f:
                f.write("x")
            time.sleep(600)
    """
)
_PARENT_SCRIPT = _SLEEP_TASK + textwrap.dedent(
    """
    if __name__ == "__main__":
        MPLauncher(2, timeout=120).launch(task_type=Sleep)
    """
)


def _run_script(tmp_path, text: str, start_method: str | None = None) -> subprocess.Popen[bytes]:
    """``text`` run as a program with ``tmp_path`` as its argument, vllm_dist importable; its
    launches use ``start_method`` (default: the session's)."""
    script = tmp_path / "parent.py"
    script.write_text(text)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # importable uninstalled
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    if start_method is not None:
        env[START_METHOD_ENV] = start_method
    return subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)],
        env=env,
        # a shell that runs the suite in the background ignores SIGINT, and its children inherit
        # that; the program must see Ctrl-C as a terminal would send it
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _start_parent(
    tmp_path, start_method: str | None = None
) -> tuple[subprocess.Popen[bytes], set[int]]:
    parent = _run_script(tmp_path, _PARENT_SCRIPT, start_method)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("*.pid"))) < 2:
        assert time.monotonic() < deadline, "workers did not start"
        assert parent.poll() is None, "parent died"
        time.sleep(0.1)
    return parent, {int(p.stem) for p in tmp_path.glob("*.pid")}


_ABANDONED_SCRIPT = _SLEEP_TASK + textwrap.dedent(
    """
    if __name__ == "__main__":
        launch = lambda: MPLauncher(2, timeout=300).launch(task_type=Sleep)
        threading.Thread(target=launch, daemon=True).start()
        while len([n for n in os.listdir(sys.argv[1]) if n.endswith(".pid")]) < 2:
            time.sleep(0.1)
    """
)


@distributed_test(timeout=120)
def test_interpreter_exit_stops_a_launch_left_on_a_daemon_thread(tmp_path) -> None:
    """A program that ends while a launch still runs on a daemon thread (a test that gave up
    on it) exits at once and takes the workers with it, instead of waiting in
    multiprocessing's exit handler, which joins worker processes, for their tasks to end."""
    parent = _run_script(tmp_path, _ABANDONED_SCRIPT)
    try:
        parent.wait(timeout=60)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=10)
    workers = {int(p.stem) for p in tmp_path.glob("*.pid")}
    assert len(workers) == 2 and parent.returncode == 0, parent.returncode
    assert not _wait_gone(workers, timeout=10), "workers outlived the program"


@distributed_test(timeout=120)
@pytest.mark.parametrize(
    ("sig", "start_method"),
    [
        (signal.SIGKILL, "spawn"),  # the default: the parent is the workers' own
        (signal.SIGKILL, None),  # the session's forkserver: it must end with the parent
        (signal.SIGINT, None),
        (signal.SIGTERM, None),
    ],
)
def test_workers_die_with_the_parent(tmp_path, sig: int, start_method: str | None) -> None:
    parent, workers = _start_parent(tmp_path, start_method)
    parent.send_signal(sig)
    parent.wait(timeout=30)
    assert not _wait_gone(workers, timeout=10), f"workers outlived a parent killed by {sig!r}"


def test_launcher_rejects_bad_arguments(monkeypatch) -> None:
    with pytest.raises(ValueError, match="n_tasks"):
        MPLauncher(0)
    with pytest.raises(ValueError, match="start_method"):
        MPLauncher(1, start_method="teleport")
    with pytest.raises(TypeError, match="DistributedTask"):
        MPLauncher(1).launch(task_type=int)
    monkeypatch.setenv(START_METHOD_ENV, "teleport")
    with pytest.raises(ValueError, match=f"{START_METHOD_ENV}='teleport'"):
        MPLauncher(1)


class RanksTask(GlobalCoordinatorDistributedTask):
    def post_init_distributed(self, **kwargs: Any) -> Any:
        return self.coordinator.all_gather_object(self.coordinator.get_rank())


@distributed_test(timeout=120)
def test_a_taken_rendezvous_port_is_replaced(monkeypatch) -> None:
    """Another process takes the port the launcher picked before rank 0 binds it (the CI flake
    this guards against): the launch starts again on a fresh port and succeeds; with the port
    fixed by the caller it fails at once, naming the port and the fix."""
    from vllm_dist.implementations.launchers import mp as mp_launcher

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        picked: list[int] = []

        def pick(host: str) -> int:
            port = taken if not picked else find_free_port(host)
            picked.append(port)
            return port

        monkeypatch.setattr(mp_launcher, "find_free_port", pick)
        kw = {
            "coordinator_type": CoordinatorType.TORCH_DISTRIBUTED,
            "communicator_type": "torch_distributed",
        }
        results = MPLauncher(2, timeout=90).launch(task_type=RanksTask, **kw)
        assert results == [[0, 1], [0, 1]]
        assert picked[0] == taken and len(picked) == 2 and picked[1] != taken, picked

        fixed = MPLauncher(2, timeout=90, master_port=taken)
        with pytest.raises(LaunchError, match=f"port {taken} .* held by another process"):
            fixed.launch(task_type=RanksTask, **kw)


def test_free_ports_come_from_outside_the_ephemeral_range() -> None:
    """Outgoing connections take ports from the ephemeral range at any moment; a rendezvous
    port from outside it can only collide with an explicit bind."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low, high = (int(x) for x in f.read().split()[:2])
    ports = {find_free_port("127.0.0.1") for _ in range(20)}
    assert not any(low <= p <= high for p in ports), (low, high, ports)
    assert len(ports) > 1  # drawn at random, so parallel launches do not race for one port


def test_a_port_held_on_another_address_is_not_free() -> None:
    """torch's store listens on the wildcard address: a port some service holds on one address
    of the machine would fail rank 0's bind, so it is not handed out."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        assert not _bindable(socket.AF_INET, port)


class LateCoordinatorTask(DistributedTask):
    """Does its work, then joins a coordinator of its own on a port the caller chose."""

    def run(self, *, port: int, log: str, **_: Any) -> None:
        with open(log, "a") as f:
            f.write(f"{self.worker_info.rank}\n")
        info = dataclasses.replace(self.worker_info, master_port=port)
        get_coordinator_class(CoordinatorType.TORCH_DISTRIBUTED)(info, timeout=20).initialize()


@distributed_test(timeout=120)
def test_a_taken_port_the_task_chose_is_not_retried(tmp_path) -> None:
    """Only the launch's own rendezvous port is retried: a task that fails on a port it chose
    itself, after doing work, runs once and names the port."""
    log = tmp_path / "runs"
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = holder.getsockname()[1]
        with pytest.raises(LaunchError, match=f"port {taken} .* held by another process") as err:
            MPLauncher(2, timeout=90).launch(
                task_type=LateCoordinatorTask, port=taken, log=str(log)
            )
    assert not any(f.port_taken for f in err.value.failures)
    runs = log.read_text().split()  # rank 1 may be stopped before it starts: rank 0 fails fast
    assert "0" in runs and len(runs) == len(set(runs)), runs  # one launch, not three


def test_launchers_say_whether_they_can_run_here() -> None:
    """``unavailable_reason()``: None where the launcher works (``info`` reports the reason where
    it does not: see test_cli's blocked-Ray case)."""
    from vllm_dist import RayLauncher

    assert MPLauncher.unavailable_reason() is None
    ray_missing = __import__("importlib").util.find_spec("ray") is None
    assert (RayLauncher.unavailable_reason() is None) != ray_missing
