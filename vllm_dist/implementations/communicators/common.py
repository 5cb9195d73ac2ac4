"""Checks every communicator makes before a backend sees a tensor, and device defaults.

The copy engine and arenas that lived here are in ``vllm_dist.memory``; the names other code
still imports from here are re-exported (and, for the bookkeeping, shimmed) at the bottom.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence

import torch

from vllm_dist.interfaces import WorkerCoordinator
from vllm_dist.memory import (
    DEVICE_ARENA_BYTES,
    SHM_SPARE_BYTES,
    SOLO_COPY_BYTES,
    ArenaMap,
    IndexedCopy,
    RowGather,
    StreamPool,
    balance,
    batched_copy,
    shared_empty,
    widest_views,
)
from vllm_dist.memory import CopyProgram as _MemoryCopyProgram
from vllm_dist.memory import gather_device_storages as _gather_device_storages
from vllm_dist.memory import share_storages as _share_storages


def default_device(
    coordinator: WorkerCoordinator, device: torch.device | str | None
) -> torch.device:
    """``device`` as a torch.device; None means ``cuda:<local rank>`` with CUDA, else CPU."""
    if device is not None:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", coordinator.get_local_rank() % max(1, _cuda_count()))
        return dev
    if _cuda_count() > 0:
        return torch.device("cuda", coordinator.get_local_rank() % _cuda_count())
    return torch.device("cpu")


def _cuda_count() -> int:
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


# --- shim: removed once callers pass their own ------------------------------------------------
# The names below keep today's call signatures for the callers that do not yet own an
# ``ArenaMap`` / ``StreamPool``: they use one process default of each.

_DEFAULT_ARENAS = ArenaMap()  # shim: removed once callers pass their own
_DEFAULT_STREAMS = StreamPool()  # shim: removed once callers pass their own


def share_storages(tensors: Iterable[torch.Tensor], *, min_bytes: int = 0) -> int:
    """``vllm_dist.memory.share_storages`` into the process default ``ArenaMap`` (shim)."""
    return _share_storages(tensors, arenas=_DEFAULT_ARENAS, min_bytes=min_bytes)


def gather_device_storages(
    tensors: Iterable[torch.Tensor],
    *,
    max_bytes: int,
    arena_bytes: int = DEVICE_ARENA_BYTES,
    device: torch.device | str | None = None,
) -> int:
    """``vllm_dist.memory.gather_device_storages`` into the process default ``ArenaMap``
    (shim)."""
    return _gather_device_storages(
        tensors,
        arenas=_DEFAULT_ARENAS,
        max_bytes=max_bytes,
        arena_bytes=arena_bytes,
        device=device,
    )


def arena_range(address: int) -> tuple[int, int] | None:
    """``ArenaMap.range_of`` of the process default map (shim)."""
    return _DEFAULT_ARENAS.range_of(address)


def shared_arena(address: int) -> torch.Tensor | None:
    """``ArenaMap.shared`` of the process default map (shim)."""
    return _DEFAULT_ARENAS.shared(address)


class CopyProgram(_MemoryCopyProgram):
    """``vllm_dist.memory.CopyProgram`` taking ``graph=`` as before: a graph records on the
    process default ``StreamPool`` (shim)."""

    def __init__(
        self,
        dsts: list[torch.Tensor],
        srcs: list[torch.Tensor],
        *,
        graph: bool = True,
        staging: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        streams = _DEFAULT_STREAMS if graph else None
        super().__init__(dsts, srcs, streams=streams, staging=staging)

    @classmethod
    def merged(  # type: ignore[override]
        cls, programs: Sequence[_MemoryCopyProgram], *, graph: bool = True
    ) -> CopyProgram:
        return super().merged(programs, streams=_DEFAULT_STREAMS if graph else None)


__all__ = [
    "DEVICE_ARENA_BYTES",
    "SHM_SPARE_BYTES",
    "SOLO_COPY_BYTES",
    "CopyProgram",
    "IndexedCopy",
    "RowGather",
    "arena_range",
    "balance",
    "batched_copy",
    "check_out",
    "check_same",
    "check_tensor",
    "default_device",
    "gather_device_storages",
    "gathered_shape",
    "scattered_shape",
    "share_storages",
    "shared_arena",
    "shared_empty",
    "shared_gpu_nccl_env",
    "widest_views",
]
