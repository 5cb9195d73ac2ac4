"""The memory layer: copy kernels, copy planning, copy programs, storage arenas and the
objects that own their bookkeeping (``ArenaMap``, ``StreamPool``)."""

from __future__ import annotations

import gc
import itertools
import threading
from typing import Any

import numpy as np
import pytest
import torch

from tests.utils import cuda_device_count
from vllm_dist.memory import (
    GRAPH_BRANCHES,
    SOLO_COPY_BYTES,
    ArenaMap,
    CopyProgram,
    IndexedCopy,
    StreamPool,
    arenas,
    balance,
    batched_copy,
    copyplan,
    gather_device_storages,
    share_storages,
    shared_empty,
    widest_views,
)
from vllm_dist.memory import programs as program_module
from vllm_dist.memory.arenas import _repoint
from vllm_dist.memory.kernels import raw_tensor


def test_widest_views_and_batched_copy() -> None:

    full = torch.arange(64 * 96, dtype=torch.int16).view(64, 96).view(torch.bfloat16)
    cols = full[:, 32:64]  # a row-parallel slice: rows of 64 bytes at a stride of 192 bytes
    dst = torch.empty(64, 32, dtype=torch.bfloat16)
    wide_dst, wide_src = widest_views(dst, cols)
    assert wide_dst.dtype == torch.int64 and wide_src.stride() == (24, 1)
    odd = full[:, 3:35]  # a start that no wider type divides: left as it is
    assert widest_views(dst, odd)[0].dtype == torch.bfloat16
    assert widest_views(dst.t(), cols.t())[0].dtype == torch.bfloat16  # transposed: not rows
    both = torch.zeros(64, 32, dtype=torch.bfloat16), full[:, :32].contiguous()
    assert widest_views(*both)[0].dtype == torch.bfloat16  # contiguous: copy_ is a memcpy
    outs = [torch.zeros(64, 32, dtype=torch.bfloat16) for _ in range(4)]
    transposed = torch.zeros(32, 64, dtype=torch.bfloat16)
    srcs = [cols, odd, full[:, :32].contiguous(), full[:5, 7:39]]
    batched_copy([outs[0], outs[1], outs[2], outs[3][:5], transposed.t()], [*srcs, cols])
    for out, src in zip(outs[:3], srcs[:3], strict=True):
        assert torch.equal(out.view(torch.int16), src.view(torch.int16))
    assert torch.equal(outs[3][:5].view(torch.int16), srcs[3].view(torch.int16))
    assert torch.equal(transposed.t().view(torch.int16), cols.view(torch.int16))


def _copy_program_case(device: str) -> None:
    pool = StreamPool()

    gen = torch.Generator().manual_seed(3)
    full = torch.randint(-(1 << 15), 1 << 15, (64, 96), dtype=torch.int16, generator=gen)
    full = full.to(device)
    raw = torch.randint(0, 256, (SOLO_COPY_BYTES + 4096,), dtype=torch.uint8, generator=gen)
    raw = raw.to(device)
    srcs = [
        full[:, 32:64],  # strided: a kernel of its own, widened
        full[:, :32].contiguous(),  # contiguous int16: batched as int64
        raw[1:334],  # misaligned, odd length: batched as bytes
        raw[:SOLO_COPY_BYTES],  # large: its own kernel
        full.view(torch.bfloat16)[:5, 7:39],  # strided, no wider type fits
        full[0, :0],  # empty: skipped
    ]
    dsts = [torch.zeros_like(s, memory_format=torch.contiguous_format) for s in srcs]
    dsts[4] = torch.zeros(39, 5, dtype=torch.bfloat16, device=device)[7:].t()  # transposed
    program = CopyProgram(dsts, srcs, streams=pool)
    for step in range(3):
        program.run()
        for d, s in zip(dsts, srcs, strict=True):
            assert torch.equal(d.cpu(), s.cpu()), (step, s.shape)
        full.add_(1)  # new contents, same places: the next run copies them
        raw.add_(1)
    assert program.graphed is (device != "cpu") and program.graph_error is None
    program.close()


