"""TorchDistributedCommunicator: collectives through torch.distributed (NCCL on CUDA, gloo on CPU).

It makes its own process group over the coordinator's members (``use_local_synchronization`` so
that groups are built independently), keeping data traffic off the coordinator's control group.
Needs a ``TorchDistributedCoordinator``: both live in one torch.distributed world.

Reductions give NCCL's results on every backend: gloo has no AVG, so it sums and divides, and
integer AVG rounds the sum's quotient toward zero as ``ncclAvg`` does. A dtype outside
``REDUCE_DTYPES`` is refused before any tensor is touched, on both backends (rejected
alternative: let gloo raise mid-way, which can leave a sum in the caller's tensor).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from vllm_dist.implementations.communicators.common import (
    check_out,
    check_tensor,
    default_device,
    gathered_shape,
    scattered_shape,
)
from vllm_dist.implementations.coordinators.torch_distributed import (
    TorchDistributedCoordinator,
    new_torch_group,
)
from vllm_dist.interfaces import CommOp, DeviceCommunicator, ReduceOp, WorkerCoordinator

# the dtypes each backend reduces with every ReduceOp (the conformance suite checks each)
REDUCE_DTYPES = frozenset(
    {
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.int8,
        torch.uint8,
        torch.int32,
        torch.int64,
    }
)

_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
}


class PendingTransfer:
    """A started ``isend`` / ``irecv``. ``wait(timeout)`` returns True once it completed
    (on CUDA: once it is ordered before later work on the current stream) and raises
    ``TimeoutError`` when it did not complete in ``timeout`` seconds; gloo then closes the
    connection to that peer, so a timed-out transfer ends the communicator's use."""

    def __init__(self, work: Any, what: str) -> None:
        self._work = work
        self._what = what

    def wait(self, timeout: float | None = None) -> bool:
        try:
            if timeout is None:
                self._work.wait()
            else:
                self._work.wait(timedelta(seconds=timeout))
        except RuntimeError as exc:
            if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
                raise TimeoutError(f"{self._what} did not complete within {timeout} s") from exc
            raise
        return True


