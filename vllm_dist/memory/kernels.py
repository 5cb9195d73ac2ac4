"""Copy kernels: widened strided copies, batched copies, row gathers and indexed copies.

Each kernel moves the bytes of many (dst, src) pairs in one or two launches by seeing the
memory through flat views over raw address ranges (``raw_tensor``). The alternative, a
``copy_`` per pair, costs one launch per pair, which dominates for many small pairs.
"""

from __future__ import annotations

import ctypes

import torch

INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# ``IndexedCopy``'s element types, widest first: an element-wise kernel moves 16-byte complex
# elements as plain loads and stores (bit for bit, NaN payloads too).
_COPY_WIDTHS = (torch.complex128, torch.int64, torch.int32, torch.int16)


def widest_views(dst: torch.Tensor, src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``dst`` and ``src`` viewed as the widest integer type both layouts allow, for a bitwise
    copy: a strided copy kernel moves one element per thread and does not vectorize. Contiguous
    pairs are left alone (``copy_`` is a memcpy for them)."""
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

    ``torch._foreach_copy_`` batches only when every tensor of its lists is contiguous, so the
    contiguous pairs go in one launch and the strided rest, widened, in another.
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


def widest_bytes(
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


class RowGather:
    """Many small strided copies whose rows are contiguous as two kernels instead of one per
    pair: an ``index_select`` of every source row into a staging buffer, then an
    ``index_copy_`` of those rows into place; one kernel and no staging where either side's
    rows follow one another in memory (a pack into a slot, an unpack from one).

    Each side is a flat view over the address range its rows span (owning nothing: the pairs
    own the memory), so rows of unrelated allocations become rows of one tensor. Destination
    rows off the row grid are written through a window view on the CPU, element by element on
    CUDA.
    """

    def __init__(
        self,
        source: tuple[torch.Tensor, torch.Tensor],
        target: tuple[torch.Tensor, torch.Tensor],
        *,
        dst_rows: torch.Tensor | None = None,
        src_rows: torch.Tensor | None = None,
    ) -> None:
        self._window, self._rows = source
        self._target, self._index = target
        self._dst_rows = dst_rows  # the destination rows as one block, when they are one
        self._src_rows = src_rows  # the source rows as one block, when they are one
        staged = dst_rows is None and src_rows is None
        self.staging_bytes = (
            self._rows.numel() * self._window.shape[1] * self._window.element_size()
            if staged
            else 0
        )
        self._staging: torch.Tensor | None = None
        self._staged: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self._window.device

    @property
    def kernels(self) -> int:
        return 2 if self.staging_bytes else 1

    @property
    def nbytes(self) -> int:
        """Bytes the gather moves."""
        return self._rows.numel() * self._window.shape[1] * self._window.element_size()

    def bind(self, buffer: torch.Tensor) -> None:
        """Stage rows in the first ``staging_bytes`` of ``buffer`` (a uint8 tensor)."""
        if not self.staging_bytes:
            return
        shape = (self._rows.numel(), self._window.shape[1])
        self._staging = buffer[: self.staging_bytes].view(self._window.dtype).view(shape)
        self._staged = self._staging if self._target.dim() == 2 else self._staging.view(-1)

    @classmethod
    def plan(
        cls,
        dst_at: torch.Tensor,
        src_at: torch.Tensor,
        size: int,
        row: int,
        device: torch.device,
    ) -> RowGather | None:
        """The gather of rows of ``row`` elements of ``size`` bytes from the byte addresses
        ``src_at`` to ``dst_at`` (int64, one per row, in order) on ``device``, or None where
        the device or the addresses do not allow it. The caller keeps the memory."""
        dtype = INT_OF_SIZE[size]
        src = _span(src_at, row, dtype, device)
        dst = _span(dst_at, row, dtype, device)
        if src is None or dst is None:
            return None
        flat, starts = src
        src_rows = _block(flat, starts, row)
        window = flat.as_strided((flat.numel() - row + 1, row), (1, 1))
        flat, starts_dst = dst
        dst_rows = _block(flat, starts_dst, row)
        if dst_rows is not None and device.type == "cuda":
            # rows of separate allocations may follow one another in memory, and a memcpy
            # (what copy_ of one block into another is) refuses a range that spans two
            # allocations ("invalid argument"): on CUDA a block is copied by a kernel
            src_rows = None
        if not bool((starts_dst % row).any()):
            target = (flat.view(-1, row), starts_dst // row)
        elif device.type == "cpu":  # off the grid: rows of a window, as the sources are read
            target = (flat.as_strided((flat.numel() - row + 1, row), (1, 1)), starts_dst)
        else:  # off the grid on CUDA: one index per element
            target = (flat, (starts_dst.unsqueeze(1) + torch.arange(row)).reshape(-1))
            if src_rows is not None:
                src_rows = src_rows.view(-1)
        return cls(
            (window, starts.to(device)),
            (target[0], target[1].to(device)),
            dst_rows=dst_rows,
            src_rows=src_rows,
        )

    def run(self) -> None:
        if self._dst_rows is not None:
            if self._src_rows is not None:  # both sides one block: one plain copy
                self._dst_rows.view(-1).copy_(self._src_rows.view(-1))
            else:
                torch.index_select(self._window, 0, self._rows, out=self._dst_rows)
            return
        if self._src_rows is not None:
            self._target.index_copy_(0, self._index, self._src_rows)
            return
        if self._staging is None or self._staged is None:
            raise RuntimeError("RowGather.run before bind: it has no staging buffer")
        torch.index_select(self._window, 0, self._rows, out=self._staging)
        self._target.index_copy_(0, self._index, self._staged)


def _block(flat: torch.Tensor, starts: torch.Tensor, row: int) -> torch.Tensor | None:
    """The rows starting at ``starts`` (elements of ``flat``) as one ``(n, row)`` view, when
    each follows the one before it in memory; else None."""
    n = starts.numel()
    first = int(starts[0])
    if not torch.equal(starts, first + torch.arange(n, dtype=starts.dtype) * row):
        return None
    return flat[first : first + n * row].view(n, row)


def _span(
    addresses: torch.Tensor, row: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A flat tensor of ``dtype`` over the range rows of ``row`` elements at ``addresses``
    span, and each row's start in elements of it; None for an unaligned address or a device
    without raw views."""
    size = dtype.itemsize
    base = int(addresses.min())
    rel = addresses - base
    if base % size or bool((rel % size).any()):
        return None
    starts = rel // size
    flat = raw_tensor(base, int(starts.max()) + row, dtype, device)
    return None if flat is None else (flat, starts)


_TYPESTR = {torch.uint8: "|u1", torch.int16: "<i2", torch.int32: "<i4", torch.int64: "<i8"}


class _CudaArray:
    """``count`` elements of ``dtype`` at a device address, for ``torch.as_tensor``."""

    def __init__(self, address: int, count: int, dtype: torch.dtype) -> None:
        self.__cuda_array_interface__ = {
            "shape": (count,),
            "typestr": _TYPESTR[dtype],
            "data": (address, False),
            "version": 2,
        }


def raw_tensor(
    address: int, count: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """A tensor over memory it does not own (its owners must outlive it); None off CPU/CUDA or
    where the range cannot be viewed (the pairs are then copied one by one)."""
    try:
        if device.type == "cuda":
            flat = torch.as_tensor(_CudaArray(address, count, dtype), device=device)
        elif device.type == "cpu":
            buffer = (ctypes.c_char * (count * dtype.itemsize)).from_address(address)
            flat = torch.frombuffer(buffer, dtype=dtype)
        else:
            return None
    except (OverflowError, MemoryError, ValueError, TypeError, RuntimeError):
        return None
    return flat if flat.data_ptr() == address and flat.device == device else None


class IndexedCopy:
    """Pairs of one layout whose sources step evenly through one storage and whose
    destinations lie anywhere, as one ``index_copy_`` into a window over the destinations'
    address range: one kernel and no staging, where a ``RowGather`` would stage every row.
    CPU only (a window written through is untested on CUDA)."""

    staging_bytes = 0
    kernels = 1

    def __init__(self, target: torch.Tensor, index: torch.Tensor, source: torch.Tensor) -> None:
        self._target, self._index, self._source = target, index, source

    @property
    def device(self) -> torch.device:
        return self._source.device

    @property
    def nbytes(self) -> int:
        return self._source.numel() * self._source.element_size()

    def bind(self, buffer: torch.Tensor) -> None:
        """Nothing to stage."""

    @classmethod
    def plan(cls, dsts: list[torch.Tensor], first: torch.Tensor, step: int) -> IndexedCopy | None:
        """The copy into ``dsts`` (one layout, on the CPU) from ``first`` and the views after
        it ``step`` bytes apart, one per destination; None where a view would leave the
        storage or an address is off the element grid."""
        size = first.element_size()
        if step <= 0 or step % size:
            return None
        sizes, steps = (len(dsts), *first.shape), (step // size, *first.stride())
        reach = sum((n - 1) * st for n, st in zip(sizes, steps, strict=True))
        if (first.storage_offset() + 1 + reach) * size > first.untyped_storage().nbytes():
            return None  # the sources are not all in the first one's storage
        source = first.as_strided(sizes, steps, first.storage_offset())
        shape, strides = tuple(first.shape), tuple(dsts[0].stride())
        extent = 1 + sum((n - 1) * st for n, st in zip(shape, strides, strict=True))
        at = torch.tensor([d.data_ptr() for d in dsts], dtype=torch.int64)
        dtype = INT_OF_SIZE.get(size, first.dtype)  # moved as integers where it can be
        for wide in _COPY_WIDTHS:  # the widest the layout allows
            ratio = wide.itemsize // size
            if ratio <= 1:
                break
            if first.stride()[-1] != 1 or strides[-1] != 1 or shape[-1] % ratio:
                continue
            if any(st % ratio for st in (*first.stride()[:-1], *strides[:-1], step // size)):
                continue
            if first.data_ptr() % wide.itemsize or bool((at % wide.itemsize).any()):
                continue
            if first.storage_offset() % ratio:  # a storage whose base is off the wide grid
                continue
            shape = (*shape[:-1], shape[-1] // ratio)
            strides = (*(st // ratio for st in strides[:-1]), 1)
            extent = 1 + sum((n - 1) * st for n, st in zip(shape, strides, strict=True))
            dtype = wide
            break
        span = _span(at, extent, dtype, first.device)
        if span is None:
            return None
        flat, starts = span
        target = flat.as_strided((flat.numel() - extent + 1, *shape), (1, *strides))
        return cls(target, starts, source.view(dtype))

    def run(self) -> None:
        self._target.index_copy_(0, self._index, self._source)
