"""NIXL_RDT: real NIXL agents in real processes, bytes checked.

CPU (DRAM) tests always run where nixl is installed; the VRAM variants need one GPU and put both
processes on it (the same-GPU CUDA IPC path). Every launch has a timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import multiprocessing as mp
import os
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

from tests.utils import distributed_test
from vllm_dist import (
    CommunicatorType,
    CoordinatorType,
    GlobalCoordinatorDistributedTask,
    MPLauncher,
)
from vllm_dist.interfaces import LaunchError, UnsupportedOperationError
from vllm_dist.memory import shared_empty

pytest.importorskip("nixl", reason="needs the nixl package (pip install 'vllm_dist[nixl]')")

from vllm_dist.implementations.communicators import nixl_rdt  # noqa: E402
from vllm_dist.implementations.communicators.nixl import ReadOnlyExposureError  # noqa: E402

SIZES = [1, 3, 4096, (1 << 20) + 7, 64 << 20]
LAUNCH_TIMEOUT = 120.0


def pattern(nbytes: int, seed: int, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen).to(device)


def launch(task: type, device: str = "cpu", options: dict[str, Any] | None = None, **kw: Any):
    return MPLauncher(2, timeout=LAUNCH_TIMEOUT).launch(
        task_type=task,
        coordinator_type=CoordinatorType.TORCH_DISTRIBUTED,
        communicator_type=CommunicatorType.NIXL_RDT,
        device=device,
        communicator_options=options or {"timeout": 30.0},
        **kw,
    )


class SendRecvTask(GlobalCoordinatorDistributedTask):
    """Rank 0 sends every size (and a burst of differently sized tensors); rank 1 checks."""

    def post_init_distributed(self, **kwargs: Any) -> Any:
        comm = self.communicator
        dev = str(self.device)
        rank = self.coordinator.get_rank()
        for size in SIZES:
            if rank == 0:
                comm.send(pattern(size, size, dev), dst=1)
            else:
                out = torch.empty(size, dtype=torch.uint8, device=dev)
                comm.recv(out, src=0)
                assert torch.equal(out.cpu(), pattern(size, size)), f"bytes differ at {size}"
        # ordering: a burst of typed tensors, matched by order, back and forth
        shapes = [(3,), (17, 5), (1024,), (2, 2, 2)]
        for i, shape in enumerate(shapes):
            src = torch.arange(torch.Size(shape).numel(), dtype=torch.float32, device=dev) + i
            src = src.reshape(shape)
            if rank == 0:
                comm.send(src, dst=1)
                back = torch.empty_like(src)
                comm.recv(back, src=1)
                assert torch.equal(back, src * 2)
            else:
                got = comm.recv(torch.empty_like(src), src=0)
                assert torch.equal(got, src), f"message {i} out of order"
                comm.send(got * 2, dst=0)
        return comm.stats()  # type: ignore[attr-defined]


class OneSidedTask(GlobalCoordinatorDistributedTask):
    """Rank 1 exposes a buffer; rank 0 reads / writes it with offsets and many descriptors."""

    def post_init_distributed(self, **kwargs: Any) -> Any:
        comm = self.communicator
        dev = str(self.device)
        rank = self.coordinator.get_rank()
        nbytes = 8 << 20
        if rank == 1:  # on the CPU in shared memory: a peer on the node may map them
            buf = shared_empty(nbytes, dev).copy_(pattern(nbytes, 11, dev))
            desc = comm.expose(buf, "weights", writable=True)  # type: ignore[attr-defined]
            assert desc.nbytes == nbytes and desc.rank == 1 and desc.writable
            bias = shared_empty(3 << 20, dev).copy_(pattern(3 << 20, 12, dev))
            comm.expose(bias, "bias", writable=True)  # type: ignore[attr-defined]
            comm.expose(shared_empty(64, dev), "read-only")  # type: ignore[attr-defined]
        else:
            comm.expose(torch.zeros(16, dtype=torch.uint8, device=dev), "unused")  # type: ignore[attr-defined]
        table = comm.exchange_exposed()  # type: ignore[attr-defined]
        ref = pattern(nbytes, 11)
        if rank == 0:
            assert set(table[1]) == {"weights", "bias", "read-only"}
            assert not table[1]["read-only"].writable
            with pytest.raises(ReadOnlyExposureError, match="read-only"):
                comm.write(1, "read-only", torch.ones(8, dtype=torch.uint8, device=dev))  # type: ignore[attr-defined]
            # one descriptor, with an offset
            out = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
            comm.read(1, "weights", out, remote_offset=12345)  # type: ignore[attr-defined]
            assert torch.equal(out.cpu(), ref[12345 : 12345 + (1 << 20)])
            # 256 descriptors into views of one local buffer, in one request
            local = torch.empty(256 * 1000, dtype=torch.uint8, device=dev)
            reqs = [(local[i * 1000 : (i + 1) * 1000], i * 4099, 1000) for i in range(256)]
            comm.read_many(1, "weights", reqs)  # type: ignore[attr-defined]
            for i in range(256):
                assert torch.equal(
                    local[i * 1000 : (i + 1) * 1000].cpu(), ref[i * 4099 : i * 4099 + 1000]
                )
            # async forms: overlap two requests, then wait with a bound
            a = torch.empty(4096, dtype=torch.uint8, device=dev)
            b = torch.empty(4096, dtype=torch.uint8, device=dev)
            ha = comm.read_async(1, "weights", a, 0)  # type: ignore[attr-defined]
            hb = comm.read_async(1, "weights", b, nbytes - 4096)  # type: ignore[attr-defined]
            ha.wait(timeout=10)
            hb.wait(timeout=10)
            assert torch.equal(a.cpu(), ref[:4096]) and torch.equal(b.cpu(), ref[-4096:])
            # one request gathering from two exposed buffers: large and small pieces, offsets
            bias_ref = pattern(3 << 20, 12)
            parts = [("weights", 7, 2 << 20), ("bias", 0, 3 << 20), ("weights", 5 << 20, 1)]
            parts += [("bias", 97 * i, 333) for i in range(40)]
            outs = [torch.empty(n, dtype=torch.uint8, device=dev) for _, _, n in parts]
            batch = [(name, off, o) for (name, off, _), o in zip(parts, outs, strict=True)]
            comm.read_batch_async(1, batch).wait(timeout=30)  # type: ignore[attr-defined]
            for (name, off, n), o in zip(parts, outs, strict=True):
                want = (ref if name == "weights" else bias_ref)[off : off + n]
                assert torch.equal(o.cpu(), want), (name, off, n)
            with pytest.raises(ValueError, match="no buffer named"):
                comm.read_batch_async(1, [("weights", 0, outs[0]), ("nope", 0, outs[1])])  # type: ignore[attr-defined]
            # strided views of the remote buffer, read without any pack on its side
            read_strided_views(comm, dev, ref)
            # one request scattering into the second buffer: a small and a large piece
            u8: dict[str, Any] = {"dtype": torch.uint8, "device": dev}
            comm.write_batch_async(  # type: ignore[attr-defined]
                1,
                [
                    ("bias", 10, torch.full((5,), 3, **u8)),
                    ("bias", (2 << 20) + 1, torch.full(((1 << 20) - 1,), 4, **u8)),
                ],
                notify=b"scattered",
            ).wait(30)
            # writes: single and many descriptors, then a notification after the data
            comm.write(1, "weights", torch.full((100,), 7, dtype=torch.uint8, device=dev), 1000)  # type: ignore[attr-defined]
            src = torch.full((64 * 10,), 9, dtype=torch.uint8, device=dev)
            many = [(src[i * 10 : (i + 1) * 10], 100_000 + i * 20, 10) for i in range(64)]
            comm.write_async(1, "weights", many, notify=b"written").wait(10)  # type: ignore[attr-defined]
            with pytest.raises(ValueError, match="outside"):
                comm.read(1, "weights", out, remote_offset=nbytes - 10)  # type: ignore[attr-defined]
            with pytest.raises(ValueError, match="no buffer named"):
                comm.read(1, "nope", out)  # type: ignore[attr-defined]
        else:
            assert comm.wait_notification(0, timeout=30) == b"scattered"  # type: ignore[attr-defined]
            want_bias = pattern(3 << 20, 12)
            want_bias[10:15] = 3
            want_bias[(2 << 20) + 1 :] = 4
            assert torch.equal(bias.cpu(), want_bias)
            assert comm.wait_notification(0, timeout=30) == b"written"  # type: ignore[attr-defined]
            expect = ref.clone()
            expect[1000:1100] = 7
            for i in range(64):
                expect[100_000 + i * 20 : 100_000 + i * 20 + 10] = 9
            assert torch.equal(buf.cpu(), expect)
        for op in (comm.all_reduce, comm.all_gather, comm.reduce_scatter):
            with pytest.raises(UnsupportedOperationError, match="torch_distributed"):
                op(torch.ones(2, device=dev))
        with pytest.raises(UnsupportedOperationError):
            comm.broadcast(torch.ones(2, device=dev), src=0)
        self.coordinator.barrier()
        return comm.describe()


def read_strided_views(comm: Any, dev: str, ref: torch.Tensor) -> None:
    """Rank 1's 8 MiB "weights" seen as a 1024 x 4096 int16 matrix; strided reads of it."""
    matrix = ref.view(torch.int16).view(1024, 4096)
    mapped = comm.maps_exposed(1, "weights")
    assert mapped is comm.maps_peer_memory
    cols = torch.empty(1024, 1000, dtype=torch.int16, device=dev)  # a column slice: 1024 runs
    rows = torch.empty(3, 7, 4096, dtype=torch.int16, device=dev)  # 3-D, merges into one run
    tiny = torch.empty(8, 16, dtype=torch.int16, device=dev)  # a transposed view: element runs
    comm.read_strided_async(  # type: ignore[attr-defined]
        1,
        [
            ("weights", 2 * 100, (4096, 1), cols),
            ("weights", 2 * 4096 * 5, (7 * 4096, 4096, 1), rows),
            ("weights", 2 * 3, (1, 4096), tiny),
        ],
    ).wait(timeout=30)
    assert torch.equal(cols.cpu(), matrix[:, 100:1100])
    assert torch.equal(rows.cpu(), matrix[5:26].reshape(3, 7, 4096))
    assert torch.equal(tiny.cpu(), matrix[:16, 3:11].t())
    # a non-contiguous local tensor: one copy kernel on a mapping, refused through NIXL
    trans = torch.zeros(1000, 1024, dtype=torch.int16, device=dev).t()
    request = [("weights", 2 * 100, (4096, 1), trans)]
    if mapped:
        comm.read_strided_async(1, request).wait(timeout=30)  # type: ignore[attr-defined]
        assert torch.equal(trans.cpu(), matrix[:, 100:1100])
    else:
        with pytest.raises(ValueError, match="contiguous local tensor"):
            comm.read_strided_async(1, request)  # type: ignore[attr-defined]
    for bad, match in [
        (("weights", 0, (4096,), cols), "do not fit"),
        (("weights", 1, (4096, 1), cols), "multiple of the element size"),
        (("weights", 2 * 4096 * 30, (4096, 1), cols), "outside"),
        (("nope", 0, (4096, 1), cols), "no buffer named"),
    ]:
        with pytest.raises(ValueError, match=match):
            comm.read_strided_async(1, [bad])  # type: ignore[attr-defined]


