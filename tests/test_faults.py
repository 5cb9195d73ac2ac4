"""Faults under MPLauncher, with real processes: which rank is named first, the rank that never
arrived, nothing left behind when the parent is killed, crashes after the result, arguments
refused before any worker starts, and tracebacks that point at the user's file.

Time bounds are generous (load on a shared machine must not break them): they only tell a
failure reported at once from one that waits out a long timeout.
"""

from __future__ import annotations

import inspect
import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest

from tests.test_launcher import _descendants, _run_script, _running, _wait_gone
from tests.utils import distributed_test
from vllm_dist import (
    DistributedTask,
    GlobalCoordinatorDistributedTask,
    GroupCoordinatorDistributedTask,
    LaunchError,
    LaunchTimeoutError,
    MPLauncher,
)
from vllm_dist.implementations.launchers.common import mark_causes
from vllm_dist.interfaces import WorkerFailure

BACKENDS = {"coordinator_type": "torch_distributed", "communicator_type": "torch_distributed"}


class RaiseThenPeerSeesClose(GlobalCoordinatorDistributedTask):
    """Rank 1 raises after one collective; rank 0 then waits in another and sees the close."""

    def post_init_distributed(self, **_: Any) -> int:
        self.coordinator.all_gather_object(0)
        if self.coordinator.get_rank() == 1:
            raise ValueError("rank 1's own error")
        self.coordinator.all_gather_object(1)  # "Connection closed by peer"
        return 0


@distributed_test(timeout=120)
def test_the_first_rank_to_fail_is_listed_first() -> None:
    with pytest.raises(LaunchError) as err:
        MPLauncher(2, timeout=90).launch(task_type=RaiseThenPeerSeesClose, **BACKENDS)
    first = err.value.failures[0]
    assert first.rank == 1 and first.cause and first.kind == "raised"
    assert "rank 1's own error" in first.traceback
    text = str(err.value)
    assert text.index("--- rank 1") < text.index("rank 1's own error")
    for f in err.value.failures[1:]:  # rank 0's consequence, when it came in time
        assert not f.cause and f"--- rank {f.rank} (after rank 1 failed)" in text


def test_a_consequence_that_arrives_first_is_still_listed_second() -> None:
    """Both reach the parent in one read, rank 0's reaction stamped first."""
    closed = WorkerFailure(
        rank=0,
        reason="raised an exception",
        kind="raised",
        at=1.0,
        traceback="Traceback ...\nRuntimeError: [pair.cc:534] Connection closed by peer [::1]:1\n",
    )
    own = WorkerFailure(
        rank=1, reason="raised an exception", kind="raised", at=2.0, traceback="ValueError: x\n"
    )
    err = LaunchError(mark_causes([closed, own]))
    assert [f.rank for f in err.failures] == [1, 0] and err.ranks == [0, 1]
    assert "--- rank 0 (after rank 1 failed)" in str(err)


class OneRankHangs(GlobalCoordinatorDistributedTask):
    """Both ranks pass one collective; rank 1 then never arrives at the next one."""

    def post_init_distributed(self, **_: Any) -> int:
        self.coordinator.all_gather_object(0)
        if self.coordinator.get_rank() == 1:
            time.sleep(600)  # stuck in its own work
        self.coordinator.all_gather_object(1)
        return 0


def _assert_rank1_named_as_hung(err: LaunchError) -> None:
    first = err.failures[0]
    assert first.rank == 1 and first.kind == "hung" and first.cause, str(err)
    assert first.last_op.startswith("returned from all_gather_object #"), first.last_op
    assert "post_init_distributed" in first.traceback, first.traceback  # its stack
    text = str(err)
    assert text.index("--- rank 1") < text.index("--- rank 0"), text


