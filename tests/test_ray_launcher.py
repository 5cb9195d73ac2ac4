"""RayLauncher: rank order, torchrun facts, failures, fail-fast placement, nothing left behind.

Every test runs on the session's local Ray (``ray_session`` in conftest.py) except the ones that
check how the launcher starts or misses Ray, which run in a fresh interpreter.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from typing import Any

import pytest

from tests.utils import distributed_test
from vllm_dist import (
    DistributedTask,
    GlobalCoordinatorDistributedTask,
    LaunchError,
    LaunchTimeoutError,
    WorkerInfo,
)
from vllm_dist.implementations.launchers.ray import _Placement, _visible_devices, worker_infos

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray

BACKENDS = {"coordinator_type": "torch_distributed", "communicator_type": "torch_distributed"}
KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class EnvTask(DistributedTask):
    def run(self, **kwargs: Any) -> dict[str, Any]:
        return {
            "env": {k: os.environ.get(k) for k in KEYS},
            "info": self.worker_info,
            "kwargs": kwargs,
            "pid": os.getpid(),
            "main_thread": threading.current_thread() is threading.main_thread(),
        }


class FailTask(DistributedTask):
    def run(self, *, mode: str, bad_rank: int = 1) -> int:
        rank = self.worker_info.rank
        if rank == bad_rank and mode == "raise":
            raise RuntimeError(f"boom from rank {rank}")
        if rank == bad_rank and mode == "exit":
            os._exit(3)
        if mode != "ok":
            time.sleep(600)  # the healthy ranks wait "in a collective" forever
        return rank


def _live_actors_and_groups() -> tuple[int, int]:
    """ALIVE/pending actors and CREATED/pending placement groups, read from the GCS.

    ``ray.util.state`` needs the dashboard, which the test cluster runs without; the GCS tables
    behind it say the same thing.
    """
    from ray._private.state import actors
    from ray.util import placement_group_table

    live_actors = sum(a["State"] != "DEAD" for a in actors().values())
    live_groups = sum(g["state"] != "REMOVED" for g in placement_group_table().values())
    return live_actors, live_groups


def _assert_nothing_lingers(timeout: float = 5.0) -> None:
    """Kills are asynchronous in Ray's GCS: allow a moment, never more than ``timeout``."""
    deadline = time.monotonic() + timeout
    while (counts := _live_actors_and_groups()) != (0, 0):
        assert time.monotonic() < deadline, f"(actors, placement groups) left: {counts}"
        time.sleep(0.05)


@distributed_test(timeout=120)
@pytest.mark.parametrize("n", [1, 3])
def test_results_in_rank_order_with_torchrun_env(ray_session, n: int) -> None:
    from vllm_dist import RayLauncher

    results = RayLauncher(n, timeout=60).launch(task_type=EnvTask, alpha=1, beta=[2])
    assert [r["info"].rank for r in results] == list(range(n))
    assert len({r["pid"] for r in results}) == n
    for rank, r in enumerate(results):
        info: WorkerInfo = r["info"]
        assert (info.world_size, info.local_rank, info.local_world_size) == (n, rank, n)
        assert info.node_rank == 0 and info.master_addr == "127.0.0.1"
        assert r["env"] == {k: v for k, v in info.env().items() if k in KEYS}
        assert r["kwargs"] == {"alpha": 1, "beta": [2]}
        assert r["main_thread"]  # as under MPLauncher: a task may install signal handlers
    assert len({r["info"].master_port for r in results}) == 1
    _assert_nothing_lingers()


class SecretTask(DistributedTask):
    def run(self) -> dict[str, Any]:
        secret = self.worker_info.secret
        return {
            "secret": secret,
            "in_env": any(secret.hex() in v or v.encode() == secret for v in os.environ.values()),
            "in_repr": secret.hex() in repr(self.worker_info) or repr(secret) in repr(self),
        }