def test_strided_runs() -> None:
    starts, run = nixl_rdt.strided_runs((4, 6), (12, 1), 2)
    assert starts.tolist() == [0, 24, 48, 72] and run == 12
    starts, run = nixl_rdt.strided_runs((2, 1, 3, 4), (100, 7, 4, 1), 1)  # (3, 4) is contiguous
    assert starts.tolist() == [0, 100] and run == 12
    starts, run = nixl_rdt.strided_runs((3, 2), (1, 3), 4)  # transposed: one element per run
    assert starts.tolist() == [0, 12, 4, 16, 8, 20] and run == 4
    assert nixl_rdt.strided_runs((0, 5), (5, 1), 2)[0].size == 0


class PreparedReadsTask(GlobalCoordinatorDistributedTask):
    """Rank 1 rewrites its exposed buffer every round; rank 0 posts one prepared set of plain
    and strided reads each round and checks every byte against that round's contents. With
    ``plain``, the set also reads a second buffer that is not in shared memory (never mapped)."""

    def post_init_distributed(self, rounds: int = 4, plain: bool = False, **kwargs: Any) -> Any:
        comm: Any = self.communicator
        dev = str(self.device)
        rank = self.coordinator.get_rank()
        nbytes = 8 << 20
        buf = shared_empty(nbytes, dev).zero_()
        other = torch.zeros(4096, dtype=torch.uint8, device=dev)
        if rank == 1:
            comm.expose(buf, "weights")
            if plain:
                comm.expose(other, "plain")
        comm.exchange_exposed()
        tail = torch.empty(1000, dtype=torch.uint8, device=dev)
        small = torch.empty(333, dtype=torch.uint8, device=dev)
        big = torch.empty(2 << 20, dtype=torch.uint8, device=dev)
        cols = torch.empty(1024, 1000, dtype=torch.int16, device=dev)  # a column slice
        out: dict[str, Any] = {}
        prepared = merged = None
        parts: list[Any] = []
        if rank == 0:
            prepared = comm.prepare_reads(
                1,
                [("weights", 7, small), ("weights", 5 << 20, big)]
                + ([("plain", 96, tail)] if plain else []),
                [("weights", 200, (4096, 1), cols)],
            )
            # the same reads as two sets merged into one (what a first replay does): only sets
            # of copies on a mapping merge; on CUDA IPC they replay as one graph
            parts = [
                comm.prepare_reads(1, [("weights", 7, small), ("weights", 5 << 20, big)], []),
                comm.prepare_reads(1, [], [("weights", 200, (4096, 1), cols)]),
            ]
            merged = comm.merge_prepared(1, parts)
            out["merged"] = merged is not None
        for i in range(rounds):
            if rank == 1:
                buf.copy_(pattern(nbytes, 100 + i, dev))
                other.copy_(pattern(4096, 200 + i, dev))
            self.coordinator.barrier()
            if rank == 0:
                assert prepared is not None
                prepared.post().wait(timeout=30)
                ref = pattern(nbytes, 100 + i)
                assert torch.equal(small.cpu(), ref[7:340])
                assert torch.equal(big.cpu(), ref[5 << 20 : 7 << 20])
                matrix = ref.view(torch.int16).view(1024, 4096)
                assert torch.equal(cols.cpu(), matrix[:, 100:1100]), i
                if plain:
                    assert torch.equal(tail.cpu(), pattern(4096, 200 + i)[96:1096]), i
                if merged is not None:
                    for t in (small, big, cols):
                        t.zero_()
                    merged.post().wait(timeout=30)
                    assert torch.equal(small.cpu(), ref[7:340])
                    assert torch.equal(big.cpu(), ref[5 << 20 : 7 << 20])
                    assert torch.equal(cols.cpu(), matrix[:, 100:1100]), i
            self.coordinator.barrier()
        if prepared is not None:
            out["mapped"] = comm.maps_exposed(1, "weights")
            assert not (plain and comm.maps_exposed(1, "plain"))
        if prepared is not None and (plain or not out["mapped"]):
            # closed while a post is in flight: that post fails, the next one rebuilds
            inflight = prepared.post()
            prepared.close()
            with pytest.raises(nixl_rdt.NixlTransferError, match="closed while"):
                inflight.wait(timeout=30)
            prepared.post().wait(timeout=30)
            assert torch.equal(big.cpu(), pattern(nbytes, 100 + rounds - 1)[5 << 20 : 7 << 20])
            out["rebuilt"] = True
        if prepared is not None:
            out["open"] = comm.stats()
            out["graphed"] = prepared.graphed
            out["merged_graphed"] = merged is not None and merged.graphed
            for other_set in [*parts, merged]:
                if other_set is not None:
                    other_set.close()
            prepared.close()
            prepared.close()  # idempotent
            out["closed"] = comm.stats()
        self.coordinator.barrier()
        return out