@distributed_test(timeout=120)
def test_a_collective_timeout_names_the_rank_that_never_arrived() -> None:
    with pytest.raises(LaunchError) as err:
        MPLauncher(2, timeout=90).launch(
            task_type=OneRankHangs, coordinator_options={"timeout": 4}, **BACKENDS
        )
    assert not isinstance(err.value, LaunchTimeoutError), err.value  # the collective's timeout
    _assert_rank1_named_as_hung(err.value)
    zero = next(f for f in err.value.failures if f.rank == 0)
    assert not zero.cause and zero.last_op.startswith("inside all_gather_object #")


@distributed_test(timeout=120)
def test_a_launch_timeout_names_the_rank_that_never_arrived() -> None:
    with pytest.raises(LaunchTimeoutError) as err:
        MPLauncher(2, timeout=12).launch(task_type=OneRankHangs, **BACKENDS)
    _assert_rank1_named_as_hung(err.value)
    lines, first = inspect.getsourcelines(OneRankHangs.post_init_distributed)
    sleep_line = first + next(i for i, line in enumerate(lines) if "time.sleep" in line)
    assert f"line {sleep_line} in post_init_distributed" in err.value.failures[0].traceback


_ORPHAN_SCRIPT = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from vllm_dist import MPLauncher, DistributedTask

    class StartsASleep(DistributedTask):
        def run(self):
            child = subprocess.Popen(["sleep", "300"])
            with open(os.path.join(sys.argv[1], f"{child.pid}.pid"), "w") as f:
                f.write("x")
            time.sleep(600)

    if __name__ == "__main__":
        MPLauncher(2, timeout=300).launch(task_type=StartsASleep)
    """
)


@distributed_test(timeout=120)
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_what_workers_started_dies_with_a_killed_parent(tmp_path, sig: int) -> None:
    parent = _run_script(tmp_path, _ORPHAN_SCRIPT)
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("*.pid"))) < 2:
        assert time.monotonic() < deadline and parent.poll() is None, "workers did not start"
        time.sleep(0.1)
    grandchildren = {int(p.stem) for p in tmp_path.glob("*.pid")}
    assert all(_running(p) for p in grandchildren)
    parent.send_signal(sig)
    parent.wait(timeout=30)
    assert not _wait_gone(grandchildren, timeout=20), "the workers' children outlived the launch"


class CrashesAtExit(DistributedTask):
    def run(self, **_: Any) -> int:
        import atexit

        if self.worker_info.rank == 1:  # dies after its result is on its way
            atexit.register(os.kill, os.getpid(), signal.SIGABRT)
        return self.worker_info.rank


@distributed_test(timeout=120)
def test_a_worker_that_dies_after_returning_is_reported() -> None:
    with pytest.raises(LaunchError) as err:
        MPLauncher(2, timeout=60).launch(task_type=CrashesAtExit)
    assert err.value.ranks == [1]
    failure = err.value.failures[0]
    assert failure.kind == "exit_after_result" and failure.signal == signal.SIGABRT
    assert "SIGABRT after returning its result" in str(err.value)


class CleanExit(GlobalCoordinatorDistributedTask):
    def post_init_distributed(self, **_: Any) -> int:
        return int(self.coordinator.all_gather_object(1)[0])


@distributed_test(timeout=180)
def test_clean_launches_end_with_exit_code_zero() -> None:
    """Six launches: twelve workers that hold gloo pairs end with code 0 (a crash at exit
    after the result would fail the launch)."""
    for _ in range(6):
        assert MPLauncher(2, timeout=90).launch(task_type=CleanExit, **BACKENDS) == [1, 1]


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"env": {"FOO": 1}}, "env"),
        ({"timeout": "10"}, "timeout"),
        ({"timeout": float("nan")}, "timeout"),
        ({"timeout": -1}, "timeout"),
        ({"master_port": "abc"}, "master_port"),
        ({"master_port": 70000}, "master_port"),
        ({"master_addr": "no-such-host.invalid"}, "master_addr"),
    ],
)
def test_bad_launcher_arguments_are_refused_by_name(options: dict[str, Any], named: str) -> None:
    with pytest.raises((TypeError, ValueError), match=named) as err:
        MPLauncher(2, **options)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("n", [True, 0, -1, 2.0])
def test_bad_task_counts_are_refused(n: Any) -> None:
    with pytest.raises(ValueError, match="n_tasks"):
        MPLauncher(n)


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count()


class Groups(GroupCoordinatorDistributedTask):
    def post_init_distributed(self, **_: Any) -> int:
        return 0


@pytest.mark.parametrize(
    ("task", "kwargs", "named"),
    [
        (CleanExit, {**BACKENDS, "coordinator_type": "nope"}, "coordinator_type"),
        (CleanExit, {**BACKENDS, "communicator_type": "nope"}, "communicator_type"),
        (Groups, {**BACKENDS, "groups": [[0, 1], [1]]}, "rank 1 is in groups"),
        (Groups, {**BACKENDS, "groups": [[0]]}, "in no group"),
        (Groups, {**BACKENDS, "groups": [[0, 1], []]}, "empty"),
        (Groups, {**BACKENDS, "groups": [[0, 2]]}, "rank 2"),
        (Groups, {**BACKENDS, "groups": [[False, True]]}, "rank False"),
        (CleanExit, {**BACKENDS, "device": "gpu"}, "names no torch device"),
        (CleanExit, {**BACKENDS, "device": 3}, "device must be a string"),
        (Groups, {**BACKENDS, "groups": [[0, 1]], "device": "cuda:x"}, "names no torch device"),
        (CleanExit, {**BACKENDS, "device": f"cuda:{_cuda_count()}"}, "CUDA device"),
    ],
)
def test_bad_task_keywords_are_refused_before_workers_start(
    task: type[DistributedTask], kwargs: dict[str, Any], named: str
) -> None:
    before = _descendants()
    with pytest.raises((TypeError, ValueError), match=named) as err:
        MPLauncher(2, timeout=60).launch(task_type=task, **kwargs)
    assert not isinstance(err.value, LaunchError)
    assert _descendants() <= before  # no worker was started


@pytest.mark.parametrize("num_producers", [0, -1, True])
def test_a_weight_transfer_without_producers_is_refused_before_workers_start(
    num_producers: Any,
) -> None:
    from vllm_dist.tasks.weight_transfer import WeightTransferTask

    before = _descendants()
    with pytest.raises(ValueError, match="num_producers must be an int >= 1"):
        MPLauncher(2, timeout=60).launch(
            task_type=WeightTransferTask, num_producers=num_producers, num_consumers=1, **BACKENDS
        )
    assert _descendants() <= before


class RaisesHere(DistributedTask):
    def run(self, **_: Any) -> None:
        raise RuntimeError("from the user's task")


@distributed_test(timeout=60)
def test_user_frames_name_the_users_file() -> None:
    with pytest.raises(LaunchError) as err:
        MPLauncher(1, timeout=60).launch(task_type=RaisesHere)
    tb = err.value.failures[0].traceback
    assert "<dynamic-code>" not in tb
    assert f'"{os.path.abspath(__file__)}"' in tb and 'raise RuntimeError("from the' in tb


_UNGUARDED_SCRIPT = textwrap.dedent(
    """
    from vllm_dist import MPLauncher, DistributedTask

    class Task(DistributedTask):
        def run(self):
            return 1

    MPLauncher(2, timeout=60).launch(task_type=Task)
    """
)


@distributed_test(timeout=120)
def test_a_script_without_the_main_guard_is_told_so(tmp_path) -> None:
    script = tmp_path / "unguarded.py"
    script.write_text(_UNGUARDED_SCRIPT)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=90
    )
    assert proc.returncode != 0
    assert 'if __name__ == "__main__":' in proc.stderr, proc.stderr[-3000:]
    assert "bootstrapping phase" not in proc.stderr, proc.stderr[-3000:]
    # found in the parent before any worker started: one short traceback, one sentence
    assert "launch() runs at the top level of unguarded.py (line 8)" in proc.stderr, proc.stderr
    assert len(proc.stderr.splitlines()) < 10 and "[rank" not in proc.stderr, proc.stderr
