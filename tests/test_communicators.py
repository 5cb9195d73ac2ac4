"""The conformance suite over every built-in backend, and over a plugin registered here."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from tests.utils import cuda_device_count
from vllm_dist import (
    CommOp,
    CommunicatorType,
    CoordinatorType,
    GlobalCoordinatorDistributedTask,
    MPLauncher,
    register_communicator,
)
from vllm_dist.implementations.communicators.torch_distributed import (
    TorchDistributedCommunicator,
)
from vllm_dist.testing import CommunicatorConformance


class TestTorchDistributedCPU(CommunicatorConformance):
    backend = "torch_distributed"
    device = "cpu"


def _gpu_world_sizes() -> list[int]:
    """1 and 2 ranks always (2 share one GPU through ``nccl_env``); more when the GPUs exist."""
    return [n for n in (1, 2, 4, 8) if n <= max(2, cuda_device_count())]


@pytest.mark.gpu
@pytest.mark.skipif(cuda_device_count() < 1, reason="needs a CUDA device")
class TestTorchDistributedCUDA(CommunicatorConformance):
    backend = "torch_distributed"
    device = "cuda"

    @pytest.fixture(params=_gpu_world_sizes(), ids=lambda n: f"world{n}")
    def world_size(self, request: pytest.FixtureRequest) -> int:
        return int(request.param)


class TestNixlRdtCPU(CommunicatorConformance):
    """Point-to-point over NIXL agents; its collectives must be refused, naming other backends."""

    backend = "nixl_rdt"
    device = "cpu"

    @pytest.fixture(params=[2], ids=lambda n: f"world{n}")
    def world_size(self, request: pytest.FixtureRequest) -> int:
        return int(request.param)


@pytest.mark.gpu
@pytest.mark.skipif(cuda_device_count() < 1, reason="needs a CUDA device")
class TestPyNcclCUDA(CommunicatorConformance):
    backend = "pynccl"
    device = "cuda"

    @pytest.fixture(params=_gpu_world_sizes(), ids=lambda n: f"world{n}")
    def world_size(self, request: pytest.FixtureRequest) -> int:
        return int(request.param)


class CountingCommunicator(TorchDistributedCommunicator):
    """A plugin from a test module: counts its all-reduces, and stamps its results."""

    calls = 0

    def all_reduce(self, tensor_in, tensor_out=None, op="sum"):  # type: ignore[no-untyped-def]
        type(self).calls += 1
        return super().all_reduce(tensor_in, tensor_out, op)


register_communicator("test_counting", CountingCommunicator, override=True)


class TestPluginFromTestModule(CommunicatorConformance):
    """A communicator registered in the parent only; spawned workers must see it."""

    backend = "test_counting"
    device = "cpu"

    @pytest.fixture(params=[2], ids=lambda n: f"world{n}")
    def world_size(self, request: pytest.FixtureRequest) -> int:
        return int(request.param)


def test_supported_ops_declared() -> None:
    assert CommOp.ALL_REDUCE in TorchDistributedCommunicator.supported_ops
    assert CommOp.READ not in TorchDistributedCommunicator.supported_ops
    assert torch.device("cpu").type == "cpu"


class _UnmatchedRecv(GlobalCoordinatorDistributedTask):
    """Rank 1 posts a receive that rank 0 never matches."""

    def post_init_distributed(self, **_: Any) -> str:
        comm: Any = self.communicator
        outcome = "sender"
        if self.coordinator.get_rank() == 1:
            start = time.monotonic()
            try:
                comm.irecv(torch.zeros(4), 0).wait(0.5)
                outcome = "completed"
            except TimeoutError as exc:
                outcome = f"TimeoutError after {time.monotonic() - start:.1f} s: {exc}"
        self.coordinator.barrier()
        return outcome


def test_posted_recv_times_out_as_timeout_error() -> None:
    """gloo raises a RuntimeError when a posted receive times out; the communicator hands the
    caller a ``TimeoutError`` (what the stall checks catch), within the timeout given."""
    results = MPLauncher(2, timeout=60).launch(
        task_type=_UnmatchedRecv,
        coordinator_type=CoordinatorType.TORCH_DISTRIBUTED,
        communicator_type=CommunicatorType.TORCH_DISTRIBUTED,
        device="cpu",
    )
    assert results[0] == "sender"
    assert results[1].startswith("TimeoutError after 0."), results[1]
    assert "within 0.5 s" in results[1]