class MixedStridedTask(GlobalCoordinatorDistributedTask):
    """Strided reads of a mapped and an unmapped buffer of rank 1 in one request, after the
    mapped one alone was read into exposed memory (its copy views are cached): every request
    must land, through NIXL, including the one whose views the cache holds."""

    def post_init_distributed(self, **kwargs: Any) -> Any:
        comm: Any = self.communicator
        dev = str(self.device)
        rank = self.coordinator.get_rank()
        mapped = shared_empty(64 * 64 * 2, dev).copy_(pattern(64 * 64 * 2, 1, dev))
        plain = pattern(64 * 64 * 2, 2, dev)
        local = torch.zeros(2, 64, 32, dtype=torch.int16, device=dev)
        comm.expose(mapped if rank == 1 else local, "a")
        if rank == 1:
            comm.expose(plain, "b")
        comm.exchange_exposed()
        out = {}
        if rank == 0:
            first = ("a", 2 * 16, (64, 1), local[0])  # columns 16..48 of a 64 x 64 matrix
            comm.read_strided_async(1, [first]).wait(timeout=30)
            out["mapped"] = comm.maps_exposed(1, "a") and not comm.maps_exposed(1, "b")
            local.zero_()
            comm.read_strided_async(1, [first, ("b", 0, (64, 1), local[1])]).wait(timeout=30)
            want_a = pattern(64 * 64 * 2, 1).view(torch.int16).view(64, 64)[:, 16:48]
            want_b = pattern(64 * 64 * 2, 2).view(torch.int16).view(64, 64)[:, :32]
            out["a"] = torch.equal(local[0].cpu(), want_a)
            out["b"] = torch.equal(local[1].cpu(), want_b)
        self.coordinator.barrier()
        return out


