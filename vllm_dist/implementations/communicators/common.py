"""Checks every communicator makes before a backend sees a tensor, and device defaults."""

from __future__ import annotations

import bisect
import ctypes
import functools
import itertools
import math
import os
import threading
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np
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


SHM_SPARE_BYTES = 256 << 20  # what ``shared_empty`` leaves free in /dev/shm for everyone else


def shared_empty(nbytes: int, device: torch.device | str, *, reserve: bool = False) -> torch.Tensor:
    """An uninitialized uint8 buffer of ``nbytes`` that a same-node peer can map: on the CPU in
    shared memory (``NixlOptions.shared_memory``), elsewhere as ``torch.empty`` makes it. Plain
    memory too where ``/dev/shm`` lacks room: a full tmpfs kills the writer with SIGBUS.
    ``reserve``: take the pages now (``posix_fallocate``), so that a room other processes took
    meanwhile fails here, cleanly, with plain memory, not at a write; for a buffer written
    whole at once (a ring, mostly touched in part, is not)."""
    device = torch.device(device)
    if device.type != "cpu" or not nbytes or _shm_room() < nbytes + SHM_SPARE_BYTES:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    try:
        storage = torch.UntypedStorage._new_shared(nbytes)
        if reserve:
            fd, size = storage._share_fd_cpu_()  # type: ignore[attr-defined]  # already shared
            os.posix_fallocate(fd, 0, size)
    except (AttributeError, RuntimeError, OSError):  # no shared memory here, or no room
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = torch.empty(0, dtype=torch.uint8)
    out.set_(storage, 0, (nbytes,), (1,))  # type: ignore[arg-type]
    return out


def share_storages(tensors: Iterable[torch.Tensor], *, min_bytes: int = 0) -> int:
    """Move the DRAM storages behind ``tensors`` into shared memory, in place, so that a
    same-node peer can map them (what ``torch.multiprocessing`` does to a CPU tensor it sends,
    for many storages at once).

    The storages move into one arena, a shared-memory buffer laid out in the order the tensors
    come (a cache line apart; 4 KiB for storages of 1 MiB and up), whatever their number: one
    file descriptor and one mapping for 100,000 expert weights (a segment each would take as
    many descriptors, and a peer as many mappings, more than a process may hold). Each
    storage's memory is swapped for its slice of the arena and its old memory freed; every
    tensor and view of it keeps its values and sees the new memory, and only data pointers
    taken before the move go stale (``Tensor.numpy()`` arrays, registrations of the old
    addresses). Each slice holds the arena: it is unmapped when the last storage in it goes
    (``shared_arena`` finds the arena of an address while it lives). A moved storage cannot
    grow in place (``resize_`` raises, as for ``torch.frombuffer``'s), and it does not count
    as shared (``is_shared``): ``share_memory_()`` or sending it through
    ``torch.multiprocessing`` copies it out of the arena again, which a consumer then sees as
    a swapped storage. Assigning new tensors (``p.data = ...``) and in-place writes, what
    trainers do, are unaffected.

    Storages of at least ``min_bytes`` move, up to half the free room of ``/dev/shm`` beyond
    ``SHM_SPARE_BYTES``. Storages that are already shared (or in an arena), on another
    device, pinned, or not torch's own (not resizable, such as ``torch.from_numpy``'s, whose
    array would be left behind) stay as they are, as do tensors that are not strided (sparse,
    MKL-DNN). Thread-safe. Returns the bytes moved.
    """
    with _ARENA_LOCK:
        return _share_storages(tensors, min_bytes)


