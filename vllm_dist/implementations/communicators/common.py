"""Checks every communicator makes before a backend sees a tensor, and device defaults."""

from __future__ import annotations

import os
import warnings

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


SOLO_COPY_BYTES = 16 << 20  # a contiguous copy this large gets a kernel of its own


class CopyProgram:
    """A fixed list of copies (``dst.copy_(src)`` per pair), run again and again.

    Planned once: a strided pair or a contiguous one of ``SOLO_COPY_BYTES`` and up is a kernel
    of its own (strided ones widened, ``widest_views``); every other contiguous pair joins a
    batched launch (``_foreach_copy_``) of its width, its bytes seen as int64 where aligned.
    On CUDA with ``graph``, the launches are recorded into a CUDA graph at the first ``run``,
    so each later run costs one launch however many pairs it copies (100,000 expert slices
    included). The tensors must stay where they are while the program is used.
    """

    def __init__(
        self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], *, graph: bool = True
    ) -> None:
        self._solo: list[tuple[torch.Tensor, torch.Tensor]] = []
        batches: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        device = None
        for dst, src in zip(dsts, srcs, strict=True):
            nbytes = dst.numel() * dst.element_size()
            if not nbytes:
                continue
            device = dst.device
            if nbytes >= SOLO_COPY_BYTES or not (dst.is_contiguous() and src.is_contiguous()):
                self._solo.append(widest_views(dst, src))
                continue
            d, s = _widest_bytes(dst, src, nbytes) if dst.dtype == src.dtype else (dst, src)
            lists = batches.setdefault(d.dtype, ([], []))
            lists[0].append(d)
            lists[1].append(s)
        self._batches = list(batches.values())
        self._device = device
        self._want_graph = graph and device is not None and device.type == "cuda"
        self._graph: torch.cuda.CUDAGraph | None = None
        self.graph_error: str | None = None  # why recording a graph failed, if it did

    @property
    def graphed(self) -> bool:
        """Whether ``run`` replays a CUDA graph."""
        return self._graph is not None

    def run(self) -> None:
        """Queue the copies on the current stream of their device (on the CPU: do them)."""
        if self._device is None or self._device.type != "cuda":
            self._launch()
            return
        with torch.cuda.device(self._device):  # a graph replays on the current device's stream
            if self._graph is None and self._want_graph:
                self._record()
            if self._graph is not None:
                self._graph.replay()
            else:
                self._launch()

    def _launch(self) -> None:
        for dst, src in self._solo:
            dst.copy_(src, non_blocking=True)
        for dsts, srcs in self._batches:
            torch._foreach_copy_(dsts, srcs, non_blocking=True)

    def _record(self) -> None:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream(self._device)
        current = torch.cuda.current_stream(self._device)
        stream.wait_stream(current)
        try:
            with torch.cuda.stream(stream):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    self._launch()
                finally:
                    graph.capture_end()
        except Exception as exc:  # noqa: BLE001 - the copies still run, launched one by one
            self._want_graph = False
            self.graph_error = f"{type(exc).__name__}: {exc}"
            warnings.warn(
                f"recording {len(self._solo) + len(self._batches)} copy launches into a CUDA "
                f"graph failed ({self.graph_error}); they are launched one by one instead",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        finally:
            current.wait_stream(stream)
        self._graph = graph

    def close(self) -> None:
        self._graph = None
        self._solo, self._batches = [], []


def _widest_bytes(
    dst: torch.Tensor, src: torch.Tensor, nbytes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two contiguous tensors of ``nbytes`` as flat views of the widest integer type that their
    addresses and length allow."""
    d = dst.reshape(-1).view(torch.uint8)
    s = src.reshape(-1).view(torch.uint8)
    for wide in (torch.int64, torch.int32, torch.int16):
        size = wide.itemsize
        if nbytes % size == 0 and d.data_ptr() % size == 0 and s.data_ptr() % size == 0:
            return d.view(wide), s.view(wide)
    return d, s
