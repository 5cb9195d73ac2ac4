"""``vllm-dist run ... --launcher ray --address ADDR --gpus-per-task N``: flags checked in the
parent, handed to ``RayLauncher``, and one real all-reduce on a private Ray."""

from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from typing import Any

import pytest

from tests.utils import distributed_test
from vllm_dist import cli
from vllm_dist.cli import main
from vllm_dist.examples.weight_sync_demo import run_demo
from vllm_dist.implementations.launchers.mp import MPLauncher

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.ray
DEMO_TAKES_LAUNCHER = "launcher" in inspect.signature(run_demo).parameters


@pytest.fixture
def no_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any launch fails the test: a refused flag must not start a worker."""
    from vllm_dist import RayLauncher

    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("a worker was started for a flag that should have been refused")

    monkeypatch.setattr(MPLauncher, "launch", refuse)
    monkeypatch.setattr(RayLauncher, "launch", refuse)


@pytest.mark.parametrize(
    ("argv", "names"),
    [
        (["run", "weight-transfer", "--address", "auto"], ["--address", "--launcher ray"]),
        (["run", "all-reduce", "--gpus-per-task", "1"], ["--gpus-per-task", "--launcher ray"]),
        (["run", "weight-transfer", "--gpus-per-task", "1"], ["--gpus-per-task"]),
        (["run", "all-reduce", "--launcher", "ray", "--gpus-per-task", "-1"], ["--gpus-per-task"]),
        (["run", "all-reduce", "--launcher", "ray", "--gpus-per-task", "x"], ["--gpus-per-task"]),
        (
            ["run", "all-reduce", "--launcher", "ray", "--device", "cuda", "--gpus-per-task", "0"],
            ["--gpus-per-task 0", "--device cpu"],
        ),
        (["run", "all-reduce", "--launcher", "ray", "--address", " "], ["--address", "auto"]),
        (["run", "weight-transfer", "--launcher", "ray", "--address", ""], ["--address"]),
    ],
)
def test_bad_ray_flag_is_refused_before_any_worker(
    no_launch: None, capsys: pytest.CaptureFixture[str], argv: list[str], names: list[str]
) -> None:
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2 and out == "", (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for name in names:
        assert name in lines[0], lines[0]


@pytest.mark.parametrize(
    ("argv", "n", "address", "bundle"),
    [
        (["all-reduce", "--launcher", "ray"], 2, None, {"CPU": 1.0}),
        (
            ["all-reduce", "--launcher", "ray", "--address", "auto", "--world-size", "3"],
            3,
            "auto",
            {"CPU": 1.0},
        ),
        (
            ["all-reduce", "--launcher", "ray", "--device", "cuda", "--gpus-per-task", "0.5"],
            2,
            None,
            {"CPU": 1.0, "GPU": 0.5},
        ),
        (["all-reduce", "--launcher", "ray", "--device", "cuda"], 2, None, {"CPU": 1, "GPU": 1}),
        (
            ["weight-transfer", "--launcher", "ray", "--address", "127.0.0.1:6379"],
            4,
            "127.0.0.1:6379",
            {"CPU": 1.0},
        ),
        (
            ["weight-transfer", "--launcher", "ray", "--gpus-per-task", "1", "--producers", "1"],
            3,
            None,
            {"CPU": 1.0, "GPU": 1.0},
        ),
    ],
)
def test_ray_flags_reach_the_launcher(
    argv: list[str], n: int, address: str | None, bundle: dict[str, float]
) -> None:
    args = cli.build_parser().parse_args(["run", *argv])
    wt = args.job == "weight-transfer"
    launcher = cli.make_launcher(args, args.producers + args.consumers if wt else args.world_size)
    assert launcher.n_tasks == n
    assert launcher._address == address and launcher._bundle == bundle


def test_weight_transfer_hands_its_ray_launcher_to_the_demo(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from vllm_dist import RayLauncher
    from vllm_dist.examples import weight_sync_demo

    seen: dict[str, Any] = {}

    def fake_demo(**kwargs: Any) -> dict[str, Any]:
        seen.update(kwargs)
        return {"verified": True}

    monkeypatch.setattr(weight_sync_demo, "run_demo", fake_demo)
    rc = main(["run", "weight-transfer", "--launcher", "ray", "--address", "auto", "--json"])
    capsys.readouterr()
    assert rc == 0
    launcher = seen["launcher"]
    assert isinstance(launcher, RayLauncher) and launcher.n_tasks == 4
    assert launcher._address == "auto"
    seen.clear()
    assert main(["run", "weight-transfer", "--json"]) == 0
    assert "launcher" not in seen  # the demo's own MPLauncher


def _run_cli(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    code = f"""
        import sys
        from vllm_dist.cli import main
        sys.exit(main({argv!r}))
        """
    ray_tmp = tempfile.mkdtemp(prefix="ray")  # short: Ray's socket paths have a length limit
    try:
        return subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code)],
            env={**os.environ, "RAY_TMPDIR": ray_tmp, "RAY_ADDRESS": ""},
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)


@distributed_test(timeout=300)
def test_all_reduce_on_a_private_ray() -> None:
    argv = ["run", "all-reduce", "--launcher", "ray", "--size", "4KiB", "--iters", "2", "--json"]
    proc = _run_cli(argv, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout)
    assert summary["verified"] is True, summary


@distributed_test(timeout=400)
@pytest.mark.skipif(
    not DEMO_TAKES_LAUNCHER,
    reason="needs run_demo(launcher=...) in vllm_dist/examples/weight_sync_demo.py",
)
def test_weight_transfer_on_a_private_ray() -> None:
    argv = ["run", "weight-transfer", "--launcher", "ray", "--syncs", "2", "--json"]
    proc = _run_cli(argv, timeout=340)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout)["verified"] is True
