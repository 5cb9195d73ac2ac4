"""``run_task`` and ``WorkerInfo.from_env``: one task under torchrun, SLURM, Open MPI variables and
``MPLauncher``, with the same results; the SLURM host list grammar; errors that name the fix."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.utils import distributed_test
from vllm_dist import (
    CommunicatorType,
    CoordinatorType,
    GlobalCoordinatorDistributedTask,
    MPLauncher,
    WorkerInfo,
    run_task,
)
from vllm_dist.implementations.launchers.common import find_free_port
from vllm_dist.interfaces.worker_env import expand_hostlist, expand_tasks_per_node

ROOT = Path(__file__).resolve().parents[1]
KWARGS = {
    "coordinator_type": CoordinatorType.TORCH_DISTRIBUTED,
    "communicator_type": CommunicatorType.TORCH_DISTRIBUTED,
    "device": "cpu",
}
EXPECTED = [
    {"rank": r, "world": 2, "local_rank": r, "local_world": 2, "sum": [3.0] * 4, "scale": 10}
    | {"env": [str(r), "2", str(r)]}
    for r in range(2)
]
_FOREIGN = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_")
_FOREIGN += ("SLURM_", "OMPI_", "TORCHELASTIC_", "VLLM_DIST_LAUNCH_ID")

# What each rank runs under torchrun, srun or mpirun: the same task MPLauncher runs.
WORKER = """
import json, os, sys
from tests.test_run_task import KWARGS, SumTask
from vllm_dist import run_task
result = run_task(SumTask, scale=10, **KWARGS)
with open(os.path.join(sys.argv[1], f"{result['rank']}.json"), "w") as f:
    json.dump(result, f)
