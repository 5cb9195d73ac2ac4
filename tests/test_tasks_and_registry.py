"""Grouped tasks, the registry (names, plugins, errors) and the CLI's main job."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch

from tests.utils import distributed_test
from vllm_dist import (
    CommOp,
    CommunicatorType,
    CoordinatorType,
    DistributedTask,
    GlobalCoordinatorDistributedTask,
    GroupCoordinatorDistributedTask,
    LaunchError,
    LauncherType,
    MPLauncher,
    UnsupportedOperationError,
    get_communicator_class,
    get_coordinator_class,
    get_launcher_class,
    register_communicator,
    register_launcher,
    registry,
)
from vllm_dist.cli import main as cli_main
from vllm_dist.cli import parse_size
from vllm_dist.tasks.base import find_group


class GroupAllReduceTask(GroupCoordinatorDistributedTask):
    def post_init_distributed(self, **_: Any) -> dict[str, Any]:
        t = torch.full((8,), float(self.global_coordinator.get_rank() + 1), device=self.device)
        self.communicator.all_reduce(tensor_in=t)
        everyone = self.global_coordinator.all_gather_object(self.coordinator.get_rank())
        self.coordinator.barrier(timeout=30)
        return {
            "group": self.group_index,
            "group_rank": self.coordinator.get_rank(),
            "group_size": self.coordinator.get_world_size(),
            "global_ranks": self.coordinator.get_global_ranks(),
            "value": t[0].item(),
            "all_group_ranks": everyone,
            "bcast": self.coordinator.broadcast_object(f"from group leader {self.group_index}", 0),
        }


@distributed_test(timeout=120)
@pytest.mark.parametrize("groups", [[[0, 1], [2, 3]], [[3, 0], [1, 2]], [[0], [1, 2, 3]]])
def test_grouped_all_reduce_stays_in_group(make_launcher, groups: list[list[int]]) -> None:
    results = make_launcher(4).launch(
        task_type=GroupAllReduceTask,
        coordinator_type=CoordinatorType.TORCH_DISTRIBUTED,
        communicator_type=CommunicatorType.TORCH_DISTRIBUTED,
        groups=groups,
        device="cpu",
    )
    for rank, r in enumerate(results):
        group = next(g for g in groups if rank in g)
        assert r["group"] == groups.index(group)
        assert r["global_ranks"] == group
        assert r["group_rank"] == group.index(rank)
        assert r["value"] == sum(g + 1 for g in group), (rank, r)
        assert r["bcast"] == f"from group leader {r['group']}"
        assert len(r["all_group_ranks"]) == 4


class ObjectOpsTask(GlobalCoordinatorDistributedTask):
    def post_init_distributed(self, **_: Any) -> list[Any]:
        c = self.coordinator
        rank, world = c.get_rank(), c.get_world_size()
        got = []
        if rank == 0:
            for dst in range(1, world):
                c.send_object({"to": dst, "payload": list(range(dst))}, dst=dst)
        else:
            got.append(c.recv_object(src=0))
        got.append(
            c.broadcast_object({"big": "x" * 100_000} if rank == world - 1 else None, world - 1)
        )
        got.append(c.all_gather_object(rank * 10))
        return got


@distributed_test()
def test_coordinator_object_ops(make_launcher) -> None:
    results = make_launcher(3).launch(
        task_type=ObjectOpsTask,
        coordinator_type="torch_distributed",
        communicator_type="torch_distributed",
        device="cpu",
    )
    assert results[1][0] == {"to": 1, "payload": [0]}
    assert results[2][0] == {"to": 2, "payload": [0, 1]}
    for r in results:
        assert r[-2] == {"big": "x" * 100_000}
        assert r[-1] == [0, 10, 20]


def test_find_group_rejects_bad_groups() -> None:
    assert find_group([[0, 1], [2, 3]], 2, 4) == (1, [2, 3])
    with pytest.raises(ValueError, match="in no group"):
        find_group([[0, 1]], 0, 3)
    with pytest.raises(ValueError, match="groups\\[0\\] and groups\\[1\\]"):
        find_group([[0, 1], [1, 2]], 0, 3)
    with pytest.raises(ValueError, match="outside"):
        find_group([[0, 5]], 0, 2)
    with pytest.raises(ValueError, match="empty"):
        find_group([[], [0]], 0, 1)


def test_enums_accept_strings_and_list_valid_values() -> None:
    assert CommunicatorType("pynccl") is CommunicatorType.PYNCCL
    assert CommunicatorType("PYNCCL") is CommunicatorType.PYNCCL
    assert str(CoordinatorType.TORCH_DISTRIBUTED) == "torch_distributed"
    with pytest.raises(ValueError, match="valid values: 'torch_distributed', 'pynccl', 'nixl_rdt'"):
        CommunicatorType("infiniband")


def test_get_class_accepts_enum_or_name() -> None:
    cls = get_communicator_class(CommunicatorType.TORCH_DISTRIBUTED)
    assert get_communicator_class("torch_distributed") is cls
    assert get_coordinator_class("torch_distributed").__name__ == "TorchDistributedCoordinator"
    assert get_launcher_class(LauncherType.MP) is MPLauncher
    with pytest.raises(ValueError, match="unknown communicator 'nope'; known: .*torch_distributed"):
        get_communicator_class("nope")
    with pytest.raises(TypeError, match="not a CommunicatorType"):
        get_communicator_class(LauncherType.MP)  # type: ignore[arg-type]


def test_register_rejects_duplicates_and_non_classes() -> None:
    class Dummy(DistributedTask):
        def run(self, **_: Any) -> None:
            return None

    with pytest.raises(ValueError, match="already registered.*override=True"):
        register_communicator("torch_distributed", "x.y:Z")
    with pytest.raises(TypeError, match="subclass of DeviceCommunicator"):
        register_communicator("dummy_bad", Dummy)
    with pytest.raises(ValueError, match="module:Class"):
        register_launcher("bad_path", "no_colon_here")
    register_communicator("lazy_missing", "not_a_real_module_xyz:Comm", override=True)
    with pytest.raises(ImportError, match="not_a_real_module_xyz"):
        get_communicator_class("lazy_missing")


def test_missing_optional_package_names_the_install(tmp_path) -> None:
    code = (
        "import sys; sys.modules['nixl'] = None; sys.modules['nixl._api'] = None\n"
        "import vllm_dist\n"
        "assert 'ray' not in sys.modules and 'nixl' not in [m for m in sys.modules if sys.modules[m]]\n"
        "try:\n"
        "    cls = vllm_dist.get_communicator_class('nixl_rdt')\n"
        "    print('ERR', cls.unavailable_reason('cpu'))\n"
        "except vllm_dist.BackendUnavailableError as e:\n"
        "    print('ERR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "ERR" in out.stdout, out.stderr
    assert "pip install 'vllm_dist[nixl]'" in out.stdout


def test_importing_vllm_dist_loads_no_heavy_backend() -> None:
    code = (
        "import sys, vllm_dist\n"
        "heavy = [m for m in ('ray', 'nixl', 'torch.cuda', 'torch') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


class NeedsReadTask(GlobalCoordinatorDistributedTask):
    required_ops = frozenset({CommOp.READ})

    def post_init_distributed(self, **_: Any) -> None:
        raise AssertionError("must be refused at set-up")


def test_missing_operation_is_refused_at_setup() -> None:
    with pytest.raises(
        UnsupportedOperationError, match="does not support read; communicators that do: .*nixl_rdt"
    ):
        registry.require_ops("torch_distributed", NeedsReadTask.required_ops)
    with pytest.raises(LaunchError, match="UnsupportedOperationError"):
        MPLauncher(1, timeout=60).launch(
            task_type=NeedsReadTask,
            coordinator_type="torch_distributed",
            communicator_type="torch_distributed",
        )


def test_parse_size() -> None:
    assert parse_size("1KiB") == 1024
    assert parse_size("64MiB") == 64 << 20
    assert parse_size("4096") == 4096
    with pytest.raises(Exception, match="not a size"):
        parse_size("lots")


@distributed_test(timeout=120)
def test_cli_main_job(capsys) -> None:
    rc = cli_main(["run", "all-reduce", "--world-size", "2", "--size", "1MiB", "--iters", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "every rank holds 3 (verified)" in out
    assert "busbw" in out


@distributed_test(timeout=180)
def test_cli_weight_transfer_demo(capsys) -> None:
    rc = cli_main(
        ["run", "weight-transfer", "--producers", "1", "--consumers", "2", "--syncs", "2"]
    )
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "verified           True" in out


@distributed_test(timeout=180)
def test_cli_weight_transfer_demo_nixl(capsys) -> None:
    pytest.importorskip("nixl", reason="needs the nixl package (pip install 'vllm_dist[nixl]')")
    argv = ["run", "weight-transfer", "--consumers", "2", "--syncs", "4"]
    rc = cli_main([*argv, "--communicator", "nixl_rdt"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "verified           True" in out and "path               read" in out
    assert "replayed           False, True, True, True" in out  # sync 1 read from the arena


def test_cli_unknown_backend_is_a_clear_error(capsys) -> None:
    rc = cli_main(["run", "all-reduce", "--communicator", "carrier_pigeon"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "unknown communicator 'carrier_pigeon'; known:" in err


def test_cli_info(capsys) -> None:
    assert cli_main(["info"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "cloudpickle" in out
    assert "communicator torch_distributed" in out
    assert "pynccl" in out
