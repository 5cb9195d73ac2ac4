"""Copy planning: a list of (dst, src) pairs cut into the fewest launches their layouts allow.

Pairs are grouped by layout (worked out once per layout, ``_kind``), then taken in turn by
the cheapest kernel that fits: runs stepping evenly on both sides as one strided copy
(``_progressions``), on the CPU runs whose sources alone step evenly as one ``IndexedCopy``,
large pairs as a copy each, small rows as ``RowGather``s, the contiguous rest in batched
launches. Views are made only of the pairs copied one by one or batched; planning view by
view was rejected as too slow for 100,000 pairs.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import numpy as np
import torch

from vllm_dist.memory.kernels import (
    INT_OF_SIZE,
    IndexedCopy,
    RowGather,
    raw_tensor,
    widest_bytes,
    widest_views,
)

# A copy this large gets a kernel of its own; smaller contiguous ones share a batched launch
# (``_foreach_copy_``), which moves MiB-sized pairs slower than a memcpy each.
SOLO_COPY_BYTES = 256 << 10
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
    """The ``_Kind`` of pairs of ``layout`` (``plan_copies``): how ``widest_views`` and
    ``widest_bytes`` would see them, and whether their rows can be gathered."""
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
    gather = rowwise and dshape == sshape and ddev == sdev and size in INT_OF_SIZE
    offsets = (_row_offsets(dshape, dstr, size), _row_offsets(sshape, sstr, size))
    rows = 1 if not dshape else (numel // dshape[-1] if dshape[-1] else 0)  # 0: nothing to copy
    return _Kind(nbytes, False, gather, widths, rows, offsets if gather else None, contiguous)


def plan_copies(
    dsts: list[torch.Tensor], srcs: list[torch.Tensor], owners: list[torch.UntypedStorage]
) -> tuple[
    list[tuple[torch.Tensor, torch.Tensor]],
    list[tuple[list[torch.Tensor], list[torch.Tensor]]],
    list[RowGather | IndexedCopy],
    torch.device | None,
]:
    """``CopyProgram``'s plan: (solo pairs, batches per dtype, gathers, device); the storages
    the gathers see as raw address ranges are added to ``owners``."""
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
            dst, src = widest_bytes(dst, src, kind.nbytes)
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
            size, row = _row_of(kind, dst, src, d, s)
            rows.setdefault((layout[6], kind.flat, size, row), []).append((i, kind, d, s))
    for key, members in rows.items():
        _gather_rows(key, members, dsts, srcs, gathers, owners, batch, solo)
    return solo, list(batches.values()), gathers, device


def _row_of(kind: _Kind, dst: torch.Tensor, src: torch.Tensor, d: int, s: int) -> tuple[int, int]:
    """(element size, row length in elements) a ``RowGather`` moves a pair of ``kind`` as:
    the widest element its addresses ``d``, ``s`` (flat) or storage offsets (strided) allow."""
    if kind.flat:
        size = 1
        for size in kind.widths:
            if d % size == 0 and s % size == 0:
                break
        return size, kind.nbytes // size
    item = dst.element_size()
    do, so = int(dst.storage_offset()), int(src.storage_offset())
    for size in kind.widths:
        ratio = max(1, size // item)
        if do % ratio == 0 and so % ratio == 0:
            break
    return size, int(dst.shape[-1]) * item // size


def _gather_rows(
    key: tuple[Any, ...],
    members: list[_Member],
    dsts: list[torch.Tensor],
    srcs: list[torch.Tensor],
    gathers: list[RowGather | IndexedCopy],
    owners: list[torch.UntypedStorage],
    batch: Callable[[int, _Kind], None],
    solo: list[tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """The pairs ``members`` of one (device, flat, element size, row length) ``key`` as
    ``RowGather``s, one per run (``_runs``) of ``GATHER_MIN_PAIRS`` or more; the pairs of a
    run no gather takes are batched (flat) or copied one by one."""
    dev, flat, size, row = key
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
    take. A side that spans allocations is seen through a raw view of its range
    (``_strided_run``; the pairs' storages are then added to ``owners``)."""

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

    A side that spans allocations is a view of a raw tensor over the range (``raw_tensor``,
    owning nothing): it touches exactly the pairs' elements, since they step evenly, and a
    copy kernel, unlike a CUDA memcpy, does not mind several allocations."""
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
        as_int = INT_OF_SIZE.get(size)
        if as_int is None or (first.data_ptr() - base) % size:
            return None
        raw = raw_tensor(base, lead + reach + 1, as_int, first.device)
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
    whose sources step by one constant in one storage while their destinations lie anywhere:
    one ``IndexedCopy`` each, added to ``gathers`` and ``taken``, their storages to
    ``owners``."""

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
    another in memory, each then into ``_parts``; the pairs of shorter runs stay together.

    A run's rows are one block on that side, so its ``RowGather`` is one kernel with no
    staging, where a gather over rows of two kinds taking turns in a slot would stage every
    row. A run is cut out only with ``GATHER_MIN_PAIRS`` pairs and ``GATHER_RUN_BYTES``; the
    side whose runs cover more bytes is cut (neither when one side is one block already)."""
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