"""


class SumTask(GlobalCoordinatorDistributedTask):
    """All-reduce rank + 1 over the world; report where this rank stood."""

    def post_init_distributed(self, *, scale: int) -> dict[str, Any]:
        t = torch.full((4,), float(self.coordinator.get_rank() + 1))
        self.communicator.all_reduce(tensor_in=t)
        info = self.worker_info
        return {
            "rank": self.coordinator.get_rank(),
            "world": self.coordinator.get_world_size(),
            "local_rank": info.local_rank,
            "local_world": info.local_world_size,
            "sum": t.tolist(),
            "scale": scale,
            # the torchrun names, as every launcher (and run_task) sets them for user code
            "env": [os.environ.get(k, "") for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")],
        }


# --------------------------------------------------------------------------- host lists


@pytest.mark.parametrize(
    ("hostlist", "hosts"),
    [
        ("node1", ["node1"]),
        ("node[1-3,5]", ["node1", "node2", "node3", "node5"]),
        ("a[01-02],b7", ["a01", "a02", "b7"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[098-101]", ["n098", "n099", "n100", "n101"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("gpu-[1-2]-[a]", ["gpu-1-a", "gpu-2-a"]),
        ("x[1,3],y,z[2-3]", ["x1", "x3", "y", "z2", "z3"]),
        ("h.example[1-2].lan", ["h.example1.lan", "h.example2.lan"]),
    ],
)
def test_expand_hostlist_like_scontrol(hostlist: str, hosts: list[str]) -> None:
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("bad", ["n[1-2", "n1-2]", "n[[1]]", "n[3-1]", "n[a-b]"])
def test_expand_hostlist_refuses_malformed(bad: str) -> None:
    with pytest.raises(ValueError, match="host list"):
        expand_hostlist(bad)


def test_expand_tasks_per_node() -> None:
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(ValueError, match="SLURM_TASKS_PER_NODE"):
        expand_tasks_per_node("2x3")


# --------------------------------------------------------------------------- from_env


def test_from_env_torchrun() -> None:
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    env |= {"GROUP_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    env |= {"TORCHELASTIC_RESTART_COUNT": "2", "SLURM_PROCID": "0"}  # torchrun under srun
    info = WorkerInfo.from_env(env)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (3, 4, 1, 2)
    assert (info.node_rank, info.master_addr, info.master_port) == (1, "127.0.0.1", 29500)


def _slurm_env(**over: str) -> dict[str, str]:
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "1", "SLURM_NODEID": "2"}
    env |= {"SLURM_TASKS_PER_NODE": "2(x3)", "SLURM_NODELIST": "gpu[07-09]", "MASTER_PORT": "1"}
    return env | over


def test_from_env_slurm() -> None:
    info = WorkerInfo.from_env(_slurm_env())
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (5, 6, 1, 2)
    assert (info.node_rank, info.master_addr, info.master_port) == (2, "gpu07", 1)
    assert WorkerInfo.from_env(_slurm_env(SLURM_NTASKS_PER_NODE="2")).local_world_size == 2
    assert WorkerInfo.from_env(_slurm_env(MASTER_ADDR="127.0.0.1")).master_addr == "127.0.0.1"


def test_from_env_slurm_names_what_is_missing() -> None:
    env = _slurm_env()
    del env["MASTER_PORT"]
    with pytest.raises(ValueError, match="MASTER_PORT"):
        WorkerInfo.from_env(env)
    del env["SLURM_NODELIST"]
    with pytest.raises(ValueError, match="SLURM_NODELIST"):
        WorkerInfo.from_env(env)
    with pytest.raises(ValueError, match="SLURM_LOCALID"):
        WorkerInfo.from_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"})


def _ompi_env(**over: str) -> dict[str, str]:
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4"}
    env |= {"OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    return env | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "2"} | over


def test_from_env_open_mpi() -> None:
    info = WorkerInfo.from_env(_ompi_env())
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (3, 4, 1, 2)
    assert (info.node_rank, info.master_addr, info.master_port) == (1, "127.0.0.1", 2)
    env = _ompi_env()
    del env["MASTER_ADDR"]
    with pytest.raises(ValueError, match=r"Open MPI.*MASTER_ADDR.*-x MASTER_ADDR"):
        WorkerInfo.from_env(env)


def test_from_env_nothing_known() -> None:
    with pytest.raises(ValueError, match="torchrun, srun or mpirun"):
        WorkerInfo.from_env({"PATH": "/bin"})
    with pytest.raises(ValueError, match="MASTER_PORT"):
        WorkerInfo.from_env({"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "x"})
    with pytest.raises(ValueError, match="SLURM_NTASKS=.*not an integer"):
        WorkerInfo.from_env(_slurm_env(SLURM_NTASKS="two"))


def test_run_task_refuses_a_non_task() -> None:
    with pytest.raises(TypeError, match="DistributedTask"):
        run_task(dict)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- real launches


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_FOREIGN)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return env


def _results(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"{r}.json").read_text()) for r in range(2)]


def _write_worker(tmp_path: Path) -> Path:
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    return script


@distributed_test(timeout=180)
def test_same_results_under_torchrun(tmp_path: Path) -> None:
    script = _write_worker(tmp_path)
    port = find_free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    cmd += ["--master-addr", "127.0.0.1", "--master-port", str(port), str(script), str(tmp_path)]
    proc = subprocess.run(
        cmd, env=_clean_env(), cwd=ROOT, capture_output=True, text=True, timeout=150
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert _results(tmp_path) == EXPECTED


def _scheme_env(scheme: str, rank: int, port: int) -> dict[str, str]:
    if scheme == "slurm":
        env = {"SLURM_PROCID": str(rank), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(rank)}
        env |= {"SLURM_NODEID": "0", "SLURM_TASKS_PER_NODE": "2", "SLURM_NODELIST": "localhost"}
        return env | {"SLURM_JOB_ID": "1", "MASTER_PORT": str(port)}
    env = {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "2"}
    env |= {"OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    return env | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


@distributed_test(timeout=180)
@pytest.mark.parametrize("scheme", ["slurm", "ompi"])
def test_same_results_under_slurm_and_mpi_variables(tmp_path: Path, scheme: str) -> None:
    script = _write_worker(tmp_path)
    port = find_free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path)],
            env=_clean_env() | _scheme_env(scheme, rank, port),
            cwd=ROOT,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        errors = [p.communicate(timeout=150)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(e[-3000:] for e in errors)
    assert _results(tmp_path) == EXPECTED


@distributed_test()
def test_same_results_under_mp_launcher() -> None:
    assert MPLauncher(2, timeout=90).launch(task_type=SumTask, scale=10, **KWARGS) == EXPECTED