class TorchDistributedCommunicator(DeviceCommunicator):
    """torch.distributed collectives on the coordinator's members.

    Args:
        coordinator: an initialized ``TorchDistributedCoordinator``.
        device: where tensors live; None = ``cuda:<local rank>`` with CUDA, else CPU.
    """

    supported_ops: ClassVar[frozenset[CommOp]] = frozenset(
        {
            CommOp.ALL_REDUCE,
            CommOp.ALL_GATHER,
            CommOp.REDUCE_SCATTER,
            CommOp.BROADCAST,
            CommOp.SEND,
            CommOp.RECV,
        }
    )

    def __init__(
        self, coordinator: WorkerCoordinator, device: torch.device | str | None = None
    ) -> None:
        if not isinstance(coordinator, TorchDistributedCoordinator):
            raise TypeError(
                "TorchDistributedCommunicator runs on a TorchDistributedCoordinator "
                f"(CoordinatorType.TORCH_DISTRIBUTED), got {type(coordinator).__name__}"
            )
        self._coord = coordinator
        self._device = default_device(coordinator, device)
        self._world = coordinator.get_world_size()
        self._rank = coordinator.get_rank()
        self._backend = "nccl" if self._device.type == "cuda" else "gloo"
        if self._backend == "nccl":
            if not dist.is_nccl_available():
                raise RuntimeError("this torch build has no NCCL; use a CUDA build of torch")
            torch.cuda.set_device(self._device)
        self._group: dist.ProcessGroup | None = new_torch_group(
            coordinator.get_global_ranks(),
            self._backend,
            coordinator.timeout,
            device_id=self._device if self._backend == "nccl" else None,
            bind_host=coordinator.bind_host,  # gloo listens where its coordinator does
        )

    @property
    def device(self) -> torch.device:
        return self._device

    @classmethod
    def unavailable_reason(cls, device_type: str) -> str | None:
        if device_type == "cpu":
            return None if dist.is_gloo_available() else "this torch build has no gloo"
        if device_type != "cuda":
            return f"moves cpu or cuda memory, not {device_type!r}"
        if not torch.cuda.is_available():
            return f"this torch build ({torch.__version__}) or machine has no CUDA device"
        if not dist.is_nccl_available():
            return "this torch build has no NCCL; install a CUDA build of torch"
        return None

    @property
    def reduce_dtypes(self) -> frozenset[torch.dtype]:
        """The dtypes all_reduce / reduce_scatter reduce, with every ``ReduceOp`` and the same
        results on gloo and NCCL; others are refused before any tensor is touched."""
        return REDUCE_DTYPES

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The data-plane group, for comparing against raw torch.distributed calls."""
        return self._require()

    def all_reduce(
        self,
        tensor_in: torch.Tensor,
        tensor_out: torch.Tensor | None = None,
        op: ReduceOp = ReduceOp.SUM,
    ) -> torch.Tensor:
        check_tensor(tensor_in, self._device, "tensor_in")
        if tensor_in.dtype not in REDUCE_DTYPES:
            self._refuse_dtype(tensor_in.dtype)
        target = tensor_in
        if tensor_out is not None:
            check_out(tensor_out, tuple(tensor_in.shape), tensor_in, self._device)
            tensor_out.copy_(tensor_in)
            target = tensor_out
        self._reduce_in_place(target, op)
        return target

    def all_gather(
        self, tensor_in: torch.Tensor, tensor_out: torch.Tensor | None = None
    ) -> torch.Tensor:
        check_tensor(tensor_in, self._device, "tensor_in")
        shape = gathered_shape(tensor_in, self._world)
        if tensor_out is None:
            tensor_out = torch.empty(shape, dtype=tensor_in.dtype, device=self._device)
        else:
            check_out(tensor_out, shape, tensor_in, self._device)
        dist.all_gather_into_tensor(tensor_out, tensor_in, group=self._require())
        return tensor_out

    def reduce_scatter(
        self,
        tensor_in: torch.Tensor,
        tensor_out: torch.Tensor | None = None,
        op: ReduceOp = ReduceOp.SUM,
    ) -> torch.Tensor:
        check_tensor(tensor_in, self._device, "tensor_in")
        if tensor_in.dtype not in REDUCE_DTYPES:
            self._refuse_dtype(tensor_in.dtype)
        shape = scattered_shape(tensor_in, self._world)
        if tensor_out is None:
            tensor_out = torch.empty(shape, dtype=tensor_in.dtype, device=self._device)
        else:
            check_out(tensor_out, shape, tensor_in, self._device)
        if self._backend == "nccl":
            dist.reduce_scatter_tensor(
                tensor_out, tensor_in, op=self._torch_op(op), group=self._require()
            )
        else:  # gloo has no reduce-scatter: reduce a copy, keep our slice
            full = tensor_in.clone()
            self._reduce_in_place(full, op)
            tensor_out.copy_(full.chunk(self._world)[self._rank])
        return tensor_out

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        check_tensor(tensor, self._device)
        self._check_peer(src, allow_self=True)
        dist.broadcast(tensor, group_src=src, group=self._require())
        return tensor

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        check_tensor(tensor, self._device)
        self._check_peer(dst)
        dist.send(tensor, group_dst=dst, group=self._require())

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        check_tensor(tensor, self._device)
        self._check_peer(src)
        dist.recv(tensor, group_src=src, group=self._require())
        return tensor

    def isend(self, tensor: torch.Tensor, dst: int) -> PendingTransfer:
        """Start sending ``tensor`` to ``dst``; leave ``tensor`` alone until ``wait`` is True."""
        check_tensor(tensor, self._device)
        self._check_peer(dst)
        return PendingTransfer(dist.isend(tensor, group_dst=dst, group=self._require()), "send")

    def irecv(self, tensor: torch.Tensor, src: int) -> PendingTransfer:
        """Post a receive into ``tensor`` from ``src`` (matched in posting order per peer);
        read ``tensor`` once ``wait`` is True."""
        check_tensor(tensor, self._device)
        self._check_peer(src)
        return PendingTransfer(dist.irecv(tensor, group_src=src, group=self._require()), "recv")

    def close(self) -> None:
        group, self._group = self._group, None
        if group is not None and dist.is_initialized():
            dist.destroy_process_group(group)

    def describe(self) -> dict[str, Any]:
        facts: dict[str, Any] = {"backend": self._backend, "torch": torch.__version__}
        if self._backend == "nccl":
            facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        return facts

    # -- helpers -----------------------------------------------------------------------------
    def _reduce_in_place(self, tensor: torch.Tensor, op: ReduceOp) -> None:
        group = self._require()
        if type(op) is not ReduceOp:  # the enum call costs ~0.7 us; skip it on the hot path
            op = ReduceOp(op)
        if op is ReduceOp.AVG and self._backend == "nccl":
            dist.all_reduce(tensor, op=dist.ReduceOp.AVG, group=group)
        elif op is ReduceOp.AVG:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
            if tensor.is_floating_point():
                tensor.div_(self._world)
            else:  # ncclAvg on integers: C division of the sum, rounding toward zero
                tensor.div_(self._world, rounding_mode="trunc")
        else:
            dist.all_reduce(tensor, op=self._torch_op(op), group=group)

    def _torch_op(self, op: ReduceOp) -> Any:
        op = ReduceOp(op)
        if op is ReduceOp.AVG:
            if self._backend != "nccl":
                raise ValueError("gloo has no AVG reduce-scatter; use SUM and divide")
            return dist.ReduceOp.AVG
        return _TORCH_OPS[op]

    def _refuse_dtype(self, dtype: torch.dtype) -> None:
        names = ", ".join(sorted(str(d).removeprefix("torch.") for d in REDUCE_DTYPES))
        raise ValueError(
            f"{self._backend} here reduces {names}, not {dtype}; cast the tensor (e.g. "
            ".float()) before the reduction. Data movement (all_gather, broadcast, "
            "send/recv) takes any dtype"
        )

    def _check_peer(self, peer: int, allow_self: bool = False) -> None:
        if not 0 <= peer < self._world:
            raise ValueError(f"rank {peer} is outside this group of {self._world}")
        if peer == self._rank and not allow_self:
            raise ValueError(f"rank {peer} is this worker itself; send/recv need another rank")

    def _require(self) -> dist.ProcessGroup:
        if self._group is None:
            raise RuntimeError("this communicator is closed")
        return self._group