@distributed_test(timeout=120)
def test_the_launch_secret_reaches_every_actor_and_no_environment(ray_session) -> None:
    """One 32-byte secret per launch, the same on every rank, handed over Ray's own channel:
    never in an actor's environment nor in a ``WorkerInfo`` repr."""
    from vllm_dist import RayLauncher

    launcher = RayLauncher(2, timeout=60)
    first, second = (launcher.launch(task_type=SecretTask) for _ in range(2))
    for results in (first, second):
        assert len(results[0]["secret"]) == 32
        assert results[0]["secret"] == results[1]["secret"]
        assert not any(r["in_env"] or r["in_repr"] for r in results), results
    assert first[0]["secret"] != second[0]["secret"]
    _assert_nothing_lingers()


@distributed_test(timeout=120)
@pytest.mark.parametrize("mode", ["raise", "exit"])
def test_failure_names_rank_and_kills_the_others(ray_session, mode: str) -> None:
    from vllm_dist import RayLauncher

    with pytest.raises(LaunchError) as err:
        RayLauncher(3, timeout=60).launch(task_type=FailTask, mode=mode)
    assert err.value.ranks == [1]
    text = str(err.value)
    if mode == "raise":
        assert "boom from rank 1" in text and "Traceback" in text
    else:
        assert "actor died" in text and "worker process has died" in text
    assert not isinstance(err.value, LaunchTimeoutError), text  # the failure ended it
    _assert_nothing_lingers()


@distributed_test(timeout=120)
def test_timeout_kills_hung_actors(ray_session) -> None:
    from vllm_dist import RayLauncher

    with pytest.raises(LaunchTimeoutError) as err:
        RayLauncher(2, timeout=4).launch(task_type=FailTask, mode="hang")
    assert err.value.ranks == [0, 1] and "timed out after 4 s" in str(err.value)
    _assert_nothing_lingers()


class OneRankHangs(GlobalCoordinatorDistributedTask):
    """Both ranks pass one collective; rank 1 then never arrives at the next one."""

    def post_init_distributed(self, **_: Any) -> int:
        self.coordinator.all_gather_object(0)
        if self.coordinator.get_rank() == 1:
            time.sleep(600)  # stuck in its own work
        self.coordinator.all_gather_object(1)
        return 0


@distributed_test(timeout=180)
@pytest.mark.parametrize("which", ["launch", "collective"])
def test_a_timeout_names_the_rank_that_never_arrived(ray_session, which: str) -> None:
    """Rank 1 hangs in its own work while rank 0 waits in a collective: whether the launch or
    the collective times out, rank 1 is listed first, with its last operation and its stack."""
    from vllm_dist import RayLauncher

    kw: dict[str, Any] = dict(BACKENDS)
    if which == "collective":
        kw["coordinator_options"] = {"timeout": 4}
    error = LaunchTimeoutError if which == "launch" else LaunchError
    with pytest.raises(error) as err:
        RayLauncher(2, timeout=15 if which == "launch" else 90).launch(task_type=OneRankHangs, **kw)
    first = err.value.failures[0]
    assert first.rank == 1 and first.kind == "hung" and first.cause, str(err.value)
    assert first.last_op.startswith("returned from all_gather_object #"), first.last_op
    assert "post_init_distributed" in first.traceback, first.traceback
    zero = next(f for f in err.value.failures if f.rank == 0)
    assert not zero.cause and zero.last_op.startswith("inside all_gather_object #"), str(err)
    text = str(err.value)
    assert text.index("--- rank 1") < text.index("--- rank 0"), text
    assert "on node 0" in text
    _assert_nothing_lingers()


@distributed_test(timeout=60)
@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"num_gpus_per_task": 1}, "GPU: 1"),
        ({"num_cpus_per_task": 64}, "CPU: 64"),
        ({"placement_strategy": "STRICT_SPREAD"}, "STRICT_SPREAD"),
    ],
)
def test_infeasible_request_fails_fast(ray_session, options: dict[str, Any], expected: str) -> None:
    from vllm_dist import RayLauncher

    with pytest.raises(LaunchError) as err:
        RayLauncher(2, timeout=60, **options).launch(task_type=EnvTask)
    assert not isinstance(err.value, LaunchTimeoutError)  # refused, not waited out
    text = str(err.value)
    assert "cannot place 2 task(s)" in text and expected in text, text
    assert "the cluster has" in text and "alive node(s)" in text
    _assert_nothing_lingers()