class RepeatTask(GlobalCoordinatorDistributedTask):
    """Many transfers of reused and fresh buffers: handles and registrations must not grow."""

    def post_init_distributed(self, rounds: int = 200, **kwargs: Any) -> Any:
        comm = self.communicator
        dev = str(self.device)
        rank = self.coordinator.get_rank()
        buf = torch.zeros(1 << 16, dtype=torch.uint8, device=dev)
        comm.expose(buf, "ring", writable=True)  # type: ignore[attr-defined]
        comm.exchange_exposed()  # type: ignore[attr-defined]
        counts = []
        for i in range(rounds):
            if rank == 0:
                comm.send(torch.full((4096,), i % 251, dtype=torch.uint8, device=dev), dst=1)
                comm.write(1, "ring", torch.full((512,), i % 251, dtype=torch.uint8, device=dev))  # type: ignore[attr-defined]
            else:
                out = torch.empty(4096, dtype=torch.uint8, device=dev)  # a fresh buffer each time
                comm.recv(out, src=0)
                assert int(out[0]) == i % 251 and int(out[-1]) == i % 251
            if i in (rounds // 2, rounds - 1):
                counts.append(comm.stats())  # type: ignore[attr-defined]
        self.coordinator.barrier()
        return counts


@distributed_test(timeout=180)
def test_send_recv_sizes_and_order_cpu() -> None:
    stats = launch(SendRecvTask)
    for s in stats:
        assert s["live_xfer_handles"] == 0 and s["leaked_xfer_handles"] == 0


@distributed_test(timeout=180)
@pytest.mark.parametrize("shared_memory", [True, False], ids=["shared_memory", "ucx"])
def test_one_sided_read_write_many_descriptors_cpu(shared_memory: bool) -> None:
    facts = launch(OneSidedTask, options={"timeout": 30.0, "shared_memory": shared_memory})
    assert facts[0]["mem_type"] == "DRAM"
    # rank 0 issued the one-sided requests: which path carried them
    assert facts[0]["last_xfer_backend"] == ("shared_memory" if shared_memory else "UCX")


@distributed_test(timeout=180)
def test_strided_reads_of_mapped_and_unmapped_buffers_all_land_cpu() -> None:
    out = launch(MixedStridedTask)[0]
    assert out == {"mapped": True, "a": True, "b": True}, out


def test_shared_memory_handle_maps_a_cpu_storage() -> None:
    """expose's DRAM handle: only a storage in shared memory has one, and opening it maps the
    same bytes; handles that do not fit the object map nothing."""
    assert nixl_rdt.SharedMemoryHandle.of(torch.arange(64, dtype=torch.int32)) is None
    base = shared_empty(64 * 4, "cpu").view(torch.int32)
    base.copy_(torch.arange(64, dtype=torch.int32))
    view = base[16:32]
    handle = nixl_rdt.SharedMemoryHandle.of(view)
    assert handle is not None and base.untyped_storage().is_shared()
    assert handle.offset == 16 * 4 and handle.nbytes == 16 * 4 and handle.size == 64 * 4
    mapped = handle.open()  # read-only: a handle made without write access
    assert mapped is not None and mapped.data_ptr() != view.data_ptr()
    assert torch.equal(mapped.view(torch.int32), torch.arange(16, 32, dtype=torch.int32))
    with pytest.raises(ReadOnlyExposureError, match="read-only"):
        handle.open(writable=True)
    rw = nixl_rdt.SharedMemoryHandle.of(view, writable=True)
    assert rw is not None
    written = rw.open(writable=True)
    assert written is not None
    written.view(torch.int32)[0] = -7  # the mapping and the tensor are the same memory
    assert int(base[16]) == -7 and int(view[0]) == -7 and int(mapped.view(torch.int32)[0]) == -7
    moved = torch.arange(8, dtype=torch.int64)
    moved.share_memory_()  # a trainer's model.share_memory()
    again = nixl_rdt.SharedMemoryHandle.of(moved[2:])
    assert again is not None and again.offset == 16 and again.inode != handle.inode
    assert torch.equal(again.open().view(torch.int64), moved[2:])  # type: ignore[union-attr]
    stale = dataclasses.replace(handle, inode=(handle.inode[0], handle.inode[1] + 1))
    assert stale.open() is None
    assert dataclasses.replace(handle, node="elsewhere").open() is None
    assert dataclasses.replace(handle, pid=2**22 + 1).open() is None  # no such process


@distributed_test(timeout=180)
def test_repeated_transfers_do_not_leak_cpu() -> None:
    max_regs = 8
    counts = launch(RepeatTask, options={"timeout": 30.0, "max_cached_registrations": max_regs})
    for mid, end in counts:
        assert end["live_xfer_handles"] == 0 and end["leaked_xfer_handles"] == 0
        assert end["registrations"] == mid["registrations"] <= max_regs + 1, (mid, end)
        assert end["exposed"] == 1


# -- a dead peer ------------------------------------------------------------------------------


class DeadPeerTask(GlobalCoordinatorDistributedTask):
    def post_init_distributed(self, **kwargs: Any) -> Any:
        comm = self.communicator
        if self.coordinator.get_rank() == 1:
            comm.recv(torch.empty(1 << 20, dtype=torch.uint8), src=0)  # one good round
            os._exit(
                3
            )  # dies before its next recv: the sender waits for a "ready" that never comes
        comm.send(torch.ones(1 << 20, dtype=torch.uint8), dst=1)
        comm.send(torch.ones(1 << 20, dtype=torch.uint8), dst=1)
        return "unreachable"


@distributed_test(timeout=120)
def test_dead_peer_fails_the_launch() -> None:
    with pytest.raises(LaunchError) as info:
        launch(DeadPeerTask, options={"timeout": 5.0})
    assert 1 in info.value.ranks


def _dead_peer_worker(rank: int, port: int, out: Any) -> None:
    from vllm_dist.implementations.coordinators.torch_distributed import (
        TorchDistributedCoordinator,
    )
    from vllm_dist.interfaces import WorkerInfo

    info = WorkerInfo(
        rank=rank, world_size=2, local_rank=rank, local_world_size=2,
        master_addr="127.0.0.1", master_port=port,
    )  # fmt: skip
    coord = TorchDistributedCoordinator(info, timeout=30)
    coord.initialize()
    comm = nixl_rdt.NixlRdtCommunicator(coord, device="cpu", timeout=3.0)
    if rank == 1:
        comm.expose(torch.zeros(1 << 20, dtype=torch.uint8), "buf")
        comm.exchange_exposed()
        comm.recv(torch.empty(64, dtype=torch.uint8), src=0)
        time.sleep(1.0)  # rank 0 is now waiting for a recv that this rank never posts
        os._exit(0)
    comm.exchange_exposed()
    comm.send(torch.ones(64, dtype=torch.uint8), dst=1)
    for what, call in (
        ("send", lambda: comm.send(torch.ones(64, dtype=torch.uint8), dst=1)),
        ("recv", lambda: comm.recv(torch.empty(64, dtype=torch.uint8), src=1)),
        ("read", lambda: comm.read(1, "buf", torch.empty(1 << 20, dtype=torch.uint8))),
    ):
        start = time.monotonic()
        try:
            call()
            out.put((what, "no error", 0.0))
        except nixl_rdt.NixlTransferError as exc:
            out.put((what, type(exc).__name__, time.monotonic() - start))
    comm.close()
    out.put(("closed", "", 0.0))


@distributed_test(timeout=120)
def test_dead_peer_gives_typed_error_within_timeout() -> None:
    from vllm_dist.implementations.launchers.common import find_free_port

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = find_free_port("127.0.0.1")
    procs = [ctx.Process(target=_dead_peer_worker, args=(r, port, out)) for r in (0, 1)]
    for p in procs:
        p.start()
    try:
        results = [out.get(timeout=90) for _ in range(4)]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    by_op = {what: (kind, secs) for what, kind, secs in results}
    # the peer died while this rank waited for its "ready": the 3 s timeout ends the wait
    assert by_op["send"][0] == "NixlTimeoutError" and by_op["send"][1] < 60, by_op
    # afterwards UCX knows the endpoint is gone: a typed error at once, or at the timeout
    for op in ("recv", "read"):
        assert by_op[op][0] in ("NixlTimeoutError", "NixlTransferError"), by_op
        assert by_op[op][1] < 60, by_op  # bounded, far below a default wait
    assert "closed" in by_op


# -- set-up errors ----------------------------------------------------------------------------


def test_missing_nixl_names_the_install_command() -> None:
    code = (
        "import sys; sys.modules['nixl'] = None\n"
        "import vllm_dist\n"
        "from vllm_dist.registry import get_communicator_class\n"
        "cls = get_communicator_class('nixl_rdt')\n"
        "print('REASON', cls.unavailable_reason('cpu'))\n"
        "from vllm_dist.implementations.communicators.nixl.agent import load_nixl\n"
        "try:\n"
        "    load_nixl()\n"
        "except ImportError as exc:\n"
        "    print('ERROR', exc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "ERROR" in proc.stdout and "pip install 'vllm_dist[nixl]'" in proc.stdout
    assert "REASON the nixl package is not installed" in proc.stdout


def test_importing_vllm_dist_does_not_import_nixl() -> None:
    code = "import sys, vllm_dist; print('nixl' in sys.modules, 'nixl_cu13' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "False False", proc.stdout + proc.stderr


# -- the notification codec: no pickle on the wire --------------------------------------------


class _Forged:
    """Unpickling this would create ``path``: proof that nothing was unpickled if it is absent."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (os.mkdir, (self.path,))


def test_notification_codec_round_trips() -> None:
    from vllm_dist.implementations.communicators.nixl import notifications as wire

    msgs = [
        wire.Ready(
            seq=3,
            addr=2**63 + 5,
            nbytes=4096,
            device_id=1,
            mem_type="VRAM",
            epoch=2,
            full=True,
            metadata=b"\x00md\xff",
        ),
        wire.Ready(
            seq=0,
            addr=0,
            nbytes=1,
            device_id=0,
            mem_type="DRAM",
            epoch=0,
            full=False,
            metadata=b"",
        ),
        wire.Done(seq=7),
        wire.Refusal(seq=1, reason="sizes differ: 4 vs 8 bytes"),
        wire.UserMessage(data=b""),
        wire.UserMessage(data=b"R\x01anything"),
    ]
    for msg in msgs:
        assert wire.decode(wire.encode(msg)) == msg


def test_forged_notifications_are_refused_and_never_unpickled(tmp_path: Any) -> None:
    import pickle
    import struct

    from vllm_dist.implementations.communicators.nixl import notifications as wire

    marker = str(tmp_path / "unpickled")
    pickled = pickle.dumps((0, _Forged(marker)))
    ready = wire.encode(
        wire.Ready(
            seq=1,
            addr=64,
            nbytes=8,
            device_id=0,
            mem_type="DRAM",
            epoch=0,
            full=False,
            metadata=b"",
        )
    )
    bad_mem = bytearray(ready)
    bad_mem[2 + struct.calcsize("<qQqi")] = 9  # the memory-type byte
    cases = [
        (b"", "no header"),
        (b"D" + pickle.dumps(0), "wire version"),  # the old pickled format
        (b"R" + pickled, "wire version"),
        (b"Z\x01" + pickled, "unknown notification kind"),
        (b"R\x01" + pickled, "malformed Ready"),
        (ready[:10], "malformed Ready"),
        (bytes(bad_mem), "malformed Ready"),
        (b"D\x01" + pickled, "malformed Done"),
        (b"D\x01" + struct.pack("<q", -1), "malformed Done"),
        (b"E\x01" + struct.pack("<q", 0) + b"\xff\xfe", "malformed Refusal"),
        (b"R\x02" + ready[2:], "wire version 2"),
    ]
    for raw, match in cases:
        with pytest.raises(nixl_rdt.NixlProtocolError, match=match):
            wire.decode(raw)
    assert not os.path.exists(marker)


class _FakeAgent:
    def __init__(self, news: dict[str, list[bytes]]) -> None:
        self.news = news

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        news, self.news = self.news, {}
        return news


def test_mailbox_refuses_a_forged_notification_and_keeps_the_good_ones(tmp_path: Any) -> None:
    import pickle

    from vllm_dist.implementations.communicators.nixl import notifications as wire
    from vllm_dist.implementations.communicators.nixl.agent import AgentSlot, Peers

    marker = str(tmp_path / "unpickled")
    forged = b"U" + pickle.dumps(_Forged(marker))  # the old "U" + payload, no version byte
    agent = _FakeAgent(
        {
            "peer": [wire.encode(wire.UserMessage(data=b"before")), forged],
            "stranger": [b"R" + pickle.dumps(_Forged(marker))],  # not a member: ignored
        }
    )
    slot = AgentSlot(agent)  # type: ignore[arg-type]
    peers = Peers(slot, rank=0)
    peers.rank_of.update({"me": 0, "peer": 1})
    peers.agent_of[1] = "peer"
    box = wire.Mailbox(slot, peers, spin_s=0.0)
    with pytest.raises(nixl_rdt.NixlProtocolError, match="rank 1 sent .*wire version"):
        box.poll()
    assert box.wait_user(1, seconds=1.0) == b"before"  # filed although a forged one came too
    with pytest.raises(nixl_rdt.NixlTimeoutError):
        box.wait_user(1, seconds=0.01)
    assert not os.path.exists(marker)


class ForgedNotificationTask(GlobalCoordinatorDistributedTask):
    """Rank 1 sends rank 0 a pickle through its raw agent, which rank 0 must refuse, then a
    descriptor as ``to_bytes``, which rank 0 imports and reads (mapped, in shared memory)."""

    def post_init_distributed(self, marker: str = "", **kwargs: Any) -> Any:
        import pickle

        comm: Any = self.communicator
        out = ""
        if self.coordinator.get_rank() == 1:
            buf = shared_empty(4096, "cpu").copy_(pattern(4096, 5))
            desc = comm.expose(buf, "buf")
            peer = comm._peers.agent_of[0]
            comm._slot.get().send_notif(peer, b"R" + pickle.dumps((0, _Forged(marker))))
            comm.notify(0, desc.to_bytes())
        else:
            try:
                comm.wait_notification(1, timeout=30)
            except nixl_rdt.NixlProtocolError as exc:
                out = str(exc)
            desc = nixl_rdt.ExposedBuffer.from_bytes(comm.wait_notification(1, timeout=30))
            comm.import_exposed(desc)
            got = comm.read(1, "buf", torch.empty(4096, dtype=torch.uint8), timeout=30)
            out += f" | mapped={comm.maps_exposed(1, 'buf')} equal={torch.equal(got, pattern(4096, 5))}"
        self.coordinator.barrier()
        return out


@distributed_test(timeout=180)
def test_forged_notification_from_a_peer_is_refused_cpu(tmp_path: Any) -> None:
    marker = str(tmp_path / "unpickled")
    out = launch(ForgedNotificationTask, marker=marker)[0]
    assert "rank 1 sent" in out and "wire version" in out, out
    assert out.endswith(" | mapped=True equal=True"), out
    assert not os.path.exists(marker)


def test_exposed_buffer_byte_codec_round_trips_and_refuses_forgeries(tmp_path: Any) -> None:
    """``ExposedBuffer.to_bytes`` / ``from_bytes``: every field and mapping kind survives; bytes
    that are not a descriptor of this version (a pickle among them) are refused."""
    import json
    import pickle

    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    base = {
        "rank": 1, "name": "weights", "agent": "a-1", "addr": 2**47 + 64, "nbytes": 4096,
        "device_id": 0, "mem_type": "DRAM", "epoch": 3, "metadata": b"\x00agent md\xff",
    }  # fmt: skip
    shm = nixl_rdt.SharedMemoryHandle.of(shared_empty(256, "cpu")[16:])
    assert shm is not None
    ipc_args = (torch.Tensor, torch.Size([4096]), (1,), 0, torch.storage.TypedStorage,
                torch.uint8, 0, b"\x01ipc", 8192, 512, False, b"/rc", 3, b"\x02ev", True)  # fmt: skip
    ipc = nixl_rdt.CudaIpcHandle(
        node="n/boot", device_uuid="GPU-1", rebuild=(rebuild_cuda_tensor, ipc_args)
    )
    for mapping in (None, shm, ipc):
        for writable in (False, True):
            desc = nixl_rdt.ExposedBuffer(**base, mapping=mapping, writable=writable)  # type: ignore[arg-type]
            assert nixl_rdt.ExposedBuffer.from_bytes(desc.to_bytes()) == desc
    evil = nixl_rdt.CudaIpcHandle(node="n", device_uuid="u", rebuild=(os.system, ("true",)))
    with pytest.raises(TypeError, match="flat uint8"):
        nixl_rdt.ExposedBuffer(**base, mapping=evil).to_bytes()  # type: ignore[arg-type]
    marker = str(tmp_path / "unpickled")
    good = json.loads(nixl_rdt.ExposedBuffer(**base, mapping=shm).to_bytes())  # type: ignore[arg-type]
    forged = [
        (pickle.dumps(_Forged(marker)), "not JSON"),
        (b"[1, 2]", "version"),
        (json.dumps({**good, "v": 1}).encode(), "version 1"),
        (json.dumps({**good, "writable": 1}).encode(), "'writable' must be bool"),
        (json.dumps({**good, "addr": "0x10"}).encode(), "'addr' must be int"),
        (json.dumps({**good, "epoch": True}).encode(), "'epoch' must be int"),
        (json.dumps({**good, "nbytes": -1}).encode(), "out of range"),
        (json.dumps({**good, "mem_type": "HBM"}).encode(), "out of range"),
        (json.dumps({**good, "metadata": "not base64!"}).encode(), "base64"),
        (json.dumps({**good, "mapping": {"kind": "pickle"}}).encode(), "mapping kind"),
        (json.dumps({**good, "mapping": {**good["mapping"], "inode": [1]}}).encode(), "inode"),
    ]
    for raw, match in forged:
        with pytest.raises(ValueError, match=match):
            nixl_rdt.ExposedBuffer.from_bytes(raw)
    assert not os.path.exists(marker)


def test_options_are_validated() -> None:
    with pytest.raises(ValueError, match="timeout"):
        nixl_rdt.NixlOptions(timeout=0)
    with pytest.raises(TypeError):
        nixl_rdt.NixlOptions(bogus=1)  # type: ignore[call-arg]
    assert issubclass(nixl_rdt.NixlTimeoutError, TimeoutError)
    assert issubclass(nixl_rdt.NixlTimeoutError, RuntimeError)


def test_ray_rdt_version_guard() -> None:
    assert nixl_rdt.RDT_MIN_RAY_VERSION == "2.56.0"
    assert nixl_rdt.check_ray_rdt_version("2.60.0") == "2.60.0"
    with pytest.raises(nixl_rdt.RayRdtUnavailableError, match=r"too old"):
        nixl_rdt.check_ray_rdt_version("2.56.0rc1")  # a pre-release of the floor is older
    with pytest.raises(nixl_rdt.RayRdtUnavailableError, match=r"pip install -U"):
        nixl_rdt.check_ray_rdt_version("2.55.1")
    assert nixl_rdt.ray_rdt_env({}) == {nixl_rdt.CUDA_IPC_GET_ZCOPY: "y"}
    user = {nixl_rdt.CUDA_IPC_GET_ZCOPY: "n"}
    assert nixl_rdt.ray_rdt_env(user) == user  # the user's UCX settings win


@distributed_test(timeout=180)
@pytest.mark.parametrize(
    ("shared_memory", "plain"),
    [(True, False), (False, False), (True, True)],
    ids=["shared_memory", "ucx", "both"],
)
def test_prepared_reads_are_reposted_cpu(shared_memory: bool, plain: bool) -> None:
    """Through NIXL: one request built once and reposted every round; close releases it. On a
    shared-memory mapping: copies, no NIXL request at all. Both in one set: the request for
    the unmapped buffer and copies for the mapped one, posted together. Sets of copies on a
    mapping merge into one (``merge_prepared``) that lands the same bytes; NIXL sets do not."""
    options = {"timeout": 30.0, "shared_memory": shared_memory}
    out = launch(PreparedReadsTask, options=options, plain=plain)[0]
    assert not out["graphed"] and out["mapped"] is shared_memory
    assert out["merged"] is shared_memory  # merged: copies on the shared-memory mapping only
    nixl = plain or not shared_memory
    assert out["open"]["live_xfer_handles"] == int(nixl)
    assert out.get("rebuilt", False) is nixl
    assert out["closed"]["live_xfer_handles"] == 0 and out["closed"]["leaked_xfer_handles"] == 0


# -- VRAM: two processes on one GPU (run on the device machine) ---------------------------------


@distributed_test(gpus=1, timeout=300)
def test_send_recv_sizes_vram_same_gpu() -> None:
    stats = launch(SendRecvTask, device="cuda:0")
    assert all(s["live_xfer_handles"] == 0 for s in stats)


@distributed_test(gpus=1, timeout=300)
@pytest.mark.parametrize("cuda_ipc", [True, False], ids=["cuda_ipc", "ucx"])
def test_one_sided_read_write_vram_same_gpu(cuda_ipc: bool) -> None:
    facts = launch(OneSidedTask, device="cuda:0", options={"timeout": 30.0, "cuda_ipc": cuda_ipc})
    assert facts[0]["mem_type"] == "VRAM"
    # rank 0 issued the one-sided requests: which path carried them
    assert (facts[0]["last_xfer_backend"] == "cuda_ipc") is cuda_ipc, facts[0]
    assert facts[0][nixl_rdt.CUDA_IPC_GET_ZCOPY] in (
        "y",
        os.environ.get(nixl_rdt.CUDA_IPC_GET_ZCOPY),
    )


@distributed_test(gpus=1, timeout=300)
def test_repeated_transfers_vram_same_gpu() -> None:
    counts = launch(
        RepeatTask, device="cuda:0", options={"timeout": 60.0, "max_cached_registrations": 8}
    )
    assert all(end["live_xfer_handles"] == 0 for _, end in counts)


@distributed_test(gpus=1, timeout=300)
@pytest.mark.parametrize("cuda_ipc", [True, False], ids=["cuda_ipc", "ucx"])
def test_prepared_reads_vram_same_gpu(cuda_ipc: bool) -> None:
    """On a CUDA IPC mapping the copies become one CUDA graph, replayed by every post; sets of
    them merge into one set, one graph too, that lands the same bytes."""
    options = {"timeout": 30.0, "cuda_ipc": cuda_ipc}
    out = launch(PreparedReadsTask, device="cuda:0", options=options)[0]
    assert out["graphed"] is cuda_ipc
    assert out["merged"] is cuda_ipc and out["merged_graphed"] is cuda_ipc
    assert out["closed"]["live_xfer_handles"] == 0


# -- NIXL_RDT under RayLauncher ----------------------------------------------------------------


class SendRecvAndOneSidedTask(GlobalCoordinatorDistributedTask):
    """The send/recv task, then the one-sided task, in one launch (one set of actors)."""

    def post_init_distributed(self, **kwargs: Any) -> Any:
        stats = SendRecvTask.post_init_distributed(self, **kwargs)  # type: ignore[arg-type]
        facts = OneSidedTask.post_init_distributed(self, **kwargs)  # type: ignore[arg-type]
        return stats, facts


@pytest.mark.ray
@distributed_test(timeout=240)
def test_send_recv_and_one_sided_under_ray_launcher_cpu(ray_session: Any) -> None:
    from vllm_dist import RayLauncher

    results = RayLauncher(2, timeout=LAUNCH_TIMEOUT).launch(
        task_type=SendRecvAndOneSidedTask,
        coordinator_type=CoordinatorType.TORCH_DISTRIBUTED,
        communicator_type=CommunicatorType.NIXL_RDT,
        device="cpu",
        communicator_options={"timeout": 30.0},
    )
    assert len(results) == 2
    for stats, _ in results:
        assert stats["live_xfer_handles"] == 0 and stats["leaked_xfer_handles"] == 0
    assert results[0][1]["mem_type"] == "DRAM"
    assert results[0][1]["last_xfer_backend"] == "shared_memory"  # Ray's workers share the node


@pytest.mark.ray
@distributed_test(gpus=1, timeout=300)
def test_send_recv_and_one_sided_under_ray_launcher_vram_same_gpu(ray_session: Any) -> None:
    from vllm_dist import RayLauncher

    results = RayLauncher(2, num_gpus_per_task=0.5, timeout=LAUNCH_TIMEOUT).launch(
        task_type=SendRecvAndOneSidedTask,
        coordinator_type=CoordinatorType.TORCH_DISTRIBUTED,
        communicator_type=CommunicatorType.NIXL_RDT,
        device="cuda:0",
        communicator_options={"timeout": 30.0},
    )
    assert all(stats["live_xfer_handles"] == 0 for stats, _ in results)
    assert results[0][1]["mem_type"] == "VRAM"


# -- Ray Direct Transport: tensor_transport="nixl" between two Ray actors ----------------------
#
# The consumer calls the producer itself, so it owns the refs and fetches them with ray.get (a
# ref passed as a top-level actor argument would be resolved by Ray before the call starts).

RDT_SIZES = [1, 3, 4096, (1 << 20) + 7, 16 << 20]
RDT_TIMEOUT = 20.0  # one fetch, in the consumer
RDT_CALL_TIMEOUT = 120.0  # one consumer call, in the test: nothing waits longer


def rdt_pattern(nbytes: int, seed: int, device: str = "cpu") -> torch.Tensor:
    """Made where it lives (a CUDA generator is deterministic per seed too): cheap for 1 GiB."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen, device=device)


@functools.cache
def _rdt_actor_classes() -> tuple[Any, Any]:
    """The producer / consumer actor classes (built on first use: Ray is imported only then)."""
    import ray

    class RdtProducer:
        """Returns tensors through RDT: fresh ones, or one persistent registered buffer."""

        def __init__(self, device: str = "cpu", persistent_nbytes: int = 0) -> None:
            nixl_rdt.prepare_ray_rdt_actor(device)  # before Ray creates this actor's NIXL agent
            self.device = device
            self.buf: torch.Tensor | None = None
            if persistent_nbytes:
                self.buf = torch.zeros(persistent_nbytes, dtype=torch.uint8, device=device)
                nixl_rdt.ray_rdt_register(self.buf)

        @ray.method(tensor_transport="nixl")
        def make(self, sizes: list[int], seed: int) -> list[torch.Tensor]:
            return [rdt_pattern(n, seed + i, self.device) for i, n in enumerate(sizes)]

        @ray.method(tensor_transport="nixl")
        def make_one(self, nbytes: int, seed: int) -> torch.Tensor:
            return rdt_pattern(nbytes, seed, self.device)

        @ray.method(tensor_transport="nixl")
        def refill(self, seed: int) -> torch.Tensor:
            """The weight-sync pattern: rewrite the registered buffer once no ref holds it."""
            from ray.experimental import wait_tensor_freed

            assert self.buf is not None
            wait_tensor_freed(self.buf, timeout=RDT_TIMEOUT)
            self.buf.copy_(rdt_pattern(self.buf.numel(), seed, self.device))
            return self.buf

        @ray.method(tensor_transport="nixl")
        def stall(self, seconds: float) -> torch.Tensor:
            time.sleep(seconds)
            return torch.ones(16, dtype=torch.uint8, device=self.device)

        def pid(self) -> int:
            return os.getpid()

    class RdtConsumer:
        """Calls a producer and fetches what it returns into preallocated targets."""

        def __init__(self, device: str = "cpu") -> None:
            nixl_rdt.prepare_ray_rdt_actor(device)
            self.device = device

        def env(self) -> dict[str, str]:
            return {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "CUDA_VIS"))}

        def fetch(self, producer: Any, sizes: list[int], seed: int, rounds: int) -> list[Any]:
            """Per round: (bytes equal, seconds, the value's tensors are the targets)."""
            import ray

            out = []
            targets = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes]
            for r in range(rounds):
                for t in targets:
                    t.zero_()
                if len(sizes) == 1 and r % 2:  # the bare tensor
                    ref = producer.make_one.remote(sizes[0], seed + r)
                else:  # a list of tensors
                    ref = producer.make.remote(sizes, seed + r)
                ray.wait([ref], timeout=RDT_TIMEOUT)  # time the transfer, not the producing
                start = time.monotonic()
                try:
                    value = nixl_rdt.ray_rdt_fetch_into(ref, targets, timeout=RDT_TIMEOUT)
                except (nixl_rdt.NixlTransferError, nixl_rdt.RayRdtUnavailableError) as exc:
                    return [(type(exc).__name__, str(exc))]
                secs = time.monotonic() - start
                got = [value] if isinstance(value, torch.Tensor) else list(value)
                same = all(a.data_ptr() == b.data_ptr() for a, b in zip(got, targets, strict=True))
                ok = all(
                    torch.equal(t, rdt_pattern(n, seed + r + i, self.device))
                    for i, (t, n) in enumerate(zip(targets, sizes, strict=True))
                )
                out.append((ok, secs, same))
            return out

        def fetch_lent(self, refs: list[Any], sizes: list[int], seed: int) -> bool:
            """Fetch a ref the caller owns and lent inside a list."""
            targets = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes]
            nixl_rdt.ray_rdt_fetch_into(refs[0], targets, timeout=RDT_TIMEOUT)
            return all(
                torch.equal(t, rdt_pattern(n, seed + i, self.device))
                for i, (t, n) in enumerate(zip(targets, sizes, strict=True))
            )

        def fetch_refills(self, producer: Any, nbytes: int, rounds: int) -> list[bool]:
            target = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            oks = []
            for r in range(rounds):
                ref = producer.refill.remote(100 + r)
                nixl_rdt.ray_rdt_fetch_into(ref, [target], timeout=RDT_TIMEOUT)
                del ref  # lets the producer's next refill rewrite its buffer
                oks.append(torch.equal(target, rdt_pattern(nbytes, 100 + r, self.device)))
            return oks

        def fetch_after_kill(self, producer: Any, when: str, timeout: float) -> Any:
            """Kill ``producer`` after it returned, or while it works; then fetch its ref."""
            import ray

            pid = ray.get(producer.pid.remote(), timeout=RDT_CALL_TIMEOUT)
            nbytes = 1 << 20 if when == "after_return" else 16
            if when == "after_return":
                ref = producer.make_one.remote(nbytes, 7)
                ray.wait([ref], timeout=RDT_CALL_TIMEOUT)
            else:
                ref = producer.stall.remote(RDT_CALL_TIMEOUT)
            target = torch.empty(nbytes, dtype=torch.uint8)
            results = []
            if when == "before_return":  # alive but stuck: the wait for it ends at the timeout
                results.append(self._fetch_error(ref, target, 1.0))
            ray.kill(producer, no_restart=True)
            for _ in range(200):  # the process is gone before the fetch starts
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.05)
            results.append(self._fetch_error(ref, target, timeout))
            return results

        @staticmethod
        def _fetch_error(ref: Any, target: torch.Tensor, timeout: float) -> tuple[str, float, str]:
            start = time.monotonic()
            try:
                nixl_rdt.ray_rdt_fetch_into(ref, [target], timeout=timeout)
            except Exception as exc:  # noqa: BLE001 - the test checks the type
                return type(exc).__name__, time.monotonic() - start, str(exc)
            return "no error", time.monotonic() - start, ""

    return RdtProducer, RdtConsumer