def _share_storages(tensors: Iterable[torch.Tensor], min_bytes: int) -> int:
    _prune_arenas()
    arenas = [(start, end) for start, end, _, _ in _ARENAS]
    storages: dict[int, torch.UntypedStorage] = {}
    # pinned memory stays (the trainer's host-to-device copies would lose their speed); only a
    # process that started CUDA has any, and asking elsewhere would start it
    cuda = torch.cuda.is_initialized()
    for tensor in tensors:
        if not tensor.is_cpu or tensor.layout is not torch.strided:
            continue
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        if not nbytes or nbytes < min_bytes or storage.is_shared():
            continue
        # not memory torch does not own either (numpy's would be left behind)
        pinned = cuda and tensor.is_pinned()
        at = storage.data_ptr()
        if (
            storage.resizable()
            and not pinned
            and not (arenas and any(a <= at < b for a, b in arenas))
        ):
            storages.setdefault(at, storage)
    room = (_shm_room() - SHM_SPARE_BYTES) // 2
    places: list[tuple[torch.UntypedStorage, int]] = []
    end = 0
    for storage in storages.values():
        nbytes = storage.nbytes()
        align = 4096 if nbytes >= 1 << 20 else 64
        at = -(-end // align) * align
        if at + nbytes <= room:
            places.append((storage, at))
            end = at + nbytes
    if not places:
        return 0
    arena = shared_empty(end, "cpu", reserve=True).untyped_storage()
    if not arena.is_shared():
        return 0  # shared memory ran out meanwhile: nothing moves
    base = arena.data_ptr()
    weak: int = arena._weak_ref()  # type: ignore[assignment]  # an int handle
    _ARENAS.append((base, base + end, weak, True))
    for storage, at in places:  # about 3 µs a storage
        nbytes = storage.nbytes()
        ctypes.memmove(base + at, storage.data_ptr(), nbytes)
        # the storage takes its slice of the arena (which keeps the arena mapped); the slice's
        # storage takes the old memory and frees it as it goes
        storage._swap_data_ptr_(arena[at : at + nbytes])  # type: ignore[attr-defined]
    return sum(storage.nbytes() for storage, _ in places)


DEVICE_ARENA_BYTES = 256 << 20  # the most ``gather_device_storages`` moves into one arena


def gather_device_storages(
    tensors: Iterable[torch.Tensor],
    *,
    max_bytes: int,
    arena_bytes: int = DEVICE_ARENA_BYTES,
    device: torch.device | str | None = None,
) -> int:
    """Move the CUDA (or CPU) storages behind ``tensors`` that are smaller than ``max_bytes``
    into arenas, in place: ``share_storages`` for VRAM, where any allocation can be mapped by a
    same-node peer (CUDA IPC) but each is a mapping of its own. A trainer that keeps 100,000
    expert weights in tensors of their own gets them laid out one after another, in the order
    the tensors come, in one allocation per ``arena_bytes``: a consumer maps a few arenas and
    copies its shard of every weight straight from them, with strided copies that span many
    weights, where it would otherwise read a packed copy (on one GPU shared by the processes,
    the pack is a second pass over every byte). On the CPU the arenas are private memory (for
    an engine's own parameters: its copies into 100,000 tensors of their own become a few
    strided copies; ``shared_arena`` and ``arena_range`` do not offer them to peers); storages
    in shared memory or pinned stay there.

    Every tensor keeps its values and identity; data pointers taken before the move go stale
    (a CUDA graph the trainer recorded over its weights, registrations of the old addresses).
    Where torch can swap a storage's memory (``_swap_data_ptr_``), every view of a moved
    storage sees the new memory; on builds without it each tensor given is re-pointed
    (``set_``), and a storage moves only if no tensor but those holds it (a view the trainer
    kept elsewhere would be left on the old memory). Each old block is freed as its storage
    moves (on CUDA to the caching allocator, whose free segments are released after each
    arena), so nothing may read or write the tensors while they move (a kernel under way, a
    thread of the caller's): only calls into this function are thread-safe against each
    other. At most ``arena_bytes`` are held twice at a time. A moved storage cannot be resized
    or shared through ``torch.multiprocessing``; in-place writes and new tensors
    (``p.data = ...``) are unaffected. Only storages on ``device`` move (None: the device of
    the first tensor that may), and not those already in an arena or not resizable. Returns
    the bytes moved.
    """
    swap = hasattr(torch.UntypedStorage, "_swap_data_ptr_")
    with _ARENA_LOCK:
        _prune_arenas()
        arenas = [(start, end) for start, end, _, _ in _ARENAS]
        where = None if device is None else torch.device(device)
        if where is not None and where.type == "cuda" and where.index is None:
            where = torch.device("cuda", torch.cuda.current_device())
        storages, users = _device_storages(tensors, max_bytes, arenas, where)
        # the storages whose every holder is one of the tensors given (and this wrapper): the
        # ones that may move without a swap, by re-pointing those tensors
        alone = {
            at
            for at, storage in storages.items()
            if torch._C._storage_Use_Count(storage._cdata) == len(users[at]) + 1  # type: ignore[attr-defined]
        }
        if not swap:
            storages = {at: st for at, st in storages.items() if at in alone}
        groups: list[list[int]] = []
        group_bytes = arena_bytes
        for at, storage in storages.items():
            nbytes = -(-storage.nbytes() // 256) * 256
            if group_bytes + nbytes > arena_bytes:
                groups.append([])
                group_bytes = 0
            groups[-1].append(at)
            group_bytes += nbytes
        moved = 0
        for group in groups:
            moved += _move_to_arena(
                [storages[at] for at in group],
                [list(users[at].values()) if at in alone else None for at in group],
                swap,
            )
            if storages[group[0]].device.type == "cuda":
                torch.cuda.empty_cache()  # the segments the group's old blocks leave free
        return moved


def _device_storages(
    tensors: Iterable[torch.Tensor],
    max_bytes: int,
    arenas: list[tuple[int, int]],
    device: torch.device | None,
) -> tuple[dict[int, torch.UntypedStorage], dict[int, dict[int, torch.Tensor]]]:
    """``gather_device_storages``' candidates on ``device`` (None: the first candidate's):
    {address: storage} (one wrapper each, and no other left behind) and {address: {id: each
    tensor given that uses it}}."""
    storages: dict[int, torch.UntypedStorage] = {}
    users: dict[int, dict[int, torch.Tensor]] = {}
    cuda = torch.cuda.is_initialized()  # pinned memory exists only then (asking would start it)
    starts = sorted(arenas)
    for tensor in tensors:
        here = tensor.device
        if here.type not in ("cuda", "cpu") or (device is not None and here != device):
            continue
        if tensor.layout is not torch.strided:
            continue
        try:
            storage = tensor.untyped_storage()
            at = storage.data_ptr()
        except RuntimeError:  # a wrapper subclass (quantized weights): no storage of its own
            continue
        if at in storages:
            users[at][id(tensor)] = tensor
            continue
        nbytes = storage.nbytes()
        fits = 0 < nbytes < max_bytes and storage.resizable()
        if fits and here.type == "cpu":  # a peer may map shared memory; pinned stays pinned
            fits = not storage.is_shared() and not (cuda and tensor.is_pinned())
        if fits and starts:  # not in an arena already
            k = bisect.bisect_right(starts, (at, math.inf)) - 1
            fits = k < 0 or at >= starts[k][1]
        if fits:
            device = here
            storages[at] = storage
            users[at] = {id(tensor): tensor}
    return storages, users


def _move_to_arena(
    storages: list[torch.UntypedStorage], users: list[list[torch.Tensor] | None], swap: bool
) -> int:
    """One arena for ``storages`` (of one device), each 256 bytes aligned: each
    storage's memory swapped for its slice of the arena (``swap``, while the build can), else
    each of its ``users`` re-pointed at the arena (None: something else holds the storage too,
    so it stays). Under ``_ARENA_LOCK``."""
    sizes = [storage.nbytes() for storage in storages]
    places, end = [], 0
    for nbytes in sizes:
        places.append(end)
        end += -(-nbytes // 256) * 256
    device = storages[0].device
    arena = torch.empty(end, dtype=torch.uint8, device=device)
    whole = arena.untyped_storage()
    base = whole.data_ptr()
    if device.type == "cuda":
        olds = []
        for storage, nbytes in zip(storages, sizes, strict=True):
            old = torch.empty(0, dtype=torch.uint8, device=device)
            olds.append(old.set_(storage, 0, (nbytes,), (1,)))  # type: ignore[arg-type]
        news = [arena[at : at + n] for at, n in zip(places, sizes, strict=True)]
        with torch.cuda.device(device):
            torch._foreach_copy_(news, olds)
            torch.cuda.current_stream(device).synchronize()  # before the old blocks go back
        del olds, news
    else:
        for storage, at, nbytes in zip(storages, places, sizes, strict=True):
            ctypes.memmove(base + at, storage.data_ptr(), nbytes)
    weak: int = whole._weak_ref()  # type: ignore[assignment]  # an int handle
    _ARENAS.append((base, base + end, weak, device.type == "cuda"))  # a CPU one is private
    del arena
    moved = sum(sizes)
    for storage, at, nbytes, held in zip(storages, places, sizes, users, strict=True):
        if swap:
            try:
                storage._swap_data_ptr_(whole[at : at + nbytes])  # type: ignore[attr-defined]
                continue
            except (RuntimeError, TypeError, NotImplementedError):
                swap = False  # this build swaps no CUDA storage: re-point from here on
        if held is None or not _repoint(held, whole, at, storage):
            moved -= nbytes  # held elsewhere too: it stays, its slot unused
    return moved


def _repoint(
    tensors: list[torch.Tensor], arena: torch.UntypedStorage, at: int, old: torch.UntypedStorage
) -> bool:
    """Point ``tensors`` (the users of storage ``old``) at its copy ``at`` bytes into
    ``arena``; where one refuses (``set_`` is not for every tensor), point back the ones
    done and return False: all or none of them move."""
    done: list[tuple[torch.Tensor, int]] = []
    with torch.no_grad():
        try:
            for t in tensors:
                offset = int(t.storage_offset())
                t.set_(arena, at // t.element_size() + offset, t.shape, t.stride())  # type: ignore[call-overload]
                done.append((t, offset))
        except RuntimeError:
            for t, offset in done:
                t.set_(old, offset, t.shape, t.stride())  # type: ignore[call-overload]
            return False
    return True


# the arenas of share_storages and gather_device_storages (one address space: CUDA's is
# unified with the host's): (first address, past the last, weak reference to the arena's
# storage, which lives as long as a storage moved into it does, whether a same-node peer can
# map it: not a private CPU arena); guarded by _ARENA_LOCK
_ARENAS: list[tuple[int, int, int, bool]] = []
_ARENA_LOCK = threading.Lock()


def arena_range(address: int) -> tuple[int, int] | None:
    """(first address, bytes) of the live arena holding ``address`` that a same-node peer can
    map (``share_storages``', or a CUDA one of ``gather_device_storages``)."""
    with _ARENA_LOCK:
        for start, end, weak, mappable in _ARENAS:
            if not mappable or not start <= address < end:
                continue
            if not torch.UntypedStorage._expired(weak):  # type: ignore[attr-defined]
                return start, end - start
    return None


def shared_arena(address: int) -> torch.Tensor | None:
    """The live arena that holds ``address`` and that a same-node peer can map (a uint8 tensor
    over all of it: ``share_storages``', or a CUDA one of ``gather_device_storages``), or
    None."""
    with _ARENA_LOCK:
        for start, end, weak, mappable in _ARENAS:
            if mappable and start <= address < end:
                storage = torch.UntypedStorage._new_with_weak_ptr(weak)  # type: ignore[attr-defined]
                if storage is None:  # gone, and its range possibly reused
                    continue
                out = torch.empty(0, dtype=torch.uint8, device=storage.device)
                return out.set_(storage, 0, (end - start,), (1,))  # type: ignore[arg-type]
    return None


def _prune_arenas() -> None:
    """Forget the arenas that are gone (their last storage died). Under ``_ARENA_LOCK``."""
    for entry in list(_ARENAS):
        if torch.UntypedStorage._expired(entry[2]):  # type: ignore[attr-defined]
            torch.UntypedStorage._free_weak_ref(entry[2])  # type: ignore[attr-defined]
            _ARENAS.remove(entry)


def _shm_room() -> int:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


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


# A copy this large gets a kernel of its own. Smaller contiguous ones share a batched launch
# (``_foreach_copy_``), which moves MiB-sized pairs slower than a memcpy each (H200: 70 pairs
# of 2.8 MiB, 300 µs batched, 224 µs one by one, 105 µs one by one on eight graph branches).
SOLO_COPY_BYTES = 256 << 10


class CopyProgram:
    """A fixed list of copies (``dst.copy_(src)`` per pair), run again and again.

    Planned once: a pair of ``SOLO_COPY_BYTES`` and up is a kernel of its own (strided ones
    widened, ``widest_views``); small strided pairs whose rows are contiguous share a
    ``RowGather`` (two kernels) per element size and row length when there are at least
    ``GATHER_MIN_PAIRS`` of them (one kernel per run of pairs whose destinations, or sources,
    follow one another in memory, ``_runs``), else get a kernel each; every other contiguous
    pair joins a batched launch (``_foreach_copy_``) of its width, its bytes seen as int64 where aligned.
    Before all that, runs of pairs of one layout that step evenly become one strided copy each
    (``_progressions``), and on the CPU runs whose sources alone step evenly one
    ``IndexedCopy`` each.
    On CUDA with ``graph``, the launches are recorded into a CUDA graph at the first ``run``,
    so each later run costs one launch however many pairs it copies (100,000 expert slices
    included). In the graph the launches are spread over ``GRAPH_BRANCHES`` branches that run
    side by side, balanced by bytes: a copy of a few MiB is over in about a microsecond on an
    H200, and one after another such copies spend most of their time starting and draining
    (measured: 140 weight shards of 1–3 MiB, 457 µs on one stream, 190 µs on eight, 163 µs
    for one memcpy of the same bytes). The tensors must stay where they are while the
    program is used, and no destination may overlap another pair's destination or source
    (the pairs run side by side, in no given order). ``staging(nbytes)``
    hands out the gathers' staging buffer (uint8, at least ``nbytes``) so that programs run
    one after another can share one; by default the program allocates its own.
    """

    def __init__(
        self,
        dsts: list[torch.Tensor],
        srcs: list[torch.Tensor],
        *,
        graph: bool = True,
        staging: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        # the storages the gathers see as raw address ranges: kept, so that a tensor re-pointed
        # by its owner (``t.data = ...``) leaves stale bytes behind, not freed memory
        self._owners: list[torch.UntypedStorage] = []
        self._solo, self._batches, self._gathers, device = _plan_copies(dsts, srcs, self._owners)
        self._bind(staging, device)
        self._start(device, graph)

    @classmethod
    def merged(cls, programs: Sequence[CopyProgram], *, graph: bool = True) -> CopyProgram:
        """One program that does what ``programs`` do, planned by none: their copies, batches
        and gathers (still bound to their staging buffers; every gather that stages runs one
        after another, as in each of them) put together, batches of one dtype joined. What a
        fresh plan of all their pairs would be, give or take a gather per program where runs
        of rows meet at a program's edge, at no planning cost: a sync replayed as a whole
        takes the programs its chunks were packed with. They must not be used at the same
        time as the merged one."""
        self = cls.__new__(cls)
        self._owners = [o for p in programs for o in p._owners]
        self._solo = [pair for p in programs for pair in p._solo]
        self._gathers = [g for p in programs for g in p._gathers]
        batches: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for p in programs:
            for dsts, srcs in p._batches:
                lists = batches.setdefault(dsts[0].dtype, ([], []))
                lists[0].extend(dsts)
                lists[1].extend(srcs)
        self._batches = list(batches.values())
        devices = [p._device for p in programs if p._device is not None]
        self._start(devices[0] if devices else None, graph)
        return self

    def _start(self, device: torch.device | None, graph: bool) -> None:
        self._units = self._plan_units()
        self._device = device
        self._want_graph = graph and device is not None and device.type == "cuda"
        self._graph: torch.cuda.CUDAGraph | None = None
        self.graph_error: str | None = None  # why recording a graph failed, if it did

    def _bind(
        self, staging: Callable[[int], torch.Tensor] | None, device: torch.device | None
    ) -> None:
        """Give the gathers that stage a buffer per device (``staging``'s on ``device``)."""
        need: dict[torch.device, int] = {}
        for g in self._gathers:
            need[g.device] = max(need.get(g.device, 0), g.staging_bytes)
        for where, nbytes in need.items():
            if not nbytes:
                continue
            # the gathers of a device run one after another: one staging buffer serves them
            if staging is None or where != device:
                buffer = torch.empty(nbytes, dtype=torch.uint8, device=where)
            else:
                buffer = staging(nbytes)
            for gather in self._gathers:
                if gather.device == where:
                    gather.bind(buffer)

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

    def _plan_units(self) -> list[tuple[int, Callable[[], object]]]:
        """(bytes, launch) of every unit of work; the gathers that stage, which share one
        staging buffer, are one unit."""
        units: list[tuple[int, Callable[[], object]]] = [
            (d.numel() * d.element_size(), functools.partial(d.copy_, s, non_blocking=True))
            for d, s in self._solo
        ]
        units += [(g.nbytes, g.run) for g in self._gathers if not g.staging_bytes]
        if any(g.staging_bytes for g in self._gathers):
            units.append((sum(g.nbytes for g in self._gathers if g.staging_bytes), self._staged))
        units += [
            (
                sum(d.numel() * d.element_size() for d in dsts),
                functools.partial(torch._foreach_copy_, dsts, srcs, non_blocking=True),
            )
            for dsts, srcs in self._batches
        ]
        return units

    def _staged(self) -> None:
        for gather in self._gathers:
            if gather.staging_bytes:
                gather.run()

    def _launch(self) -> None:
        for _, launch in self._units:
            launch()

    def _launch_branched(self, main: torch.cuda.Stream) -> None:
        """Every unit on its branch (``balance``); each branch forks from ``main`` and joins
        it again, also when a launch fails (inside a graph capture, an unjoined fork would
        replace the launch's error with its own)."""
        if self._device is None:  # nothing to copy
            return
        where = balance([n for n, _ in self._units], GRAPH_BRANCHES)
        branches = _streams(self._device)[1 : 2 + max(where, default=-1)]
        for branch in branches:
            branch.wait_stream(main)
        try:
            for b, (_, launch) in zip(where, self._units, strict=True):
                with torch.cuda.stream(branches[b]):
                    launch()
        finally:
            for branch in branches:
                main.wait_stream(branch)

    def _record(self) -> None:
        with _RECORDING:
            self._record_locked()

    def _record_locked(self) -> None:
        if self._device is None:
            return
        graph = torch.cuda.CUDAGraph()
        stream = _streams(self._device)[0]
        current = torch.cuda.current_stream(self._device)
        stream.wait_stream(current)
        try:
            with torch.cuda.stream(stream):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    self._launch_branched(stream)
                finally:
                    graph.capture_end()
        except Exception as exc:  # noqa: BLE001 - the copies still run, launched one by one
            self._want_graph = False
            self.graph_error = f"{type(exc).__name__}: {exc}"
            launches = len(self._solo) + len(self._batches) + sum(g.kernels for g in self._gathers)
            warnings.warn(
                f"recording {launches} copy launches into a CUDA "
                f"graph failed ({self.graph_error}); they are launched one by one instead",
                RuntimeWarning,
                stacklevel=4,
            )
            return
        finally:
            current.wait_stream(stream)
        self._graph = graph

    def close(self) -> None:
        self._graph = None
        self._solo, self._batches, self._gathers, self._units = [], [], [], []
        self._owners = []


def balance(sizes: list[int], branches: int) -> list[int]:
    """The branch (``0 <= b < branches``) of each of ``sizes``: largest first, each on the
    branch with the fewest bytes so far (ties: the lowest branch), so branches end together."""
    load = [0] * max(1, min(branches, len(sizes)))
    where = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        b = load.index(min(load))
        load[b] += sizes[i]
        where[i] = b
    return where


_STREAMS: dict[torch.device, list[torch.cuda.Stream]] = {}
_RECORDING = threading.Lock()  # one capture at a time on the shared streams


def _streams(device: torch.device) -> list[torch.cuda.Stream]:
    """The capture stream and the ``GRAPH_BRANCHES`` branch streams of ``device`` that every
    CopyProgram's graph capture reuses (torch hands streams out of a pool that the whole
    process shares; taking them once keeps captures from walking through it)."""
    streams = _STREAMS.get(device)
    if streams is None:
        count = 1 + GRAPH_BRANCHES
        streams = _STREAMS[device] = [torch.cuda.Stream(device) for _ in range(count)]
    return streams


GRAPH_BRANCHES = 8  # side-by-side branches of a CopyProgram's CUDA graph
GATHER_MIN_PAIRS = 8  # pairs of one row length that share two kernels (``RowGather``)
GATHER_STAGING_BYTES = 64 << 20  # rows one RowGather stages at most (a buffer per program)
GATHER_RUN_BYTES = 256 << 10  # a run of rows this large gets a RowGather of its own (``_runs``)
STRIDE_MIN_PAIRS = 4  # pairs of one layout in arithmetic progression that become one copy
STRIDE_MAX_PERIOD = 3  # progressions of every k-th pair of a layout are looked for up to this k


class _Kind(NamedTuple):
    """What every pair of one layout (dtypes, shapes, strides, devices) has in common."""

    nbytes: int
    flat: bool  # both sides contiguous
    gather: bool  # rows contiguous on both sides, one dtype and shape: a RowGather may take it
    widths: tuple[int, ...]  # element sizes to try, widest first (each pair takes the first
    # its addresses or storage offsets allow)
    rows: int  # rows (last-dimension runs) per pair
    offsets: tuple[torch.Tensor, torch.Tensor] | None  # byte offset of each row (dst, src)
    contiguous: tuple[bool, bool]


def _contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """``Tensor.is_contiguous`` from a shape and strides (dimensions of size 1 ignored)."""
    expected = 1
    for n, stride in zip(reversed(shape), reversed(strides), strict=True):
        if n != 1 and stride != expected:
            return False
        expected *= n
    return True


def _row_offsets(shape: tuple[int, ...], strides: tuple[int, ...], size: int) -> torch.Tensor:
    """The byte offset of every row (last-dimension run) of a layout, row-major."""
    offsets = torch.zeros((), dtype=torch.int64)
    for n, stride in zip(shape[:-1], strides[:-1], strict=True):
        offsets = offsets.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * stride
    return offsets.reshape(-1) * size


def _kind(layout: tuple[Any, ...]) -> _Kind:
    """The ``_Kind`` of pairs of ``layout`` (``_plan_copies``): how ``widest_views`` and
    ``_widest_bytes`` would see them, and whether their rows can be gathered."""
    ddt, sdt, dshape, sshape, dstr, sstr, ddev, sdev = layout
    size = ddt.itemsize
    numel = math.prod(dshape)
    contiguous = (_contiguous(dshape, dstr), _contiguous(sshape, sstr))
    flat = all(contiguous)
    nbytes = numel * size
    if flat:
        if ddt != sdt:  # a casting copy: batched as it is
            return _Kind(nbytes, True, False, (), 1, None, contiguous)
        flat_widths = tuple(w for w in (8, 4, 2) if nbytes % w == 0) + (1,)
        return _Kind(nbytes, True, ddev == sdev, flat_widths, 1, None, contiguous)
    rowwise = ddt == sdt and len(dshape) > 0 and dstr[-1] == 1 and sstr[-1] == 1
    widths: tuple[int, ...] = ()
    if rowwise:  # widest_views' choices, before the storage offsets have their say
        for wide in (8, 4, 2):
            ratio = wide // size
            if ratio <= 1:
                break
            if dshape[-1] % ratio == 0 and all(st % ratio == 0 for st in (*dstr[:-1], *sstr[:-1])):
                widths += (wide,)
    widths += (size,)
    gather = rowwise and dshape == sshape and ddev == sdev and size in _INT_OF_SIZE
    offsets = (_row_offsets(dshape, dstr, size), _row_offsets(sshape, sstr, size))
    rows = numel // dshape[-1] if len(dshape) else 1
    return _Kind(nbytes, False, gather, widths, rows, offsets if gather else None, contiguous)


def _plan_copies(
    dsts: list[torch.Tensor], srcs: list[torch.Tensor], owners: list[torch.UntypedStorage]
) -> tuple[
    list[tuple[torch.Tensor, torch.Tensor]],
    list[tuple[list[torch.Tensor], list[torch.Tensor]]],
    list[RowGather | IndexedCopy],
    torch.device | None,
]:
    """``CopyProgram``'s plan: (solo pairs, batches per dtype, gathers, device); the storages
    of the gathered pairs are added to ``owners``.

    100,000 pairs are planned in well under a second: each pair's layout is read once, what
    follows from a layout is worked out once per layout (``_kind``), rows are addressed with
    tensor ops, and views are made only of the pairs that end up copied one by one or
    batched (planning view by view took about 30 µs a pair: seconds per sync of a MoE).

    Pairs of one layout whose destinations and sources both step by a constant in one storage
    each (``_progressions``: expert shards between an inference engine's fused expert tensor
    and a trainer's flat buffer or a packed slot) first become one strided copy per run.
    """
    solo: list[tuple[torch.Tensor, torch.Tensor]] = []
    layouts = [
        (d.dtype, s.dtype, d.shape, s.shape, d.stride(), s.stride(), d.device, s.device)
        for d, s in zip(dsts, srcs, strict=True)
    ]
    taken = _progressions(dsts, srcs, layouts, solo, owners)
    gathers: list[RowGather | IndexedCopy] = []
    _indexed_runs(dsts, srcs, layouts, taken, gathers, owners)
    batches: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    kinds: dict[tuple[Any, ...], _Kind] = {}
    # (device, flat, element size, row length) -> the pairs a RowGather may take, in order
    rows: dict[tuple[Any, ...], list[_Member]] = {}
    device = None

    def batch(i: int, kind: _Kind) -> None:
        dst, src = dsts[i], srcs[i]
        if kind.widths:  # flat, one dtype: seen as the widest integers it allows
            dst, src = _widest_bytes(dst, src, kind.nbytes)
        lists = batches.setdefault(dst.dtype, ([], []))
        lists[0].append(dst)
        lists[1].append(src)

    for i, (dst, src) in enumerate(zip(dsts, srcs, strict=True)):
        layout = layouts[i]
        if i in taken:
            device = layout[6]
            continue
        kind = kinds.get(layout)
        if kind is None:
            kind = kinds[layout] = _kind(layout)
        if not kind.nbytes:
            continue
        device = layout[6]
        if kind.nbytes >= SOLO_COPY_BYTES:
            solo.append(widest_views(dst, src))
        elif not kind.gather:
            if kind.flat:
                batch(i, kind)
            else:
                solo.append(widest_views(dst, src))
        else:
            d, s = dst.data_ptr(), src.data_ptr()
            if kind.flat:
                size = 1
                for size in kind.widths:
                    if d % size == 0 and s % size == 0:
                        break
                row = kind.nbytes // size
            else:
                item = dst.element_size()
                do, so = int(dst.storage_offset()), int(src.storage_offset())
                for size in kind.widths:
                    ratio = max(1, size // item)
                    if do % ratio == 0 and so % ratio == 0:
                        break
                row = int(dst.shape[-1]) * item // size
            rows.setdefault((layout[6], kind.flat, size, row), []).append((i, kind, d, s))
    for (dev, flat, size, row), members in rows.items():
        addresses = _pair_rows(members)
        counts = torch.tensor([m[1].rows for m in members], dtype=torch.int64)
        first = torch.cumsum(counts, 0) - counts
        limit = GATHER_STAGING_BYTES // (size * row)
        for part in _runs(members, limit):
            gather = None
            if len(part) >= GATHER_MIN_PAIRS:
                dst_rows, src_rows = _part_rows(addresses, counts, first, part)
                gather = RowGather.plan(dst_rows, src_rows, size, row, dev)
            if gather is not None:
                gathers.append(gather)
                for p in part:
                    i = members[p][0]
                    owners += (dsts[i].untyped_storage(), srcs[i].untyped_storage())
                continue
            for p in part:
                i, kind = members[p][0], members[p][1]
                if flat:
                    batch(i, kind)
                else:
                    solo.append(widest_views(dsts[i], srcs[i]))
    return solo, list(batches.values()), gathers, device


_Member = tuple[int, _Kind, int, int]  # (pair index, kind, dst address, src address)


def _progressions(
    dsts: list[torch.Tensor],
    srcs: list[torch.Tensor],
    layouts: list[tuple[Any, ...]],
    solo: list[tuple[torch.Tensor, torch.Tensor]],
    owners: list[torch.UntypedStorage],
) -> set[int]:
    """Runs of ``STRIDE_MIN_PAIRS`` or more pairs of one layout (in the order given, other
    layouts between them) whose destinations step by one constant and sources by another,
    added to ``solo`` as one strided copy each (a dimension in front); the positions they
    take. Each side lies within one storage, or, on CUDA, is seen through a raw view of the
    range it spans (``_strided_run``; the pairs' storages are added to ``owners``): an
    inference engine's shards of 100,000 expert weights, each a tensor of its own, laid out
    one after another by the caching allocator. Measured on the 2-core CPU: 100,000 expert
    shards of 2 KiB from a flat buffer into fused expert tensors, about 100 ms as row
    gathers, one memcpy's time as 96 strided copies."""

    def take(run: list[int], dstep: int, sstep: int) -> bool:
        found = _strided_run(dsts, srcs, run, dstep, sstep)
        if found is None:
            return False
        dst, src, raw = found
        solo.append((dst, src))
        if raw:  # the views own nothing: the pairs' storages are kept instead
            owners.extend(
                t.untyped_storage() for side in (dsts, srcs) for t in (side[i] for i in run)
            )
        return True

    return _stepping_runs(
        layouts,
        set(),
        STRIDE_MIN_PAIRS,
        lambda layout: layout[0] == layout[1] and layout[6] == layout[7],
        dsts,
        srcs,
        take,
    )


def _stepping_runs(
    layouts: list[tuple[Any, ...]],
    skip: set[int],
    min_pairs: int,
    want: Callable[[tuple[Any, ...]], bool],
    dsts: list[torch.Tensor] | None,
    srcs: list[torch.Tensor],
    take: Callable[[list[int], int, int], bool],
) -> set[int]:
    """The positions of the runs ``take`` takes: each run is ``min_pairs`` or more pairs of
    one layout that ``want``s, not in ``skip`` (in the order given, other layouts between
    them), whose sources step by one constant and destinations by another (any, without
    ``dsts``); ``take(run, dst step, src step)`` says whether it took the run."""
    by_layout: dict[tuple[Any, ...], list[int]] = {}
    for i, layout in enumerate(layouts):
        if i not in skip:
            by_layout.setdefault(layout, []).append(i)
    taken: set[int] = set()
    for layout, members in by_layout.items():
        if len(members) < min_pairs or not math.prod(layout[2]) or not want(layout):
            continue
        at = np.array(members, dtype=np.int64)
        d = np.zeros(len(members), dtype=np.int64)  # no destinations: their steps do not count
        if dsts is not None:
            d = np.array([dsts[i].data_ptr() for i in members], dtype=np.int64)
        s = np.array([srcs[i].data_ptr() for i in members], dtype=np.int64)
        free = np.ones(len(members), dtype=bool)
        # every k-th pair too: pairs of two weights of one layout taking turns (an expert's
        # gate and up projections) step evenly only each on its own
        for k in range(1, STRIDE_MAX_PERIOD + 1):
            left = np.flatnonzero(free)
            for phase in range(k):
                pick = left[phase::k]
                for first, end, dstep, sstep in _even_runs(d[pick], s[pick]):
                    run = at[pick[first:end]].tolist()
                    if end - first >= min_pairs and take(run, dstep, sstep):
                        taken.update(run)
                        free[pick[first:end]] = False
    return taken


def _even_runs(d: np.ndarray, s: np.ndarray) -> list[tuple[int, int, int, int]]:
    """(first, past the last, dst step, src step) of each run of ``STRIDE_MIN_PAIRS`` or more
    addresses in which both sides step by constants."""
    if len(d) < STRIDE_MIN_PAIRS:
        return []
    dd, ds = np.diff(d), np.diff(s)
    # a run continues while both steps stay what they were; cut where either changes
    cuts = np.flatnonzero((dd[1:] != dd[:-1]) | (ds[1:] != ds[:-1])) + 1
    runs = []
    start = 0  # the first pair no run has taken (a pair where the steps change ends a run)
    for a, b in itertools.pairwise([0, *cuts.tolist(), len(dd)]):  # steps a..b-1: pairs a..b
        first = max(a, start)
        if b + 1 - first >= STRIDE_MIN_PAIRS:
            runs.append((first, b + 1, int(dd[a]), int(ds[a])))
            start = b + 1
    return runs


def _strided_run(
    dsts: list[torch.Tensor], srcs: list[torch.Tensor], run: list[int], dstep: int, sstep: int
) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
    """The pairs ``run`` (one layout, addresses stepping by ``dstep`` / ``sstep`` bytes) as
    one pair of views with a leading dimension and whether a view is raw (below), or None
    where a step is not a positive multiple of the element size, or a side leaves its first
    storage off the CPU and CUDA.

    A side that spans allocations (tensors of their own, one after another) is a view of a raw
    tensor over the range (``_raw_tensor``, owning nothing: the memory is the pairs'): the view
    touches exactly the pairs' elements, since they step evenly, and a copy kernel, unlike a
    CUDA memcpy, does not mind that they belong to several allocations."""
    views = []
    raw_views = False
    for side, step in ((dsts, dstep), (srcs, sstep)):
        first, last = side[run[0]], side[run[-1]]
        size = first.element_size()
        if step <= 0 or step % size:
            return None
        sizes = (len(run), *first.shape)
        strides = (step // size, *first.stride())
        reach = sum((n - 1) * st for n, st in zip(sizes, strides, strict=True))
        storage = first.untyped_storage()
        start = storage.data_ptr()
        inside = start <= last.data_ptr() < start + storage.nbytes()
        if inside and (first.storage_offset() + 1 + reach) * size <= storage.nbytes():
            views.append(first.as_strided(sizes, strides, first.storage_offset()))
            continue
        if first.device.type not in ("cuda", "cpu") or min(first.stride(), default=0) < 0:
            return None  # another allocation: no view of the first one reaches it
        # from a 16-byte boundary, so that the storage offset tells widest_views the alignment
        base = first.data_ptr() // 16 * 16
        lead = (first.data_ptr() - base) // size
        as_int = _INT_OF_SIZE.get(size)
        if as_int is None or (first.data_ptr() - base) % size:
            return None
        raw = _raw_tensor(base, lead + reach + 1, as_int, first.device)
        if raw is None:
            return None
        views.append(raw.view(first.dtype).as_strided(sizes, strides, lead))
        raw_views = True
    return (*widest_views(views[0], views[1]), raw_views)


def _indexed_runs(
    dsts: list[torch.Tensor],
    srcs: list[torch.Tensor],
    layouts: list[tuple[Any, ...]],
    taken: set[int],
    gathers: list[RowGather | IndexedCopy],
    owners: list[torch.UntypedStorage],
) -> None:
    """On the CPU, runs of ``GATHER_MIN_PAIRS`` or more pairs of one layout, not in ``taken``,
    whose sources step by one constant in one storage while their destinations lie anywhere
    (a consumer's shards of 100,000 expert weights in a trainer's flat buffer or shared arena,
    each into a tensor of its own): one ``IndexedCopy`` each, added to ``gathers`` and
    ``taken``, their storages to ``owners``."""

    def want(layout: tuple[Any, ...]) -> bool:
        same = layout[0] == layout[1] and layout[6] == layout[7] and layout[2] == layout[3]
        return same and layout[6].type == "cpu"

    def take(run: list[int], _dstep: int, sstep: int) -> bool:
        gather = IndexedCopy.plan([dsts[i] for i in run], srcs[run[0]], sstep)
        if gather is None:
            return False
        gathers.append(gather)
        owners.extend(dsts[i].untyped_storage() for i in run)
        owners.append(srcs[run[0]].untyped_storage())
        return True

    taken |= _stepping_runs(layouts, taken, GATHER_MIN_PAIRS, want, None, srcs, take)


class IndexedCopy:
    """Pairs of one layout whose sources are one strided view (they step evenly through one
    storage) and whose destinations lie anywhere, as one ``index_copy_`` into a window over
    the destinations' address range (each pair's destination at its own start): one kernel
    and no staging, where a ``RowGather`` would stage every row (measured on the 2-core CPU:
    33,000 expert shards of 2 KiB in rows of 64 B, 26 ms; 37 ms staged; 19 ms for 2 KiB
    rows, 29 ms staged). CPU only (a window written through is untested on CUDA)."""

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
        dtype = _INT_OF_SIZE.get(size, first.dtype)  # moved as integers where it can be
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


def _pair_rows(members: list[_Member]) -> tuple[torch.Tensor, torch.Tensor]:
    """The byte address of every row of ``members``' pairs, in order (dst, src)."""
    out: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    for _, run in itertools.groupby(members, key=lambda m: id(m[1])):
        run_members = list(run)
        kind = run_members[0][1]
        for side in (0, 1):
            bases = torch.tensor([m[3] if side else m[2] for m in run_members], dtype=torch.int64)
            if kind.offsets is None:
                out[side].append(bases)
            else:
                out[side].append((bases.unsqueeze(1) + kind.offsets[side]).reshape(-1))
    return torch.cat(out[0]), torch.cat(out[1])


def _part_rows(
    addresses: tuple[torch.Tensor, torch.Tensor],
    counts: torch.Tensor,
    first: torch.Tensor,
    part: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows (dst, src addresses) of the pairs at positions ``part`` (increasing), of
    ``counts`` rows each, the first at ``first``."""
    a, b = part[0], part[-1]
    if b - a + 1 == len(part):  # a run of positions: a slice of rows
        lo, hi = int(first[a]), int(first[b] + counts[b])
        return addresses[0][lo:hi], addresses[1][lo:hi]
    at = torch.tensor(part, dtype=torch.int64)
    n = counts[at]
    start = torch.repeat_interleave(first[at], n)
    within = torch.arange(int(n.sum()), dtype=torch.int64) - torch.repeat_interleave(
        torch.cumsum(n, 0) - n, n
    )
    rows = start + within
    return addresses[0][rows], addresses[1][rows]


def _runs(members: list[_Member], limit: int) -> list[list[int]]:
    """The positions of ``members`` cut into runs whose destinations (or sources) follow one
    another in memory, each then into ``_parts``; the pairs of shorter runs stay together as
    before.

    A run's rows are one block on that side, so its ``RowGather`` is one kernel with no
    staging. A sync's packs (or unpacks) of 100,000 expert shards are two kinds of rows taking
    turns in a slot (each chunk lays its kinds side by side): one gather per kind over all of
    them sees neither side as one block and stages every row, twice the traffic of a gather
    per run. A run is cut out only when it has ``GATHER_MIN_PAIRS`` pairs and
    ``GATHER_RUN_BYTES``, so no more runs are cut out than the program moves that many bytes;
    of the two sides, the one whose runs cover more bytes is cut (none when either side is one
    block already)."""
    count = [m[1].rows for m in members]
    everything = range(len(members))
    best: tuple[int, list[range]] = (0, [])
    for side in (0, 1):
        runs: list[tuple[int, int, int]] = []  # (first position, past the last, bytes)
        first, nbytes, end = 0, 0, -1
        for p, member in enumerate(members):
            kind, at = member[1], (member[3] if side else member[2])
            if p and at != end:
                runs.append((first, p, nbytes))
                first, nbytes = p, 0
            nbytes += kind.nbytes
            end = at + kind.nbytes if kind.contiguous[side] else -1
        if not runs:
            return _parts(everything, count, limit)  # one block on this side already
        runs.append((first, len(members), nbytes))
        long = [run for run in runs if run[1] - run[0] >= GATHER_MIN_PAIRS]
        long = [run for run in long if run[2] >= GATHER_RUN_BYTES]
        covered = sum(n for _, _, n in long)
        if covered > best[0]:
            best = (covered, [range(a, b) for a, b, _ in long])
    if not best[1]:
        return _parts(everything, count, limit)
    taken = [False] * len(members)
    for run in best[1]:
        taken[run.start : run.stop] = [True] * len(run)
    rest = [p for p in everything if not taken[p]]
    parts = [part for run in best[1] for part in _parts(run, count, limit)]
    return parts + (_parts(rest, count, limit) if rest else [])


def _parts(positions: Iterable[int], count: list[int], limit: int) -> list[list[int]]:
    """``positions`` cut into runs of at most ``limit`` rows each (a larger pair alone);
    ``count[p]``: the rows of the pair at position ``p``."""
    parts: list[list[int]] = [[]]
    rows = 0
    for p in positions:
        n = count[p]
        if parts[-1] and rows + n > limit:
            parts.append([])
            rows = 0
        parts[-1].append(p)
        rows += n
    return parts


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# ``IndexedCopy``'s element types, widest first. An element-wise kernel moves 16-byte complex
# elements as plain loads and stores (bit for bit, NaN payloads too) and takes 2 KiB rows in
# 128 steps instead of 256 (measured on the CPU: 33,000 rows of 2 KiB, 13.8 ms; 18.6 ms as
# int64; a memcpy of the bytes 12.3 ms).
_COPY_WIDTHS = (torch.complex128, torch.int64, torch.int32, torch.int16)


class RowGather:
    """Many small strided copies whose rows are contiguous (a row-parallel shard of each of
    100,000 expert weights) as two kernels instead of one per pair: an ``index_select`` of
    every source row into a staging buffer, then an ``index_copy_`` of those rows into place.
    Where the destination rows follow one another in memory (a pack into a slot), the select
    writes them in place; where the source rows do (an unpack from a slot), the copy reads
    them in place: one kernel, no staging.

    Each side is seen through a flat tensor over the address range its rows span (it owns
    nothing: the pairs, kept here, own the memory), so rows of unrelated allocations become
    rows of one tensor; only rows the pairs hold are ever read or written. Sources are read
    through a window view (a row may start at any element); destination rows that do not all
    start on a grid of the row length are written through one too on the CPU (measured: 50,000
    rows of 2 KiB into tensors of their own, 27 ms; 46 ms element by element, 168 ms as
    ``_foreach_copy_``), element by element on CUDA.
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
        dtype = _INT_OF_SIZE[size]
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
    flat = _raw_tensor(base, int(starts.max()) + row, dtype, device)
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


def _raw_tensor(
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