@distributed_test(timeout=150)
def test_twelve_launches_leave_no_actors_or_placement_groups(ray_session) -> None:
    """Successes, raises and exits in turn on one launcher: nothing is left after any of them
    (benchmarks/ray_launches.py measures the driver's threads, fds and memory over 50)."""
    from vllm_dist import RayLauncher

    launcher = RayLauncher(2, timeout=60)
    outcomes = {"ok": 0, "raise": 0, "exit": 0}
    for i in range(12):
        mode = "exit" if i % 6 == 5 else "raise" if i % 6 == 2 else "ok"
        try:
            assert launcher.launch(task_type=FailTask, mode=mode) == [0, 1]
            outcomes["ok"] += 1
        except LaunchError as err:
            assert mode != "ok" and err.ranks == [1], str(err)
            outcomes[mode] += 1
    assert outcomes == {"ok": 8, "raise": 2, "exit": 2}
    _assert_nothing_lingers()


def test_one_gpu_per_task_maps_local_rank_to_its_gpu() -> None:
    """Two nodes, ranks interleaved: local ranks count per node and index the node's GPU list."""
    placements = [
        _Placement(node_ip="10.0.0.1", node_id="a", gpu_ids=("3",), free_port=29500),
        _Placement(node_ip="10.0.0.2", node_id="b", gpu_ids=("0",), free_port=None),
        _Placement(node_ip="10.0.0.1", node_id="a", gpu_ids=("1",), free_port=None),
        _Placement(node_ip="10.0.0.2", node_id="b", gpu_ids=("2",), free_port=None),
    ]
    infos = worker_infos(placements)
    assert [(i.local_rank, i.local_world_size, i.node_rank) for i in infos] == [
        (0, 2, 0),
        (0, 2, 1),
        (1, 2, 0),
        (1, 2, 1),
    ]
    assert {(i.master_addr, i.master_port) for i in infos} == {("10.0.0.1", 29500)}
    envs = _visible_devices(placements, {"CPU": 1, "GPU": 1})
    for info, env, placement in zip(infos, envs, placements, strict=True):
        visible = env["CUDA_VISIBLE_DEVICES"].split(",")
        assert visible[info.local_rank] == placement.gpu_ids[0]
    assert _visible_devices(placements, {"CPU": 1, "GPU": 0.5}) == [{}] * 4


def test_rejects_bad_arguments() -> None:
    from vllm_dist import RayLauncher

    with pytest.raises(ValueError, match="n_tasks"):
        RayLauncher(0)
    with pytest.raises(ValueError, match="placement_strategy"):
        RayLauncher(1, placement_strategy="SCATTER")
    with pytest.raises(ValueError, match="empty bundles"):
        RayLauncher(1, num_cpus_per_task=0)
    with pytest.raises(TypeError, match="DistributedTask"):
        RayLauncher(1).launch(task_type=int)  # type: ignore[arg-type]


def _run_python(code: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_without_ray_the_error_names_the_install_command() -> None:
    code = """
        import sys
        sys.modules["ray"] = None  # as if Ray were not installed
        from vllm_dist import RayLauncher, BackendUnavailableError
        try:
            RayLauncher(2)
        except BackendUnavailableError as exc:
            print("ERROR:", exc)
        """
    proc = _run_python(code, {}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "ERROR: RayLauncher needs Ray" in proc.stdout
    assert "pip install 'vllm_dist[ray]'" in proc.stdout


@distributed_test(timeout=180)
def test_starts_and_stops_its_own_ray_only_when_none_is_running() -> None:
    """No Ray in the process: the launcher starts one and keeps it for the next launches,
    unless keep_ray=False; a Ray it did not start is left alone."""
    code = """
        import ray
        from vllm_dist import DistributedTask, RayLauncher

        class Rank(DistributedTask):
            def run(self):
                return self.worker_info.rank

        assert RayLauncher(2, timeout=60, keep_ray=False).launch(task_type=Rank) == [0, 1]
        print("after plain launch:", ray.is_initialized())
        assert RayLauncher(2, timeout=60).launch(task_type=Rank) == [0, 1]
        print("after keep_ray launch:", ray.is_initialized())
        assert RayLauncher(2, timeout=60).launch(task_type=Rank) == [0, 1]
        print("after launch on a running Ray:", ray.is_initialized())
        ray.shutdown()
        """
    ray_tmp = tempfile.mkdtemp(prefix="ray")  # short: Ray's socket paths have a length limit
    try:
        proc = _run_python(code, {"RAY_TMPDIR": ray_tmp, "RAY_ADDRESS": ""}, timeout=150)
    finally:
        subprocess.run(["rm", "-rf", ray_tmp], check=False, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "after plain launch: False" in proc.stdout
    assert "after keep_ray launch: True" in proc.stdout
    assert "after launch on a running Ray: True" in proc.stdout


@distributed_test(timeout=300)
def test_launches_in_one_driver_reuse_one_ray_with_flat_threads_and_fds() -> None:
    """Ten launches in a driver that had no Ray: one Ray serves them all, and the driver's
    threads and open files stay flat after the first (slack for Ray's own background work)."""
    code = """
        import json, os
        from vllm_dist import DistributedTask, RayLauncher


        class Rank(DistributedTask):
            def run(self):
                return self.worker_info.rank

        counts = []
        for i in range(10):
            assert RayLauncher(2, timeout=60).launch(task_type=Rank) == [0, 1]
            counts.append((len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))))
        print("COUNTS", json.dumps(counts))
        """
    ray_tmp = tempfile.mkdtemp(prefix="ray")
    try:
        proc = _run_python(code, {"RAY_TMPDIR": ray_tmp, "RAY_ADDRESS": ""}, timeout=280)
        sessions = glob.glob(f"{ray_tmp}/session_2*") + glob.glob(f"{ray_tmp}/*/session_2*")
    finally:
        subprocess.run(["rm", "-rf", ray_tmp], check=False, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith("COUNTS"))
    counts = json.loads(line[len("COUNTS ") :])
    (threads1, fds1), (threads10, fds10) = counts[0], counts[-1]
    assert threads10 <= threads1 + 3 and fds10 <= fds1 + 4, counts
    assert len(sessions) <= 1, sessions


@distributed_test(timeout=180)
def test_a_killed_driver_leaves_no_ray_process_behind() -> None:
    """SIGKILL the driver of a private Ray after a launch: its GCS, raylet, agents and workers
    are all gone after a bounded wait (the reaper stops the agents that Ray's own parent
    polling would leave listening for about a minute)."""
    psutil = pytest.importorskip("psutil")
    code = """
        import time
        from vllm_dist import DistributedTask, RayLauncher

        class Rank(DistributedTask):
            def run(self):
                return self.worker_info.rank

        assert RayLauncher(2, timeout=60).launch(task_type=Rank) == [0, 1]
        print("READY", flush=True)
        time.sleep(600)
        """
    ray_tmp = tempfile.mkdtemp(prefix="ray")
    env = {**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_ADDRESS": ""}
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith("READY")
        tree = psutil.Process(proc.pid).children(recursive=True)
        names = {p.name() for p in tree}
        assert any("raylet" in n for n in names), names
        proc.kill()
        proc.wait(timeout=30)
        _, alive = psutil.wait_procs(tree, timeout=45)
        left = [f"{p.pid} {p.name()}" for p in alive if p.status() != psutil.STATUS_ZOMBIE]
        assert not left, f"left behind by a killed driver: {left}"
    finally:
        proc.kill()
        subprocess.run(["rm", "-rf", ray_tmp], check=False, timeout=60)
