"""The one way to mark a distributed or GPU test (STYLE.md 10), and small shared helpers.

``distributed_test(gpus=N, timeout=S)`` skips without initialising CUDA when fewer than N GPUs are
present, marks the test ``gpu`` when N > 0, and bounds it with a timeout. Workers always come
from a vllm_dist launcher, which picks free ports; no test uses a fixed port.

NCCL refuses two ranks on one GPU ("Duplicate GPU detected"). ``nccl_env(n)`` lets n ranks share
fewer GPUs all the same: each rank names its own host (``NCCL_HOSTID``), so NCCL takes the ranks
for separate machines and moves their bytes through its socket transport on loopback. Slow, but
the real NCCL: tests marked ``distributed_test(gpus=N, share=True)`` then run on one GPU.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

F = TypeVar("F", bound=Callable[..., Any])


@functools.cache
def cuda_device_count() -> int:
    """GPUs visible here, counted through NVML so the test process never creates a context."""
    if os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return 0
    try:
        import torch

        return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - no driver means no GPU
        return 0


def distributed_test(
    *, gpus: int = 0, timeout: float = 120, share: bool = False
) -> Callable[[F], F]:
    """Mark a test that starts workers: bounded by ``timeout``; needs ``gpus`` CUDA devices, or
    one when ``share`` (its launches pass ``env=nccl_env(n)``)."""

    def wrap(fn: F) -> F:
        fn = pytest.mark.timeout(timeout)(fn)
        if gpus > 0:
            need = 1 if share else gpus
            fn = pytest.mark.gpu(fn)
            fn = pytest.mark.skipif(
                cuda_device_count() < need,
                reason=f"needs {need} CUDA device(s), found {cuda_device_count()}",
            )(fn)
        return fn

    return wrap


def nccl_env(ranks: int, tag: str = "") -> dict[str, str]:
    """Launcher ``env`` that lets ``ranks`` NCCL ranks share this machine's GPUs
    (``shared_gpu_nccl_env``); empty when each rank has a GPU of its own."""
    from vllm_dist.implementations.communicators.common import shared_gpu_nccl_env

    return {} if ranks <= cuda_device_count() else shared_gpu_nccl_env(tag)
