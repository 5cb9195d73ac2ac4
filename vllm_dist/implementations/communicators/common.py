"""Checks every communicator makes before a backend sees a tensor, and device defaults.

Copies and storage arenas are backend-free and live in ``vllm_dist.memory``.
"""

from __future__ import annotations

import os

import torch

from vllm_dist.interfaces import ReduceOp, WorkerCoordinator


def default_device(
    coordinator: WorkerCoordinator, device: torch.device | str | None
) -> torch.device:
    """``device`` as a torch.device; None means ``cuda:<local rank>`` with CUDA, else CPU."""
    if device is not None:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", coordinator.get_local_rank() % max(1, cuda_device_count()))
        return dev
    if cuda_device_count() > 0:
        return torch.device("cuda", coordinator.get_local_rank() % cuda_device_count())
    return torch.device("cpu")


def cuda_device_count() -> int:
    """CUDA devices visible here (0 with ``CUDA_VISIBLE_DEVICES=""`` or no driver)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def shared_gpu_nccl_env(tag: str = "") -> dict[str, str]:
    """``MPLauncher`` ``env`` under which NCCL ranks may share GPUs (development and tests).

    NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected"). Each rank
    here names its own host (``NCCL_HOSTID``), so NCCL takes the ranks for separate machines
    and moves their bytes through its socket transport on loopback: the real NCCL, at socket
    speed. Launches that join one fleet pass different ``tag``s.
    """
    return {
        "NCCL_HOSTID": f"vllm-dist-{tag}-" + "{rank}",
        "NCCL_SOCKET_IFNAME": "lo",
        "NCCL_IB_DISABLE": "1",
        "NCCL_MNNVL_ENABLE": "0",
        "NCCL_NVLS_ENABLE": "0",
    }


def check_tensor(
    tensor: torch.Tensor, device: torch.device, what: str = "tensor", *, contiguous: bool = True
) -> None:
    """Raise ``ValueError`` for a tensor on the wrong device or (``contiguous``) not contiguous."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device != device:
        raise ValueError(
            f"{what} is on {tensor.device} but this communicator moves {device} memory; "
            f"move it with .to({str(device)!r})"
        )
    if contiguous and not tensor.is_contiguous():
        raise ValueError(f"{what} is not contiguous; pass tensor.contiguous()")


def check_same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if a.dtype != b.dtype:
        raise ValueError(f"{what}: dtype {b.dtype} does not match {a.dtype}")


def gathered_shape(tensor: torch.Tensor, world_size: int) -> tuple[int, ...]:
    if tensor.dim() == 0:
        raise ValueError("all_gather needs a tensor with at least one dimension")
    return (tensor.shape[0] * world_size, *tensor.shape[1:])


def scattered_shape(tensor: torch.Tensor, world_size: int) -> tuple[int, ...]:
    if tensor.dim() == 0 or tensor.shape[0] % world_size:
        raise ValueError(
            f"reduce_scatter needs dim 0 divisible by the world size {world_size}, "
            f"got shape {tuple(tensor.shape)}"
        )
    return (tensor.shape[0] // world_size, *tensor.shape[1:])


def check_out(
    out: torch.Tensor, shape: tuple[int, ...], ref: torch.Tensor, device: torch.device
) -> None:
    check_tensor(out, device, "tensor_out")
    check_same(ref, out, "tensor_out")
    if tuple(out.shape) != shape:
        raise ValueError(f"tensor_out has shape {tuple(out.shape)}, expected {shape}")


class SendRecvOnly:
    """The collectives of a communicator that only sends and receives (a group per peer):
    each one refused, naming the class. Mixed in ahead of ``DeviceCommunicator``."""

    def _unsupported(self, op: str) -> Exception:
        return NotImplementedError(f"{type(self).__name__} has no {op}: it only sends and receives")

    def all_reduce(
        self,
        tensor_in: torch.Tensor,
        tensor_out: torch.Tensor | None = None,
        op: ReduceOp = ReduceOp.SUM,
    ) -> torch.Tensor:
        raise self._unsupported("all_reduce")

    def all_gather(
        self, tensor_in: torch.Tensor, tensor_out: torch.Tensor | None = None
    ) -> torch.Tensor:
        raise self._unsupported("all_gather")

    def reduce_scatter(
        self,
        tensor_in: torch.Tensor,
        tensor_out: torch.Tensor | None = None,
        op: ReduceOp = ReduceOp.SUM,
    ) -> torch.Tensor:
        raise self._unsupported("reduce_scatter")

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        raise self._unsupported("broadcast")