def test_copy_program_cpu() -> None:
    _copy_program_case("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(cuda_device_count() < 1, reason="needs a CUDA device")
def test_copy_program_cuda_graph() -> None:
    _copy_program_case("cuda")


def _merged_program_case(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = StreamPool()

    gen = torch.Generator().manual_seed(5)
    experts = torch.randint(-100, 100, (60, 32, 64), dtype=torch.int16, generator=gen)
    experts = experts.to(device)
    big = torch.randint(-100, 100, (SOLO_COPY_BYTES // 2 + 64,), dtype=torch.int16, generator=gen)
    big = big.to(device)
    floats = torch.randn(7, 33, generator=gen).to(device)
    scattered = torch.zeros(60, 32, 64, dtype=torch.int16, device=device)
    slot = torch.zeros(60, 32, 16, dtype=torch.int16, device=device)
    staging: list[torch.Tensor] = []

    def stage(nbytes: int) -> torch.Tensor:  # one buffer that grows, as a pair's does
        if not staging or staging[0].numel() < nbytes:
            staging[:] = [torch.empty(nbytes, dtype=torch.uint8, device=device)]
        return staging[0]

    parts: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
    perm = torch.randperm(60, generator=gen).tolist()  # sources out of step: rows gathered
    for k in range(3):  # three chunks' programs, each with every kind of copy
        e = range(20 * k, 20 * k + 20)
        dsts = [slot[i] for i in e] + [scattered[i, :, 16:48] for i in e]
        srcs = [experts[perm[i], :, 48:] for i in e] + [experts[perm[i], :, :32] for i in e]
        dsts += [
            torch.zeros(33, device=device),
            torch.zeros(5, 64, dtype=torch.int16, device=device),
        ]
        srcs += [floats[k], experts[k, :5]]
        if k == 1:
            dsts.append(torch.zeros_like(big))
            srcs.append(big)  # a copy of its own
        parts.append((dsts, srcs))
    programs = [CopyProgram(d, s, staging=stage) for d, s in parts]
    assert all(sorted(bool(g.staging_bytes) for g in p._gathers) == [False, True] for p in programs)

    def no_plan(*_: object) -> None:
        raise AssertionError("merged programs plan nothing")

    monkeypatch.setattr(program_module, "plan_copies", no_plan)
    merged = CopyProgram.merged(programs, streams=pool)
    assert (
        len(merged._gathers) == 6 and len(merged._batches) == 2
    )  # contiguous pairs seen as int64 and int32
    for step in range(3):
        for t in (experts, big, floats):
            t.add_(step + 1)
        merged.run()
        for dsts, srcs in parts:
            for d, s in zip(dsts, srcs, strict=True):
                assert torch.equal(d.cpu(), s.cpu()), (step, s.shape)
    assert merged.graphed is (device != "cpu") and merged.graph_error is None
    programs[0].run()  # the chunks' own programs still work (not at the same time)
    merged.close()


def test_copy_program_merged_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """``CopyProgram.merged``: the copies of several programs (gathers that stage sharing a
    pair's buffer, batches of two dtypes, a copy of its own) in one, planning nothing."""
    _merged_program_case("cpu", monkeypatch)


@pytest.mark.gpu
@pytest.mark.skipif(cuda_device_count() < 1, reason="needs a CUDA device")
def test_copy_program_merged_cuda_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    _merged_program_case("cuda", monkeypatch)


def _progressions_case(device: str) -> None:
    amap = ArenaMap()
    pool = StreamPool()

    gen = torch.Generator().manual_seed(9)
    flat = torch.randint(-100, 100, (40 * 3 * 256,), dtype=torch.int16, generator=gen).to(device)
    experts = flat.view(40, 3, 16, 16)  # a trainer's flat buffer: gate, up, down per expert
    w13 = torch.zeros(40, 2, 8, 16, dtype=torch.int16, device=device)  # fused, TP-2 shard
    w2 = torch.zeros(40, 16, 8, dtype=torch.int16, device=device)
    dsts: list[torch.Tensor] = []
    srcs: list[torch.Tensor] = []
    for e in range(40):  # gate and up take turns (one layout): each steps evenly on its own
        dsts += [w13[e, 0], w13[e, 1], w2[e]]
        srcs += [experts[e, 0, :8], experts[e, 1, :8], experts[e, 2, :, 8:]]
    loose = [torch.zeros(16, 8, dtype=torch.int16, device=device) for _ in range(6)]
    assert gather_device_storages(loose, arenas=amap, max_bytes=1 << 20) == 6 * 256  # 256 B apart
    dsts += loose  # separate allocations stepping evenly: one strided copy through a raw view
    srcs += [experts[e, 2, :, :8] for e in range(6)]
    uneven = torch.zeros(16, 8, 16, dtype=torch.int16, device=device)
    dsts += [uneven[i] for i in (0, 1, 2, 3, 4, 6, 8, 10, 12, 14)]  # the step changes once
    srcs += [experts[i, 0, 8:] for i in range(10)]
    program = CopyProgram(dsts, srcs, streams=pool)
    # gate, up, down, loose: one copy each; uneven: 0..4 and 4..14 share pair 4, which one takes
    runs = sorted(d.shape[0] for d, _ in program._solo if d.dim() == 3)
    assert runs == [5, 5, 6, 40, 40, 40], [tuple(d.shape) for d, _ in program._solo]
    if len({t.untyped_storage().data_ptr() for t in loose}) > 1:  # moved by swaps: raw views
        assert any(o.data_ptr() == loose[0].data_ptr() for o in program._owners)
    for step in range(2):
        flat.add_(step + 1)
        program.run()
        for d, s in zip(dsts, srcs, strict=True):
            assert torch.equal(d.cpu(), s.cpu()), (step, tuple(s.shape))
    program.close()


def test_copy_program_progressions_cpu() -> None:
    """Pairs of one layout whose addresses step evenly on both sides (expert shards between a
    flat trainer buffer and fused expert tensors) become one strided copy per run."""
    _progressions_case("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(cuda_device_count() < 1, reason="needs a CUDA device")
def test_copy_program_progressions_cuda_graph() -> None:
    _progressions_case("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(cuda_device_count() < 1, reason="needs a CUDA device")
def test_copy_program_graph_branches() -> None:
    """More launches than the graph has branches (strided weight shards of several MiB, a
    batch of small contiguous pairs): the branches fork after the work queued before ``run``
    (each run copies the contents written just before it) and join before the work queued
    after it (a sum taken right after ``run``, no synchronize, sees every byte)."""
    pool = StreamPool()

    gen = torch.Generator().manual_seed(11)
    fulls = [
        torch.randint(-100, 100, (512, 1024 + 256 * i), dtype=torch.int16, generator=gen).cuda()
        for i in range(2 * GRAPH_BRANCHES + 3)
    ]
    experts = torch.randint(-100, 100, (40, 32, 64), dtype=torch.int16, generator=gen).cuda()
    srcs = [f[:, : f.shape[1] // 2] for f in fulls]  # row-parallel shards, 0.5-2.5 MiB
    srcs += [torch.arange(64 * i, 64 * i + 50, dtype=torch.int16).cuda() for i in range(5)]
    order = torch.randperm(40, generator=gen).tolist()  # out of step: not one strided copy
    srcs += [experts[i, :, 48:] for i in order[:20]]  # a RowGather into a slot: no staging
    srcs += [experts[i, :, :32] for i in order[20:]]  # into strided places: a staging RowGather
    dsts = [torch.zeros(s.shape, dtype=s.dtype, device="cuda") for s in srcs[:-40]]
    slot = torch.zeros(20, 32, 16, dtype=torch.int16, device="cuda")
    dsts += list(slot)
    scattered = torch.zeros(20, 32, 64, dtype=torch.int16, device="cuda")
    dsts += [t[:, 16:48] for t in scattered]
    program = CopyProgram(dsts, srcs, streams=pool)
    assert sorted(bool(g.staging_bytes) for g in program._gathers) == [False, True]
    where = balance([n for n, _ in program._units], GRAPH_BRANCHES)
    assert len(where) > GRAPH_BRANCHES and set(where) == set(range(GRAPH_BRANCHES))
    for step in range(3):
        for t in [*fulls, experts]:
            t.add_(step + 1)  # queued on the current stream just before the copies
        program.run()
        got = torch.stack([d.sum(dtype=torch.int64) for d in dsts])  # queued right after
        want = torch.stack([s.sum(dtype=torch.int64) for s in srcs])
        assert torch.equal(got.cpu(), want.cpu()), step
        for d, s in zip(dsts, srcs, strict=True):
            assert torch.equal(d.cpu(), s.cpu()), step
    assert program.graphed and program.graph_error is None
    program.close()


def test_balance_spreads_units_over_branches() -> None:
    """Largest first, each unit to the branch with the fewest bytes so far: branches end
    together, each unit is on exactly one branch, and no more branches than units."""

    assert balance([], 8) == []
    assert balance([7, 3], 8) == [0, 1]
    assert balance([5, 1, 1, 1, 1, 1], 2) == [0, 1, 1, 1, 1, 1]
    sizes = [(i * 7919) % 1000 + 1 for i in range(100)]
    where = balance(sizes, 8)
    loads = [sum(n for n, b in zip(sizes, where, strict=True) if b == k) for k in range(8)]
    assert set(where) == set(range(8)) and max(loads) - min(loads) <= max(sizes)


def _row_gather_case(device: str, staging: int | None = None) -> None:
    """Many small pairs, as the packs and unpacks of 100,000 expert shards make them: each
    group of one element size and row length (a contiguous pair is one row) runs as one
    ``RowGather`` (one or two kernels), whatever the layouts of its pairs; every byte lands where
    ``copy_`` would put it, over several runs with changing contents, into destinations on
    and off the row grid. ``staging``: a smaller staging cap, so groups split into several
    gathers that share one buffer."""
    pool = StreamPool()

    if staging is not None:
        copyplan.GATHER_STAGING_BYTES, saved = staging, copyplan.GATHER_STAGING_BYTES
        try:
            _row_gather_case(device)
        finally:
            copyplan.GATHER_STAGING_BYTES = saved
        return

    gen = torch.Generator().manual_seed(5)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randint(-(1 << 15), 1 << 15, shape, dtype=torch.int16, generator=gen).to(
            device
        )

    # out of allocation order: separate allocations that happen to step evenly would be one
    # strided copy (``_progressions``), not a gather
    experts = [rand(32, 64).view(torch.bfloat16) for _ in range(40)]
    experts = [experts[i] for i in torch.randperm(40, generator=gen).tolist()]
    cube = rand(6, 8, 40)  # 3-D: rows of 16 int16 at two strides
    srcs = [e[:, 32:] for e in experts[:20]]  # packs: rows of 64 bytes -> int64
    # int64 rows; out of order, or the six would step evenly and be one strided copy
    srcs += [cube[i, :, 8:24] for i in (0, 2, 1, 4, 3, 5)] + [cube[:, 2:5, 24:40]] * 2
    srcs += [e[3:9, 2:8] for e in experts[20:32]]  # rows of 12 bytes -> int32, row 3
    srcs += [e[:4, 5:6] for e in experts[33:]]  # too few of this kind (< 8): one kernel each
    blobs = [rand(100) for _ in range(9)]  # contiguous, 200 bytes: one row of 25 int64
    srcs += [blobs[i] for i in (0, 5, 2, 7, 3, 8, 1, 6, 4)]  # no run of 4 stepping evenly
    slot = torch.zeros(1 << 16, dtype=torch.uint8, device=device)
    dsts, offset = [], 24
    for s in srcs:  # 16-byte aligned: the 12- and 200-byte rows fall off their grid
        n = s.numel() * s.element_size()
        dsts.append(slot[offset : offset + n].view(s.dtype).view(s.shape))
        offset += -(-n // 16) * 16
    unpacked: list[torch.Tensor] = [torch.empty(0)] * 20  # slot rows -> strided, on grid
    for i in torch.randperm(20, generator=gen).tolist():  # allocated out of step
        unpacked[i] = torch.zeros_like(experts[i])
    unpack = CopyProgram([u[:, :32] for u in unpacked], dsts[:20], streams=pool)
    program = CopyProgram(dsts, srcs, streams=pool)
    split = copyplan.GATHER_STAGING_BYTES < 1 << 20
    kinds = sorted(
        {(str(g._window.dtype), g._window.shape[1], g._target.dim()) for g in program._gathers}
    )  # (element, row length, 2: rows written whole or 1: element by element)
    off_grid = 2 if device == "cpu" else 1  # on the CPU, rows of a window over the slot
    assert kinds == [
        ("torch.int32", 3, off_grid),
        ("torch.int64", 4, 2),
        ("torch.int64", 8, 2),
        ("torch.int64", 25, off_grid),  # 200 bytes at steps of 208: off the grid
    ], kinds
    windows = sorted(str(g._window.dtype) for g in program._gathers if g._target.stride() == (1, 1))
    assert windows == (["torch.int32", "torch.int64"] if device == "cpu" else []), windows
    # rows that follow one another in the slot are written (packs) or read (unpacks) in
    # place, one kernel; rows the slot's padding keeps apart go through the staging buffer
    staged = sorted(
        {(str(g._window.dtype), g._window.shape[1]) for g in program._gathers if g.staging_bytes}
    )
    assert staged == [("torch.int32", 3), ("torch.int64", 25)], staged
    assert all(g.kernels == 1 for g in unpack._gathers)
    if not split:
        assert len(program._gathers) == 4
    else:  # split: one buffer, as large as the largest part
        assert len(program._gathers) > 4
        buffers = {
            g._staging.untyped_storage().data_ptr() for g in program._gathers if g.staging_bytes
        }
        assert len(buffers) == 1
        assert all(g.staging_bytes <= copyplan.GATHER_STAGING_BYTES for g in program._gathers)
    # both sides one block each: one strided copy (``_progressions``); as a gather (pairs of
    # separate allocations that happen to be adjacent, which no view may span), one kernel
    whole = rand(900)
    out = torch.zeros_like(whole)
    block = CopyProgram(
        [out[i * 100 : (i + 1) * 100] for i in range(9)],
        [whole[i * 100 : (i + 1) * 100] for i in range(9)],
        streams=pool,
    )
    assert not block._gathers and [d.shape[0] for d, _ in block._solo] == [9]
    block.run()
    assert torch.equal(out.cpu(), whole.cpu())
    block.close()
    out.zero_()
    copyplan.STRIDE_MIN_PAIRS, saved = 1 << 30, copyplan.STRIDE_MIN_PAIRS
    try:
        block = CopyProgram(
            [out[i * 100 : (i + 1) * 100] for i in range(9)],
            [whole[i * 100 : (i + 1) * 100] for i in range(9)],
            streams=pool,
        )
    finally:
        copyplan.STRIDE_MIN_PAIRS = saved
    assert [g.kernels for g in block._gathers] == [1]
    # on CUDA by a kernel: a memcpy refuses a range over two allocations that happen to be
    # adjacent (separately allocated parameters, seen as one block)
    assert (block._gathers[0]._src_rows is None) is (device != "cpu")
    block.run()
    assert torch.equal(out.cpu(), whole.cpu())
    block.close()
    # split: 8 experts a part, the last 4 alone
    assert len(program._solo) == 7 + 4 * split
    if device == "cpu":  # the unpack's sources step evenly through the slot: one index_copy_
        assert [type(g).__name__ for g in unpack._gathers] == ["IndexedCopy"], unpack._gathers
        assert not unpack._solo
    else:
        assert len(unpack._solo) == 4 * split and len(unpack._gathers) == 1 + split
    for step in range(3):
        program.run()
        unpack.run()
        for i, (d, s) in enumerate(zip(dsts, srcs, strict=True)):  # bits: random bf16 has NaNs
            assert torch.equal(d.view(torch.int16).cpu(), s.view(torch.int16).cpu()), (step, i)
        for u, e in zip(unpacked, experts[:20], strict=True):
            u, e = u.view(torch.int16), e.view(torch.int16)
            assert torch.equal(u[:, :32].cpu(), e[:, 32:].cpu()) and not u[:, 32:].any()
        for t in [*experts, cube]:
            t.add_(1)
    for p in (program, unpack):
        assert p.graphed is (device != "cpu") and p.graph_error is None
        p.close()


@pytest.mark.parametrize("staging", [None, 16 << 10])
def test_row_gather_cpu(staging: int | None) -> None:
    _row_gather_case("cpu", staging)


@pytest.mark.gpu
@pytest.mark.skipif(cuda_device_count() < 1, reason="needs a CUDA device")
@pytest.mark.parametrize("staging", [None, 16 << 10])
def test_row_gather_cuda_graph(staging: int | None) -> None:
    _row_gather_case("cuda", staging)


def _row_gather_runs_case(device: str) -> None:
    """A sync's packs and unpacks of expert shards as one program: two kinds of rows take
    turns in the slot, chunk after chunk (contiguous halves of w1, row-parallel halves of w2).
    Each kind is cut where its slot rows stop following one another, so every gather is one
    kernel with no staging, on the pack (slot rows written as a block) and the unpack (read as
    a block); every byte lands where ``copy_`` would put it. Runs too short to earn a gather
    stay pooled (never a kernel per pair), and a side that is one block is never cut."""
    pool = StreamPool()

    gen = torch.Generator().manual_seed(7)
    chunks = 3
    per_kind = copyplan.GATHER_RUN_BYTES // 2048 + 1  # 2 KiB shards: a run just over the bar

    def rand(*shape: int) -> torch.Tensor:
        t = torch.randint(-(1 << 15), 1 << 15, shape, dtype=torch.int16, generator=gen)
        return t.to(device).view(torch.bfloat16)

    # out of allocation order (else runs of separate allocations stepping evenly would be
    # strided copies, not gathers)
    w1 = [rand(64, 32) for _ in range(chunks * per_kind)]
    w1 = [w1[i] for i in torch.randperm(len(w1), generator=gen).tolist()]
    w2 = [rand(32, 64) for _ in range(chunks * per_kind)]
    w2 = [w2[i] for i in torch.randperm(len(w2), generator=gen).tolist()]
    srcs = []
    for c in range(chunks):  # a chunk lays its kinds side by side; the next chunk follows
        srcs += [t[:32] for t in w1[c * per_kind : (c + 1) * per_kind]]
        srcs += [t[:, :32] for t in w2[c * per_kind : (c + 1) * per_kind]]
    slot = torch.zeros(sum(s.numel() for s in srcs), dtype=torch.bfloat16, device=device)
    dsts, offset = [], 0
    for s in srcs:
        dsts.append(slot[offset : offset + s.numel()].view(s.shape))
        offset += s.numel()
    # the engine's layout: w1 halves whole parameters, w2 halves the columns of one
    params: list[torch.Tensor] = [torch.empty(0)] * len(srcs)
    for i in torch.randperm(len(srcs), generator=gen).tolist():  # allocated out of step
        s = srcs[i]
        params[i] = (
            torch.zeros_like(s) if s.is_contiguous() else torch.zeros_like(s).repeat(1, 2)[:, :32]
        )
    pack, unpack = CopyProgram(dsts, srcs, streams=pool), CopyProgram(params, dsts, streams=pool)
    for program in (pack, unpack):
        assert len(program._gathers) == 2 * chunks, len(program._gathers)
        assert all(g.kernels == 1 and not g.staging_bytes for g in program._gathers)
        assert not program._solo and not program._batches
    for _step in range(2):
        pack.run()
        unpack.run()
        for p, d, s in zip(params, dsts, srcs, strict=True):
            assert torch.equal(d.view(torch.int16).cpu(), s.view(torch.int16).cpu())
            assert torch.equal(p.view(torch.int16).cpu(), s.view(torch.int16).cpu())
        for t in w1 + w2:
            t.view(torch.int16).add_(3)
    pack.close()
    unpack.close()
    # runs of 7 and 9 small strided shards: below the bar, all in one staged gather as before
    small = [t[:, :8] for t in w2[:64]]
    gaps = torch.zeros(64 * 512, dtype=torch.bfloat16, device=device)
    places, offset = [], 0
    for i, s in enumerate(small):
        offset += 256 if i % 16 in (0, 7) else 0  # a gap before each run
        places.append(gaps[offset : offset + s.numel()].view(s.shape))
        offset += s.numel()
    short = CopyProgram(places, small, streams=pool)
    assert len(short._gathers) == 1 and not short._solo, (len(short._gathers), len(short._solo))
    # sources one block, destinations in two long runs: one gather, not one per run
    n = 2 * per_kind
    whole = rand(n * 32, 32)
    froms = [whole[i * 32 : (i + 1) * 32] for i in range(n)]
    spaced = torch.zeros(n * 1024 + 256, dtype=torch.bfloat16, device=device)
    tos = [spaced[i * 1024 + 256 * (i >= per_kind) :][:1024].view(32, 32) for i in range(n)]
    # each run steps evenly on both sides: a strided copy
    block = CopyProgram(tos, froms, streams=pool)
    assert not block._gathers and [d.shape[0] for d, _ in block._solo] == [per_kind] * 2
    for program in (short, block):
        program.run()
        program.close()
    for to, fro in zip(tos, froms, strict=True):
        assert torch.equal(to.view(torch.int16).cpu(), fro.view(torch.int16).cpu())
    for place, s in zip(places, small, strict=True):
        assert torch.equal(place.view(torch.int16).cpu(), s.view(torch.int16).cpu())


def test_row_gather_runs_cpu() -> None:
    _row_gather_runs_case("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(cuda_device_count() < 1, reason="needs a CUDA device")
def test_row_gather_runs_cuda_graph() -> None:
    _row_gather_runs_case("cuda")


def test_copy_program_keeps_gathered_memory_and_stages_per_device() -> None:
    """A ``CopyProgram`` keeps the storages its gathers see as raw address ranges: a
    destination its owner re-points after planning (``t.data = ...``) gets no write, and the
    run touches no freed memory (destinations of 200 KB: freed, they are unmapped). Gathers of
    a program whose pairs span two devices each stage on their own device."""

    n = 50_000
    dsts = [torch.zeros(n) for _ in range(8)]
    whole = torch.randn(8 * n)
    program = CopyProgram(dsts, [whole[k * n : (k + 1) * n] for k in range(8)])
    # one gather, or one strided copy through raw views where the allocations step evenly
    assert len(program._gathers) + len(program._solo) == 1
    for d in dsts:
        d.data = torch.zeros(n)  # re-pointed: the planned storage has no other owner
    gc.collect()
    program.run()
    assert all(not d.any() for d in dsts)

    full = torch.randn(10, 8, 32)
    out = torch.zeros(10, 8, 32)
    meta = torch.empty(10, 8, 32, device="meta")
    perm = [3, 0, 7, 1, 9, 2, 5, 8, 4, 6]  # sources out of step: rows gathered
    program = CopyProgram(
        [out[k, :, 16:] for k in range(10)] + [meta[k, :, 16:] for k in range(10)],
        [full[k, :, :16] for k in perm] + [meta[k, :, :16] for k in perm],
    )
    staged = [g for g in program._gathers if g.staging_bytes]
    assert staged and all(
        g._staging is not None and g._staging.device.type == "cpu" for g in staged
    )
    program.run()
    assert torch.equal(out[:, :, 16:], full[perm, :, :16])


def test_row_gather_views_and_refusals() -> None:
    """The flat views a ``RowGather`` reads through alias the memory they were given; a range
    that cannot be viewed, or a device without raw views, gives None (pairs copied one by
    one) instead of an error."""

    owner = torch.arange(10, dtype=torch.int64)
    flat = raw_tensor(owner.data_ptr() + 8, 9, torch.int64, torch.device("cpu"))
    assert flat is not None and flat.tolist() == list(range(1, 10))
    flat[0] = 42  # the same bytes
    assert owner[1] == 42
    assert raw_tensor(4096, 1 << 60, torch.int64, torch.device("cpu")) is None
    assert raw_tensor(owner.data_ptr(), 10, torch.int64, torch.device("meta")) is None


def test_shared_empty_is_in_shared_memory_where_there_is_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the CPU a buffer a peer can map; plain memory where /dev/shm lacks room (a full
    tmpfs would kill the writer with SIGBUS) and off the CPU."""

    buf = shared_empty(1 << 20, "cpu")
    assert buf.dtype == torch.uint8 and buf.numel() == 1 << 20
    assert buf.untyped_storage().is_shared()
    buf.fill_(7)  # writable, every page
    assert int(buf[-1]) == 7
    monkeypatch.setattr(arenas, "_shm_room", lambda: 0)
    assert not shared_empty(1 << 20, "cpu").untyped_storage().is_shared()
    assert shared_empty(0, "cpu").numel() == 0


def test_share_storages_moves_cpu_storages_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's tensors keep their identity and values and see the new memory (views
    too), all in one shared-memory arena laid out in the order given; storages under
    ``min_bytes``, already moved, or not torch's own (numpy's, whose array would be left
    behind) stay; nothing moves without room; the arena goes once its storages are gone."""
    amap = ArenaMap()

    big = torch.nn.Parameter(torch.arange(4096, dtype=torch.float32))
    view = big.detach()[10:20]
    mid = torch.arange(2048, dtype=torch.float32)
    small = torch.ones(4)
    array = np.zeros(4096, dtype=np.float32)
    borrowed = torch.from_numpy(array)
    before = big.data_ptr()
    moved = share_storages([mid, big, view, small, borrowed], arenas=amap, min_bytes=1024)
    assert moved == big.untyped_storage().nbytes() + mid.untyped_storage().nbytes()
    arena = amap.shared(big.data_ptr())
    assert arena is not None and arena.untyped_storage().is_shared() and big.data_ptr() != before
    # in the order given, a cache line apart at least: mid first, then big
    assert mid.data_ptr() == arena.data_ptr() and big.data_ptr() == arena.data_ptr() + 8192
    assert amap.shared(arena.data_ptr() + arena.numel()) is None  # past its end
    assert torch.equal(big.detach(), torch.arange(4096, dtype=torch.float32))
    assert torch.equal(mid, torch.arange(2048, dtype=torch.float32))
    big.data.add_(1)  # the view is of the moved storage: it sees the trainer's writes
    assert view.tolist() == [float(i + 1) for i in range(10, 20)]
    assert arena[8192 + 40 : 8192 + 44].view(torch.float32).item() == 11.0  # so does the arena
    assert amap.shared(small.data_ptr()) is None  # under min_bytes
    assert share_storages([mid, big], arenas=amap) == 0  # already in an arena: they stay
    assert share_storages([borrowed], arenas=amap) == 0
    assert amap.shared(array.ctypes.data) is None
    assert share_storages([mid.to_sparse()], arenas=amap) == 0  # no storage of its own to move
    borrowed.fill_(3)
    assert array[0] == 3  # still the array's memory
    # its place in the arena is all a moved storage has: as torch.frombuffer's, it cannot grow
    with pytest.raises(RuntimeError, match="not resizable"):
        mid.resize_(4096)
    monkeypatch.setattr(arenas, "_shm_room", lambda: 0)
    assert share_storages([small], arenas=amap) == 0 and amap.shared(small.data_ptr()) is None
    monkeypatch.undo()
    start = arena.data_ptr()
    del arena
    gc.collect()
    assert amap.shared(start) is not None  # its storages hold it
    del big, view, mid
    gc.collect()
    assert amap.shared(start) is None  # gone with the last of them
    assert amap.range_of(start) is None


@pytest.mark.gpu
@pytest.mark.skipif(cuda_device_count() < 1, reason="needs a CUDA device")
def test_gather_device_storages_moves_small_vram_storages_in_place() -> None:
    """The trainer's small CUDA tensors keep identity and values and lie one after another, in
    the order given, in arenas of at most ``arena_bytes``; views given along move with them;
    storages of ``max_bytes`` and up, on the CPU, or already moved stay; a storage with a view
    the caller did not give moves (the view follows) where torch swaps storages' memory, and
    stays where it cannot; the arenas can be mapped by a same-node peer (CUDA IPC) and go with
    the last tensor moved into them."""
    amap = ArenaMap()
    from vllm_dist.implementations.communicators.nixl_rdt import CudaIpcHandle

    swap = hasattr(torch.UntypedStorage, "_swap_data_ptr_")
    experts = [torch.nn.Parameter(torch.full((64, 32), float(i), device="cuda")) for i in range(40)]
    big = torch.arange(1 << 18, dtype=torch.float32, device="cuda")  # 1 MiB: stays
    host = torch.ones(64)
    spare = torch.zeros(64, device="cuda")
    view = spare[8:16]  # given too: moves with it
    kept = torch.zeros(64, device="cuda")
    outside = kept[1:]  # not given
    before = kept.data_ptr()
    moved = gather_device_storages(
        [*experts, big, host, spare, view, kept],
        arenas=amap,
        max_bytes=1 << 20,
        arena_bytes=16 * 8192,
    )
    assert moved == 40 * 8192 + 256 + (256 if swap else 0)
    first = amap.shared(experts[0].data_ptr())
    assert first is not None and first.is_cuda and first.numel() == 16 * 8192
    for i, e in enumerate(experts):  # 16 to an arena, each right after the one before
        assert e.data_ptr() == experts[i // 16 * 16].data_ptr() + (i % 16) * 8192
        assert torch.equal(e.detach(), torch.full((64, 32), float(i), device="cuda"))
    assert amap.range_of(experts[16].data_ptr()) != amap.range_of(experts[0].data_ptr())
    assert amap.shared(big.data_ptr()) is None and amap.shared(host.data_ptr()) is None
    assert amap.range_of(spare.data_ptr()) is not None
    spare.add_(1)
    assert view.tolist() == [1.0] * 8 and view.data_ptr() == spare.data_ptr() + 32
    assert (kept.data_ptr() != before) is swap and (amap.shared(before) is None) is not swap
    kept.add_(2)
    assert outside.tolist() == [2.0] * 63  # it sees the tensor's memory, old or new
    experts[3].data.add_(1)  # the arena sees the trainer's writes
    assert first[3 * 8192 : 3 * 8192 + 4].view(torch.float32).item() == 4.0
    assert gather_device_storages(experts, arenas=amap, max_bytes=1 << 20) == 0  # already moved
    handle = CudaIpcHandle.of(first)  # what a consumer maps: the arena, a block of its own
    assert handle.rebuild is not None
    start = first.data_ptr()
    del first, handle
    gc.collect()
    assert amap.shared(start) is not None  # its tensors hold it
    del experts
    gc.collect()
    assert amap.range_of(start) is None


@pytest.mark.skipif(
    not hasattr(torch.UntypedStorage, "_swap_data_ptr_"), reason="needs storage swaps (torch 2.12+)"
)
def test_gather_device_storages_lays_cpu_storages_out_in_order() -> None:
    """On the CPU (an inference engine's own parameters): small storages move into one
    private arena (not offered to peers), one after another in the order given, each keeping
    its tensors' identity, values and views (views the caller did not give too); storages in
    shared memory, of ``max_bytes`` and up, of another device than the one asked for, or
    already moved stay; later writes reach the moved memory."""
    amap = ArenaMap()

    params = [torch.nn.Parameter(torch.full((32, 32), float(i))) for i in range(50)]
    order = [params[i] for i in torch.randperm(50, generator=torch.Generator().manual_seed(1))]
    kept_view = params[7].data[3:5]  # an engine's own view of a weight, not given
    shared = torch.ones(64).share_memory_()
    big = torch.zeros(1 << 18)
    before = (shared.data_ptr(), big.data_ptr())
    assert gather_device_storages(order, arenas=amap, max_bytes=1 << 20, device="meta") == 0

    class Wrapper(torch.Tensor):  # quantized weights' kind: no storage of its own
        @staticmethod
        def __new__(cls, inner: torch.Tensor) -> Wrapper:
            return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)  # type: ignore[attr-defined]

        @classmethod
        def __torch_dispatch__(
            cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            raise NotImplementedError(func)

    wrapped = Wrapper(torch.zeros(8))
    moved = gather_device_storages([*order, wrapped, shared, big], arenas=amap, max_bytes=1 << 20)
    assert moved == 50 * 4096
    assert all(b.data_ptr() == a.data_ptr() + 4096 for a, b in itertools.pairwise(order))
    assert all(
        torch.equal(p.detach(), torch.full((32, 32), float(i))) for i, p in enumerate(params)
    )
    assert (shared.data_ptr(), big.data_ptr()) == before and shared.is_shared()
    start = order[0].data_ptr()
    assert amap.range_of(start) is None and amap.shared(start) is None  # private
    with torch.no_grad():
        params[7].add_(1)
    assert kept_view.data_ptr() == params[7].data_ptr() + 3 * 128 and bool((kept_view == 8).all())
    assert gather_device_storages(params, arenas=amap, max_bytes=1 << 20) == 0  # already moved


@pytest.mark.gpu
@pytest.mark.skipif(cuda_device_count() < 1, reason="needs a CUDA device")
def test_copy_program_progressions_span_allocations_on_cuda() -> None:
    """Shards of many expert weights, each into a tensor of its own that the caching allocator
    laid out one after another: runs that step evenly on both sides become one strided copy
    each, through a raw view of the destinations' range, and not a copy or a gather per pair;
    every byte lands where ``copy_`` puts it, over runs with changing contents, and the
    program keeps the destinations' storages."""
    pool = StreamPool()

    gen = torch.Generator().manual_seed(5)
    flat = torch.randint(-100, 100, (300, 3, 64, 32), dtype=torch.int16, generator=gen).cuda()
    srcs, dsts = [], []
    for e in range(300):
        for w in range(3):  # a column-parallel half of w1 and w3, a row-parallel half of w2
            src = flat[e, w, 32:] if w < 2 else flat[e, w].view(32, 64)[:, 16:48]
            srcs.append(src)
            dsts.append(torch.zeros(32, 32, dtype=torch.int16, device="cuda"))
    program = CopyProgram(dsts, srcs, streams=pool)
    assert len(program._solo) < 100 and not program._batches and not program._gathers
    assert any(o.data_ptr() == dsts[0].data_ptr() for o in program._owners)
    for step in range(3):
        flat.add_(step + 1)
        program.run()
        for d, s in zip(dsts, srcs, strict=True):
            assert torch.equal(d.cpu(), s.cpu()), step
    assert program.graphed and program.graph_error is None
    program.close()


def test_repoint_moves_all_users_of_a_storage_or_none() -> None:
    """Without storage swaps, ``gather_device_storages`` re-points each tensor of a moved
    storage; where one refuses (an inference tensor outside inference mode), the ones already
    re-pointed go back, so no tensor is left on other memory than its peers."""

    arena = torch.arange(64, dtype=torch.float32).untyped_storage()
    a = torch.zeros(8)
    view = a[2:]
    assert _repoint([a, view], arena, 64, a.untyped_storage())
    assert a.tolist() == [float(i) for i in range(16, 24)] and view.data_ptr() == a.data_ptr() + 8
    b = torch.zeros(8)
    with torch.inference_mode():
        frozen = torch.zeros(8)
    before = b.data_ptr()
    assert not _repoint([b, frozen], arena, 0, b.untyped_storage())
    assert b.data_ptr() == before and b.tolist() == [0.0] * 8


def test_share_storages_is_safe_across_threads() -> None:
    """Threads moving the same storages at once: each storage moves once, values intact."""
    amap = ArenaMap()

    tensors = [torch.full((256,), float(i)) for i in range(2000)]
    moved: list[int] = []
    threads = [
        threading.Thread(target=lambda: moved.append(share_storages(tensors, arenas=amap)))
        for _ in range(4)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sum(moved) == 2000 * 1024, moved
    assert all(t[0].item() == i and t[-1].item() == i for i, t in enumerate(tensors))
    assert all(amap.range_of(t.data_ptr()) is not None for t in tensors)


def test_copy_program_indexed_copy_cpu() -> None:
    """On the CPU, pairs of one layout whose sources step evenly through one storage and whose
    destinations lie anywhere (expert shards from a trainer's arena into tensors of their own)
    are one ``IndexedCopy`` (one index_copy_, 16-byte elements where the layout allows);
    every byte lands where ``copy_`` puts it (random bits: NaN payloads included); sources
    in separate allocations take the other paths."""
    amap = ArenaMap()

    gen = torch.Generator().manual_seed(3)
    flat = torch.randint(-(1 << 15), 1 << 15, (30 * 3 * 2048,), dtype=torch.int16, generator=gen)
    experts = flat.view(torch.bfloat16).view(30, 3, 64, 32)

    def out_of_order(*shape: int) -> list[torch.Tensor]:
        """30 tensors allocated out of order: destinations that do not step evenly (ones that
        happen to would be one strided copy through a raw view)."""
        out: list[torch.Tensor] = [torch.empty(0)] * 30
        for i in torch.randperm(30, generator=gen).tolist():
            out[i] = torch.zeros(*shape, dtype=torch.bfloat16)
        return out

    gate, down = out_of_order(32, 32), out_of_order(64, 16)
    odd = out_of_order(5, 3)  # 6-byte rows: int16
    dsts = [*gate, *down, *odd]
    srcs = [experts[e, 0, :32] for e in range(30)]  # contiguous 2 KiB, 12 KiB apart
    srcs += [experts[e, 2, :, 16:] for e in range(30)]  # column shards: rows of 32 bytes
    srcs += [experts[e, 1, 7:12, 3:6] for e in range(30)]
    program = CopyProgram(dsts, srcs)
    gathers = [g for g in program._gathers if isinstance(g, IndexedCopy)]
    assert len(gathers) == len(program._gathers) == 3 and not program._solo
    kinds = sorted((str(g._source.dtype), tuple(g._source.shape)) for g in gathers)
    assert kinds == [
        ("torch.complex128", (30, 32, 4)),  # 64-byte rows: 4 16-byte elements each
        ("torch.complex128", (30, 64, 2)),  # column shards: rows of 32 bytes
        ("torch.int16", (30, 5, 3)),
    ], kinds
    for step in range(2):
        program.run()
        for i, (d, s) in enumerate(zip(dsts, srcs, strict=True)):
            assert torch.equal(d.view(torch.int16), s.view(torch.int16)), (step, i)
        flat.add_(7)
    program.close()
    # sources in separate storages that step evenly (an arena's): never one view of the first
    loose = [torch.full((64,), i, dtype=torch.int16) for i in range(12)]
    assert share_storages(loose, arenas=amap) == 12 * 128
    steps = {b.data_ptr() - a.data_ptr() for a, b in itertools.pairwise(loose)}
    assert steps == {128}, steps
    out = [torch.zeros(64, dtype=torch.int16) for _ in range(12)]
    assert IndexedCopy.plan(out, loose[0], 128) is None
    apart = CopyProgram(out, loose)
    assert not any(isinstance(g, IndexedCopy) for g in apart._gathers)
    apart.run()
    assert all(o.tolist() == [i] * 64 for i, o in enumerate(out))
    apart.close()
    # a storage whose base is off the 16-byte grid: sources on it are not widened past it
    raw = bytearray(2 + 20 * 64)
    based = torch.frombuffer(raw, dtype=torch.int16, offset=2)  # its storage starts there
    skew = (-based.data_ptr() // 2) % 8  # elements to the first 16-byte boundary
    srcs = [based[skew + 32 * i : skew + 32 * i + 16] for i in range(12)]
    for i, src in enumerate(srcs):
        src.fill_(i + 1)
    dsts = [torch.zeros(16, dtype=torch.int16) for _ in range(12)]
    odd = CopyProgram(dsts, srcs)
    assert [type(g).__name__ for g in odd._gathers] == ["IndexedCopy"], odd._gathers
    odd.run()
    assert all(d.tolist() == [i + 1] * 16 for i, d in enumerate(dsts))
    odd.close()


def test_arena_maps_are_separate_owners() -> None:
    """Each ``ArenaMap`` sees only the arenas moved through it; an arena leaves its map once
    its last storage is gone."""
    mine, theirs = ArenaMap(), ArenaMap()
    tensors = [torch.full((256,), float(i)) for i in range(8)]
    assert share_storages(tensors, arenas=mine) == 8 * 1024 and len(mine) == 1
    at = tensors[3].data_ptr()
    assert mine.range_of(at) is not None and mine.shared(at) is not None
    assert theirs.range_of(at) is None and theirs.shared(at) is None and len(theirs) == 0
    params = [torch.full((32,), float(i)) for i in range(4)]
    assert gather_device_storages(params, arenas=theirs, max_bytes=1 << 20) == 4 * 128
    assert len(theirs) == 1 and len(mine) == 1  # a private CPU arena: recorded, not offered
    assert theirs.range_of(params[0].data_ptr()) is None
    del tensors
    gc.collect()
    mine.prune()
    assert len(mine) == 0 and mine.range_of(at) is None


def test_stream_pool_on_the_cpu_makes_no_streams() -> None:
    """A CPU program given a pool runs without touching it; a pool needs a branch."""
    pool = StreamPool()
    src = torch.arange(64, dtype=torch.int16)
    dst = torch.zeros(64, dtype=torch.int16)
    program = CopyProgram([dst], [src], streams=pool)
    program.run()
    assert torch.equal(dst, src) and not program.graphed and pool.devices() == []
    with pytest.raises(ValueError, match="at least one branch"):
        StreamPool(branches=0)


@pytest.mark.gpu
@pytest.mark.skipif(cuda_device_count() < 1, reason="needs a CUDA device")
def test_stream_pool_per_device_and_owner() -> None:
    """A pool makes one capture stream and ``branches`` branch streams per device, once, and
    its programs record graphs on them; another pool has streams of its own; a program
    without a pool launches its copies one by one."""
    pool, other = StreamPool(branches=2), StreamPool()
    device = torch.device("cuda", torch.cuda.current_device())
    with pool.capturing(device) as streams:
        first = list(streams)
    with pool.capturing(device) as streams:
        assert streams == first and len(first) == 3
    with other.capturing(device) as streams:
        assert not {s.cuda_stream for s in streams} & {s.cuda_stream for s in first}
    srcs = [torch.full((1 << 16,), i, dtype=torch.int16, device=device) for i in range(4)]
    dsts = [torch.zeros_like(s) for s in srcs]
    graphed = CopyProgram(dsts, srcs, streams=pool)
    plain = CopyProgram(dsts, srcs)
    for program in (graphed, plain):
        program.run()
        assert all(torch.equal(d, s) for d, s in zip(dsts, srcs, strict=True))
    assert graphed.graphed and not plain.graphed and pool.devices() == [device]
