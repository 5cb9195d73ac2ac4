"""Checks every communicator makes before a backend sees a tensor, and device defaults."""

from __future__ import annotations

import os

import torch

from vllm_dist.interfaces import WorkerCoordinator


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


def widest_views(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``dst`` and ``src`` viewed as the widest integer type both layouts allow, for a bitwise
    copy: a strided copy kernel moves one element per thread and does not vectorize, so eight
    bytes per element instead of two makes a row-strided bf16 copy about as fast as a
    contiguous one. Contiguous pairs are left alone (``copy_`` is a memcpy for them)."""
    item = dst.element_size()
    if (
        dst.dim() == 0
        or (dst.is_contiguous() and src.is_contiguous())
        or dst.dtype != src.dtype
        or dst.stride(-1) != 1
        or src.stride(-1) != 1
    ):
        return dst, src
    for wide in (torch.int64, torch.int32, torch.int16):
        ratio = wide.itemsize // item
        if ratio <= 1:
            break
        if dst.shape[-1] % ratio == 0 and all(
            t.storage_offset() % ratio == 0 and all(st % ratio == 0 for st in t.stride()[:-1])
            for t in (dst, src)
        ):
            return dst.view(wide), src.view(wide)
    return dst, src


def batched_copy(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for every pair, in as few launches as the layouts allow.

    ``torch._foreach_copy_`` takes its batched path only when every tensor of the lists is
    contiguous; one strided pair sends the whole list down one kernel per pair (100,000 small
    experts: seconds). So contiguous pairs go in one batched launch, and the strided rest,
    widened (``widest_views``), one by one.
    """
    fast: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    slow: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    for d, s in zip(dsts, srcs, strict=True):
        if d.is_contiguous() and s.is_contiguous():
            fast[0].append(d)
            fast[1].append(s)
        else:
            d, s = widest_views(d, s)
            slow[0].append(d)
            slow[1].append(s)
    for pair in (fast, slow):
        if pair[0]:
            torch._foreach_copy_(*pair)
