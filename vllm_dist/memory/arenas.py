"""Storage arenas: many small storages moved, in place, into a few large allocations.

A peer maps one arena instead of one allocation per weight, and copies that span many
weights become a few strided copies. The moves swap each storage's memory for its slice of
an arena (``UntypedStorage._swap_data_ptr_``), so every tensor and view keeps its identity
and values; the alternative, handing out new tensors, would leave the caller's references on
the old memory. An ``ArenaMap``, owned by whoever moves storages, records the arenas it made.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import math
import os
import threading
from collections.abc import Iterable, Iterator

import torch

SHM_SPARE_BYTES = 256 << 20  # what ``shared_empty`` leaves free in /dev/shm for everyone else
DEVICE_ARENA_BYTES = 256 << 20  # the most ``gather_device_storages`` moves into one arena


class ArenaMap:
    """The arenas that ``share_storages`` and ``gather_device_storages`` made, by address (one
    address space: CUDA's is unified with the host's). An entry holds a weak reference to its
    arena's storage, which lives as long as a storage moved into it does. Thread-safe; moves
    into one map run one at a time."""

    def __init__(self) -> None:
        # (first address, past the last, weak reference to the arena's storage, whether a
        # same-node peer can map it: not a private CPU arena)
        self._entries: list[tuple[int, int, int, bool]] = []
        self._lock = threading.RLock()

    @contextlib.contextmanager
    def moving(self) -> Iterator[list[tuple[int, int]]]:
        """Hold the map for one move: forget the arenas that are gone and yield the
        (first address, past the last) of the live ones."""
        with self._lock:
            self.prune()
            yield [(start, end) for start, end, _, _ in self._entries]

    def add(self, storage: torch.UntypedStorage, *, mappable: bool) -> None:
        """Record ``storage`` as an arena; ``mappable``: a same-node peer may map it."""
        base = storage.data_ptr()
        weak: int = storage._weak_ref()  # type: ignore[assignment]  # an int handle
        with self._lock:
            self._entries.append((base, base + storage.nbytes(), weak, mappable))

    def range_of(self, address: int) -> tuple[int, int] | None:
        """(first address, bytes) of the live arena holding ``address`` that a same-node
        peer can map, or None."""
        with self._lock:
            for start, end, weak, mappable in self._entries:
                if not mappable or not start <= address < end:
                    continue
                if not torch.UntypedStorage._expired(weak):  # type: ignore[attr-defined]
                    return start, end - start
        return None

    def shared(self, address: int) -> torch.Tensor | None:
        """The live arena holding ``address`` that a same-node peer can map, as a uint8
        tensor over all of it, or None."""
        with self._lock:
            for start, end, weak, mappable in self._entries:
                if mappable and start <= address < end:
                    storage = torch.UntypedStorage._new_with_weak_ptr(weak)  # type: ignore[attr-defined]
                    if storage is None:  # gone, and its range possibly reused
                        continue
                    out = torch.empty(0, dtype=torch.uint8, device=storage.device)
                    return out.set_(storage, 0, (end - start,), (1,))  # type: ignore[arg-type]
        return None

    def prune(self) -> None:
        """Forget the arenas that are gone (their last storage died)."""
        with self._lock:
            for entry in list(self._entries):
                if torch.UntypedStorage._expired(entry[2]):  # type: ignore[attr-defined]
                    torch.UntypedStorage._free_weak_ref(entry[2])  # type: ignore[attr-defined]
                    self._entries.remove(entry)

    def __len__(self) -> int:
        """The arenas recorded, live or not yet pruned."""
        return len(self._entries)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit torch may be gone first
            for entry in self._entries:
                torch.UntypedStorage._free_weak_ref(entry[2])  # type: ignore[attr-defined]
            self._entries = []


def shared_empty(nbytes: int, device: torch.device | str, *, reserve: bool = False) -> torch.Tensor:
    """An uninitialized uint8 buffer of ``nbytes`` that a same-node peer can map: on the CPU in
    shared memory, elsewhere as ``torch.empty`` makes it; plain memory where ``/dev/shm`` lacks
    room (a full tmpfs kills the writer with SIGBUS). ``reserve``: take the pages now, so that
    a lack of room shows here, with plain memory, not at a write."""
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


def share_storages(tensors: Iterable[torch.Tensor], *, arenas: ArenaMap, min_bytes: int = 0) -> int:
    """Move the DRAM storages behind ``tensors`` into one shared-memory arena, in place and in
    the order given, so that a same-node peer maps one file instead of one per storage;
    record the arena in ``arenas``. Returns the bytes moved.

    Data pointers taken before the move go stale; a moved storage cannot be resized and does
    not count as shared (``is_shared``). Storages of at least ``min_bytes`` move, up to half
    the free room of ``/dev/shm`` beyond ``SHM_SPARE_BYTES``; storages already shared or in
    an arena of ``arenas``, pinned, or not torch's own (``torch.from_numpy``'s) stay, as do
    tensors that are not strided.
    """
    with arenas.moving() as spans:
        storages = _host_storages(tensors, min_bytes, spans)
        room = (_shm_room() - SHM_SPARE_BYTES) // 2
        places: list[tuple[torch.UntypedStorage, int]] = []
        end = 0
        for storage in storages.values():  # a cache line apart; 4 KiB for 1 MiB and up
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
        arenas.add(arena, mappable=True)
        for storage, at in places:
            nbytes = storage.nbytes()
            ctypes.memmove(base + at, storage.data_ptr(), nbytes)
            # the storage takes its slice of the arena (which keeps the arena mapped); the
            # slice's storage takes the old memory and frees it as it goes
            storage._swap_data_ptr_(arena[at : at + nbytes])  # type: ignore[attr-defined]
        return sum(storage.nbytes() for storage, _ in places)


def _host_storages(
    tensors: Iterable[torch.Tensor], min_bytes: int, spans: list[tuple[int, int]]
) -> dict[int, torch.UntypedStorage]:
    """``share_storages``' candidates: {address: storage}, in the order first seen."""
    storages: dict[int, torch.UntypedStorage] = {}
    # pinned memory stays (host-to-device copies would lose their speed); only a process that
    # started CUDA has any, and asking elsewhere would start it
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
            and not (spans and any(a <= at < b for a, b in spans))
        ):
            storages.setdefault(at, storage)
    return storages


