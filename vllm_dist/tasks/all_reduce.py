"""An all-reduce task that checks its result and times itself: the CLI's main job."""

from __future__ import annotations

import time
from typing import Any, ClassVar

import torch

from vllm_dist.interfaces import CommOp
from vllm_dist.tasks.base import GlobalCoordinatorDistributedTask

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class AllReduceBenchTask(GlobalCoordinatorDistributedTask):
    """Sum a tensor of ``size_bytes`` over the world, verify it, and time ``iters`` calls.

    Every rank fills its tensor with ``rank + 1``; the sum must be ``W (W + 1) / 2`` everywhere.
    Returns per-rank facts: rank, device, backend details, verified flag, median seconds per call.
    """

    required_ops: ClassVar[frozenset[CommOp]] = frozenset({CommOp.ALL_REDUCE})

    def post_init_distributed(
        self,
        size_bytes: int = 64 << 20,
        iters: int = 10,
        warmup: int = 3,
        dtype: str = "float32",
        **_: Any,
    ) -> dict[str, Any]:
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}")
        torch_dtype = _DTYPES[dtype]
        numel = max(1, size_bytes // torch_dtype.itemsize)
        world = self.coordinator.get_world_size()
        rank = self.coordinator.get_rank()
        tensor = torch.full((numel,), float(rank + 1), dtype=torch_dtype, device=self.device)
        self.communicator.all_reduce(tensor_in=tensor)
        expected = world * (world + 1) / 2
        verified = bool(torch.all(tensor == expected).item())
        times = []
        for i in range(warmup + iters):
            self._sync()
            start = time.perf_counter()
            self.communicator.all_reduce(tensor_in=tensor)
            self._sync()
            if i >= warmup:
                times.append(time.perf_counter() - start)
        times.sort()
        return {
            "rank": rank,
            "world_size": world,
            "device": str(self.device),
            "backend": self.communicator.describe(),
            "bytes": numel * torch_dtype.itemsize,
            "verified": verified,
            "expected": expected,
            "median_s": times[len(times) // 2] if times else 0.0,
        }

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
