"""The conformance suite over every built-in backend, and over a plugin registered here."""

from __future__ import annotations

import pytest
import torch

from tests.conformance import CommunicatorConformance
from tests.utils import cuda_device_count
from vllm_dist import CommOp, register_communicator
from vllm_dist.implementations.communicators.torch_distributed import (
    TorchDistributedCommunicator,
)


class TestTorchDistributedCPU(CommunicatorConformance):
    backend = "torch_distributed"
    device = "cpu"


def _gpu_world_sizes() -> list[int]:
    return [n for n in (1, 2, 4, 8) if n == 1 or n <= max(1, cuda_device_count())]


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