def gather_device_storages(
    tensors: Iterable[torch.Tensor],
    *,
    arenas: ArenaMap,
    max_bytes: int,
    arena_bytes: int = DEVICE_ARENA_BYTES,
    device: torch.device | str | None = None,
) -> int:
    """Move the CUDA (or CPU) storages behind ``tensors`` that are smaller than ``max_bytes``
    into arenas of up to ``arena_bytes``, in place and in the order given; record them in
    ``arenas``. Returns the bytes moved.

    A CUDA arena can be mapped by a same-node peer (CUDA IPC) as one block; a CPU arena is
    private memory (an engine's own parameters, whose copies then become a few strided ones),
    and storages in shared memory or pinned stay. Where torch cannot swap a storage's memory,
    the tensors given are re-pointed (``set_``) and a storage moves only if no other tensor
    holds it. Nothing may use the tensors while they move; at most ``arena_bytes`` are held
    twice at a time. Only storages on ``device`` move (None: the device of the first that may).
    """
    swap = hasattr(torch.UntypedStorage, "_swap_data_ptr_")
    with arenas.moving() as spans:
        where = None if device is None else torch.device(device)
        if where is not None and where.type == "cuda" and where.index is None:
            where = torch.device("cuda", torch.cuda.current_device())
        storages, users = _device_storages(tensors, max_bytes, spans, where)
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
                arenas,
            )
            if storages[group[0]].device.type == "cuda":
                torch.cuda.empty_cache()  # the segments the group's old blocks leave free
        return moved


def _device_storages(
    tensors: Iterable[torch.Tensor],
    max_bytes: int,
    spans: list[tuple[int, int]],
    device: torch.device | None,
) -> tuple[dict[int, torch.UntypedStorage], dict[int, dict[int, torch.Tensor]]]:
    """``gather_device_storages``' candidates on ``device`` (None: the first candidate's):
    {address: storage} (one wrapper each, and no other left behind) and {address: {id: each
    tensor given that uses it}}."""
    storages: dict[int, torch.UntypedStorage] = {}
    users: dict[int, dict[int, torch.Tensor]] = {}
    cuda = torch.cuda.is_initialized()  # pinned memory exists only then (asking would start it)
    starts = sorted(spans)
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
    storages: list[torch.UntypedStorage],
    users: list[list[torch.Tensor] | None],
    swap: bool,
    arenas: ArenaMap,
) -> int:
    """One arena for ``storages`` (of one device), each 256 bytes aligned: each
    storage's memory swapped for its slice of the arena (``swap``, while the build can), else
    each of its ``users`` re-pointed at the arena (None: something else holds the storage too,
    so it stays). The arena is recorded in ``arenas``."""
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
    arenas.add(whole, mappable=device.type == "cuda")  # a CPU one is private
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


def _shm_room() -> int:
    """Free bytes in ``/dev/shm`` (0 where there is none)."""
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize
