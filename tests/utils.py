"""The one way to mark a distributed or GPU test (STYLE.md 10), and small shared helpers.

``distributed_test(gpus=N, timeout=S)`` skips without initialising CUDA when fewer than N GPUs are
present, marks the test ``gpu`` when N > 0, and bounds it with a timeout. Workers always come
from a vllm_dist launcher, which picks free ports; no test uses a fixed port.
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


def distributed_test(*, gpus: int = 0, timeout: float = 120) -> Callable[[F], F]:
    """Mark a test that starts workers: bounded by ``timeout``; needs ``gpus`` CUDA devices."""

    def wrap(fn: F) -> F:
        fn = pytest.mark.timeout(timeout)(fn)
        if gpus > 0:
            fn = pytest.mark.gpu(fn)
            fn = pytest.mark.skipif(
                cuda_device_count() < gpus,
                reason=f"needs {gpus} CUDA device(s), found {cuda_device_count()}",
            )(fn)
        return fn

    return wrap


def device_for(gpus: int) -> str:
    return "cuda" if gpus > 0 else "cpu"
