"""PyNcclCommunicator: collectives on CUDA memory by calling libnccl directly through ctypes.

Group rank 0 makes NCCL's 128-byte unique id and shares it with ``coordinator.broadcast_object``;
every member then joins with ``ncclCommInitRank``. Each operation validates its tensors in Python
(so a wrong device or shape is a ``ValueError``, never an NCCL crash), then enqueues one NCCL call
on the current CUDA stream, or on the ``stream=`` given. Nothing on the operation path
synchronizes, reads device memory or makes host tensors, so operations can be captured into a
CUDA graph and replayed.

Data-movement operations (all-gather, broadcast, send / recv) move any dtype: a dtype NCCL does
not know travels as bytes. Reductions need a dtype NCCL reduces (``library.nccl_dtype``).

Rejected alternative: a ``torch.distributed`` process group with the NCCL backend (the
TORCH_DISTRIBUTED communicator). It links torch's own NCCL, adds a work object and watchdog
bookkeeping per call, and cannot be driven on an arbitrary stream; this backend exists to avoid
exactly those costs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import torch

from vllm_dist.implementations.communicators.common import (
    check_out,
    check_tensor,
    default_device,
    gathered_shape,
    scattered_shape,
)
from vllm_dist.implementations.communicators.pynccl.library import (
    NcclDataType,
    NcclLibrary,
    NcclLibraryError,
    NcclRedOp,
    load_nccl,
    nccl_dtype,
    nccl_red_op,
    torch_dtype_table,
)
from vllm_dist.interfaces import (
    BackendUnavailableError,
    CommOp,
    DeviceCommunicator,
    ReduceOp,
    WorkerCoordinator,
)


class PyNcclCommunicator(DeviceCommunicator):
    """NCCL collectives among the members of ``coordinator``, one CUDA device per member.

    Every member of the coordinator's group constructs one, in the same order as any other
    collective. Every operation takes a keyword ``stream`` (a ``torch.cuda.Stream`` on this
    device; default: the current stream) and returns without waiting for the GPU. As with any
    side stream in torch, the caller orders the inputs' producers before a given ``stream``
    (``stream.wait_stream(...)``); outputs this class allocates are recorded on it.

    Args:
        coordinator: any initialized ``WorkerCoordinator``; it carries the unique id.
        device: a CUDA device; None or ``"cuda"`` = ``cuda:<local rank>``. It becomes the
            current CUDA device of this process, as NCCL binds the communicator to it.
        library_path: a libnccl to load instead of searching (see ``library.load_nccl``).

    Raises:
        ValueError: ``device`` is not a visible CUDA device.
        BackendUnavailableError: no CUDA here, or no libnccl could be loaded (the message names
            the package to install or the variable to set).
        NcclError: ``ncclCommInitRank`` failed.
    """

    supported_ops: ClassVar[frozenset[CommOp]] = frozenset(
        {
            CommOp.ALL_REDUCE,
            CommOp.ALL_GATHER,
            CommOp.REDUCE_SCATTER,
            CommOp.BROADCAST,
            CommOp.SEND,
            CommOp.RECV,
            CommOp.CUDA_GRAPH,
        }
    )

    def __init__(
        self,
        coordinator: WorkerCoordinator,
        device: torch.device | str | None = None,
        library_path: str | None = None,
    ) -> None:
        self._comm: int | None = None  # first, so that close() works after a failed __init__
        self._device = _cuda_device(coordinator, device)
        self._lib: NcclLibrary = load_nccl(library_path)
        self._rank = coordinator.get_rank()
        self._world = coordinator.get_world_size()
        self._dtypes = torch_dtype_table(self._lib.version)
        self._ops: dict[str, NcclRedOp] = {}

        start = time.perf_counter()
        unique_id = self._lib.get_unique_id() if self._rank == 0 else None
        unique_id = coordinator.broadcast_object(unique_id, src=0)
        torch.cuda.set_device(self._device)
        init_start = time.perf_counter()
        self._comm = self._lib.comm_init_rank(self._world, unique_id, self._rank)
        done = time.perf_counter()
        self.setup_seconds = done - start
        self.comm_init_seconds = done - init_start

    # -- facts -------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def library(self) -> NcclLibrary:
        return self._lib

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    @classmethod
    def unavailable_reason(cls, device_type: str) -> str | None:
        if device_type != "cuda":
            return (
                f"NCCL needs CUDA devices; it cannot move {device_type!r} memory. Use "
                "CommunicatorType.TORCH_DISTRIBUTED (gloo) for CPU tensors"
            )
        reasons = []
        cuda = _no_cuda_reason()
        if cuda:
            reasons.append(cuda)
        try:
            load_nccl()
        except NcclLibraryError as exc:
            reasons.append(str(exc))
        return "; ".join(reasons) or None

    def describe(self) -> dict[str, Any]:
        return {
            "backend": "pynccl",
            "nccl": self._lib.version_string,
            "library": self._lib.path,
            "library_source": self._lib.source,
            "device": str(self._device),
            "rank": self._rank,
            "world_size": self._world,
            "setup_seconds": self.setup_seconds,
            "comm_init_seconds": self.comm_init_seconds,
        }

    # -- collectives -------------------------------------------------------------------------
    def all_reduce(
        self,
        tensor_in: torch.Tensor,
        tensor_out: torch.Tensor | None = None,
        op: ReduceOp = ReduceOp.SUM,
        *,
        stream: torch.cuda.Stream | None = None,
    ) -> torch.Tensor:
        check_tensor(tensor_in, self._device, "tensor_in")
        if tensor_out is None:
            tensor_out = tensor_in
        else:
            check_out(tensor_out, tuple(tensor_in.shape), tensor_in, self._device)
        self._lib.all_reduce(
            tensor_in.data_ptr(),
            tensor_out.data_ptr(),
            tensor_in.numel(),
            self._reduce_dtype(tensor_in.dtype),
            self._red_op(op),
            self._require(),
            self._stream(stream),
        )
        return tensor_out

    def all_gather(
        self,
        tensor_in: torch.Tensor,
        tensor_out: torch.Tensor | None = None,
        *,
        stream: torch.cuda.Stream | None = None,
    ) -> torch.Tensor:
        check_tensor(tensor_in, self._device, "tensor_in")
        shape = gathered_shape(tensor_in, self._world)
        if tensor_out is None:
            tensor_out = self._empty(shape, tensor_in.dtype, stream)
        else:
            check_out(tensor_out, shape, tensor_in, self._device)
        count, dtype = self._move_args(tensor_in)
        self._lib.all_gather(
            tensor_in.data_ptr(),
            tensor_out.data_ptr(),
            count,
            dtype,
            self._require(),
            self._stream(stream),
        )
        return tensor_out

    def reduce_scatter(
        self,
        tensor_in: torch.Tensor,
        tensor_out: torch.Tensor | None = None,
        op: ReduceOp = ReduceOp.SUM,
        *,
        stream: torch.cuda.Stream | None = None,
    ) -> torch.Tensor:
        check_tensor(tensor_in, self._device, "tensor_in")
        shape = scattered_shape(tensor_in, self._world)
        if tensor_out is None:
            tensor_out = self._empty(shape, tensor_in.dtype, stream)
        else:
            check_out(tensor_out, shape, tensor_in, self._device)
        self._lib.reduce_scatter(
            tensor_in.data_ptr(),
            tensor_out.data_ptr(),
            tensor_out.numel(),
            self._reduce_dtype(tensor_in.dtype),
            self._red_op(op),
            self._require(),
            self._stream(stream),
        )
        return tensor_out

    def reduce(
        self,
        tensor_in: torch.Tensor,
        dst: int,
        tensor_out: torch.Tensor | None = None,
        op: ReduceOp = ReduceOp.SUM,
        *,
        stream: torch.cuda.Stream | None = None,
    ) -> torch.Tensor:
        """Reduce ``tensor_in`` over the group into rank ``dst`` (PyNCCL only, not in the ABC).

        In place when ``tensor_out`` is None. Only ``dst``'s result is defined.
        """
        check_tensor(tensor_in, self._device, "tensor_in")
        self._check_peer(dst, allow_self=True)
        if tensor_out is None:
            tensor_out = tensor_in
        else:
            check_out(tensor_out, tuple(tensor_in.shape), tensor_in, self._device)
        self._lib.reduce(
            tensor_in.data_ptr(),
            tensor_out.data_ptr(),
            tensor_in.numel(),
            self._reduce_dtype(tensor_in.dtype),
            self._red_op(op),
            dst,
            self._require(),
            self._stream(stream),
        )
        return tensor_out

    def broadcast(
        self, tensor: torch.Tensor, src: int, *, stream: torch.cuda.Stream | None = None
    ) -> torch.Tensor:
        check_tensor(tensor, self._device)
        self._check_peer(src, allow_self=True)
        count, dtype = self._move_args(tensor)
        ptr = tensor.data_ptr()
        self._lib.broadcast(ptr, ptr, count, dtype, src, self._require(), self._stream(stream))
        return tensor

    # -- point to point ----------------------------------------------------------------------
    def send(
        self, tensor: torch.Tensor, dst: int, *, stream: torch.cuda.Stream | None = None
    ) -> None:
        check_tensor(tensor, self._device)
        self._check_peer(dst)
        count, dtype = self._move_args(tensor)
        self._lib.send(tensor.data_ptr(), count, dtype, dst, self._require(), self._stream(stream))

    def recv(
        self, tensor: torch.Tensor, src: int, *, stream: torch.cuda.Stream | None = None
    ) -> torch.Tensor:
        check_tensor(tensor, self._device)
        self._check_peer(src)
        count, dtype = self._move_args(tensor)
        self._lib.recv(tensor.data_ptr(), count, dtype, src, self._require(), self._stream(stream))
        return tensor

    @contextlib.contextmanager
    def group(self) -> Iterator[None]:
        """Fuse the operations issued inside into one NCCL launch (``ncclGroupStart/End``).

        Needed for exchanges that would deadlock one call at a time, e.g. every rank sending to
        and receiving from its neighbours.
        """
        self._require()
        self._lib.group_start()
        try:
            yield
        finally:
            self._lib.group_end()

    # -- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        """Abort the NCCL communicator: local, so it returns even when a peer is gone.

        Operations still in flight are cancelled; synchronize the streams you used first when
        their results matter. A CUDA graph that captured this communicator's operations must not
        be replayed afterwards.
        """
        comm, self._comm = self._comm, None
        if comm is not None:
            with torch.cuda.device(self._device):
                self._lib.comm_abort(comm)

    def __enter__(self) -> PyNcclCommunicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers -----------------------------------------------------------------------------
    def _require(self) -> int:
        if self._comm is None:
            raise RuntimeError("this PyNcclCommunicator is closed; make a new one")
        return self._comm

    def _stream(self, stream: torch.cuda.Stream | None) -> int:
        if stream is None:
            return int(torch.cuda.current_stream(self._device).cuda_stream)
        if not isinstance(stream, torch.cuda.Stream):
            raise TypeError(
                f"stream must be a torch.cuda.Stream (or torch.cuda.ExternalStream), got "
                f"{type(stream).__name__}"
            )
        if stream.device != self._device:
            raise ValueError(
                f"stream is on {stream.device} but this communicator uses {self._device}; "
                f"make it with torch.cuda.Stream(device={str(self._device)!r})"
            )
        return int(stream.cuda_stream)

    def _empty(
        self, shape: tuple[int, ...], dtype: torch.dtype, stream: torch.cuda.Stream | None
    ) -> torch.Tensor:
        """An output tensor; tied to ``stream`` so the allocator won't reuse it while in use."""
        out = torch.empty(shape, dtype=dtype, device=self._device)
        if stream is not None and isinstance(stream, torch.cuda.Stream):
            out.record_stream(stream)
        return out

    def _reduce_dtype(self, dtype: torch.dtype) -> int:
        found = self._dtypes.get(dtype)
        return found if found is not None else nccl_dtype(dtype, self._lib.version)

    def _move_args(self, tensor: torch.Tensor) -> tuple[int, int]:
        return move_args(self._dtypes, tensor)

    def _red_op(self, op: ReduceOp) -> int:
        found = self._ops.get(op)
        if found is None:
            found = self._ops[op] = nccl_red_op(str(op), self._lib.version)
        return found

    def _check_peer(self, peer: int, allow_self: bool = False) -> None:
        if not isinstance(peer, int) or not 0 <= peer < self._world:
            raise ValueError(f"rank {peer!r} is outside this group of {self._world}")
        if peer == self._rank and not allow_self:
            raise ValueError(f"rank {peer} is this worker itself; send/recv need another rank")


def move_args(dtypes: Mapping[torch.dtype, NcclDataType], tensor: torch.Tensor) -> tuple[int, int]:
    """(count, NCCL type) that move ``tensor``; bytes for a dtype NCCL does not know."""
    found = dtypes.get(tensor.dtype)
    if found is None:
        return tensor.numel() * tensor.element_size(), NcclDataType.UINT8
    return tensor.numel(), found


def _cuda_device(coordinator: WorkerCoordinator, device: torch.device | str | None) -> torch.device:
    """The CUDA device to bind; raises before anything is loaded or connected."""
    reason = _no_cuda_reason()
    if device is None and reason:
        raise BackendUnavailableError(f"PyNcclCommunicator: {reason}")
    dev = default_device(coordinator, device if device is not None else "cuda")
    if dev.type != "cuda":
        raise ValueError(
            f"PyNcclCommunicator moves CUDA memory, got device {str(dev)!r}; pass device='cuda' "
            "or use CommunicatorType.TORCH_DISTRIBUTED for CPU tensors"
        )
    if reason:
        raise BackendUnavailableError(f"PyNcclCommunicator: {reason}")
    count = torch.cuda.device_count()
    assert dev.index is not None
    if dev.index >= count:
        raise ValueError(
            f"device {dev} does not exist: {count} CUDA device(s) are visible here; check "
            "CUDA_VISIBLE_DEVICES or pass device='cuda' for cuda:<local rank>"
        )
    return dev


def _no_cuda_reason() -> str | None:
    """Why CUDA cannot be used here, without creating a CUDA context; None when it can."""
    if torch.version.cuda is None:
        return (
            f"NCCL needs CUDA devices and this torch build ({torch.__version__}) has no CUDA; "
            "install a CUDA build of torch"
        )
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return (
            "NCCL needs CUDA devices and none is visible (check the driver with nvidia-smi and "
            "CUDA_VISIBLE_DEVICES)"
        )
    return None