def _rdt_actor(ray: Any, which: int, *args: Any, num_gpus: float = 0, **kw: Any) -> Any:
    opts: dict[str, Any] = {"num_cpus": 0, "num_gpus": num_gpus, "max_restarts": 0}
    if num_gpus:  # both actors, before Ray creates their NIXL agents; UCX logs its protocols
        env = {"UCX_PROTO_INFO": os.environ.get("UCX_PROTO_INFO", "y"), **nixl_rdt.ray_rdt_env()}
        opts["runtime_env"] = {"env_vars": env}
    return ray.remote(**opts)(_rdt_actor_classes()[which]).remote(*args, **kw)


def _kill(ray: Any, *actors: Any) -> None:
    for actor in actors:
        with contextlib.suppress(Exception):
            ray.kill(actor, no_restart=True)


@pytest.mark.ray
@distributed_test(timeout=240)
def test_ray_rdt_fetch_into_targets_cpu(ray_session: Any) -> None:
    ray = ray_session
    consumer = _rdt_actor(ray, 1, "cpu")
    producer = _rdt_actor(ray, 0, "cpu", persistent_nbytes=(1 << 20) + 1)
    dead = [_rdt_actor(ray, 0, "cpu") for _ in range(2)]  # started alongside, killed below
    try:
        # every size alone (a list of one; the bare tensor on odd rounds), then all in one object
        for n in RDT_SIZES:
            rounds = ray.get(consumer.fetch.remote(producer, [n], n, 2), timeout=RDT_CALL_TIMEOUT)
            assert all(r[0] is True and r[2] for r in rounds), (n, rounds)
        rounds = ray.get(consumer.fetch.remote(producer, RDT_SIZES, 1, 2), timeout=RDT_CALL_TIMEOUT)
        assert all(r[0] is True and r[2] for r in rounds), rounds
        # repeated fetches of one registered buffer, rewritten between rounds once it is freed
        oks = ray.get(
            consumer.fetch_refills.remote(producer, (1 << 20) + 1, 6), timeout=RDT_CALL_TIMEOUT
        )
        assert oks == [True] * 6
        # refs this process owns, lent to the consumer inside a list once Ray can lend them
        lent = [4096, (1 << 20) + 7]
        for r in range(8):
            ref = producer.make.remote(lent, 50 + r)
            nixl_rdt.ray_rdt_wait_lendable([ref], timeout=RDT_TIMEOUT)
            ok = ray.get(consumer.fetch_lent.remote([ref], lent, 50 + r), timeout=RDT_CALL_TIMEOUT)
            assert ok is True, r

        # a producer killed after it returned (the READ finds no agent), or while it works
        timeout = 5.0
        for when, victim in zip(("after_return", "before_return"), dead, strict=True):
            results = ray.get(
                consumer.fetch_after_kill.remote(victim, when, timeout), timeout=RDT_CALL_TIMEOUT
            )
            if when == "before_return":  # first, while it was alive but stuck
                kind, secs, msg = results.pop(0)
                assert kind == "NixlTimeoutError" and 0.9 < secs < 60, (kind, secs, msg)
            (kind, secs, msg) = results[0]
            assert kind in ("NixlTransferError", "NixlTimeoutError"), (when, kind, msg)
            assert secs < timeout + 3, (when, kind, secs, msg)
            assert "Ray Direct Transport" in msg and "producer" in msg, msg
            print(f"dead producer {when}: {kind} after {secs:.2f} s: {msg.splitlines()[0]}")
        # the consumer is still fine
        rounds = ray.get(consumer.fetch.remote(producer, [4096], 5, 1), timeout=RDT_CALL_TIMEOUT)
        assert rounds[0][0] is True, rounds
    finally:
        _kill(ray, consumer, producer, *dead)


def test_ray_rdt_fetch_checks_its_arguments() -> None:
    pytest.importorskip("ray")
    with pytest.raises(ValueError, match="timeout"):
        nixl_rdt.ray_rdt_fetch_into(object(), [torch.empty(1)], timeout=0)
    with pytest.raises(ValueError, match="non-empty"):
        nixl_rdt.ray_rdt_fetch_into(object(), [], timeout=1)
    with pytest.raises(ValueError, match="contiguous"):
        nixl_rdt.ray_rdt_fetch_into(object(), [torch.empty(4, 4).t()], timeout=1)


@pytest.mark.ray
@distributed_test(gpus=1, timeout=300)
def test_ray_rdt_fetch_into_targets_vram_same_gpu(ray_session: Any) -> None:
    """Two actors sharing one GPU (0.5 each): passes, or fails with our error; never hangs."""
    ray = ray_session
    assert ray.cluster_resources().get("GPU", 0) >= 1, f"Ray sees no GPU: {ray.cluster_resources()}"
    rdt_same_device_check(ray, "cuda", 0.5, [1, 4096, (1 << 20) + 7, 64 << 20, 1 << 30])


def rdt_same_device_check(ray: Any, device: str, num_gpus: float, sizes: list[int]) -> None:
    """Fetch every size 3 times between two actors on ``device``; every wait bounded."""
    consumer = _rdt_actor(ray, 1, device, num_gpus=num_gpus)
    producer = _rdt_actor(ray, 0, device, num_gpus=num_gpus, persistent_nbytes=(64 << 20) + 1)
    call = 90.0  # 3 fetches of RDT_TIMEOUT each, and the patterns
    try:
        try:
            env = ray.get(consumer.env.remote(), timeout=call)
        except ray.exceptions.GetTimeoutError:
            pytest.fail(f"the consumer actor did not start within {call} s")
        # set in both actors before their NIXL agents exist (the user's own value wins)
        want = nixl_rdt.ray_rdt_env()[nixl_rdt.CUDA_IPC_GET_ZCOPY]
        assert env.get(nixl_rdt.CUDA_IPC_GET_ZCOPY) == want, env
        for n in sizes:
            try:
                rounds = ray.get(consumer.fetch.remote(producer, [n], n, 3), timeout=call)
            except ray.exceptions.GetTimeoutError:
                pytest.fail(f"the consumer hung past {call} s at {n} bytes (env {env})")
            except ray.exceptions.RayActorError as exc:
                pytest.fail(f"an actor died during the {n}-byte fetch (env {env}): {exc}")
            if isinstance(rounds[0][0], str):  # our error, raised in the consumer
                pytest.fail(f"{n} bytes: {rounds[0][0]}: {rounds[0][1]} (env {env})")
            assert all(r[0] is True and r[2] for r in rounds), (n, rounds)
            best = min(r[1] for r in rounds)
            print(f"RDT {device} {n} B: best {best * 1e3:.2f} ms, {n / best / 1e9:.3f} GB/s")
        oks = ray.get(consumer.fetch_refills.remote(producer, (64 << 20) + 1, 4), timeout=call)
        assert oks == [True] * 4
    finally:
        _kill(ray, consumer, producer)


_MAKE_AGENT = """
import sys
from vllm_dist.implementations.communicators.nixl.agent import load_nixl
api = load_nixl()
api.nixl_agent("a", api.nixl_agent_config(backends=["UCX"]))
print("made", file=sys.stderr)
"""


@pytest.mark.parametrize("level, noisy", [(None, False), ("DEBUG", True)])
def test_nixl_and_ucx_stay_quiet_unless_asked(level: str | None, noisy: bool) -> None:
    """NIXL's INFO lines (and UCX's) show only with VLLM_DIST_LOG_LEVEL=DEBUG or their own
    variables; errors always show."""
    env = {k: v for k, v in os.environ.items() if k not in ("NIXL_LOG_LEVEL", "UCX_LOG_LEVEL")}
    env.pop("VLLM_DIST_LOG_LEVEL", None)
    if level:
        env["VLLM_DIST_LOG_LEVEL"] = level
    env["PYTHONPATH"] = os.getcwd() + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", _MAKE_AGENT], env=env, capture_output=True, text=True, timeout=120
    )
    out = proc.stdout + proc.stderr  # NIXL logs to stdout
    assert proc.returncode == 0 and "made" in out, out[-2000:]
    assert ("NIXL INFO" in out) == noisy, out[-2000:]
