"""NIXL_RDT: real NIXL agents in real processes, bytes checked.

CPU (DRAM) tests always run where nixl is installed; the VRAM variants need one GPU and put both
processes on it (the same-GPU CUDA IPC path). Every launch has a timeout.
"""

from __future__ import annotations

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

pytest.importorskip("nixl", reason="needs the nixl package (pip install 'vllm_dist[nixl]')")

from vllm_dist.implementations.communicators import nixl_rdt  # noqa: E402

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
        if rank == 1:
            buf = pattern(nbytes, 11, dev)
            desc = comm.expose(buf, "weights")  # type: ignore[attr-defined]
            assert desc.nbytes == nbytes and desc.rank == 1
        else:
            comm.expose(torch.zeros(16, dtype=torch.uint8, device=dev), "unused")  # type: ignore[attr-defined]
        table = comm.exchange_exposed()  # type: ignore[attr-defined]
        ref = pattern(nbytes, 11)
        if rank == 0:
            assert set(table[1]) == {"weights"}
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


class RepeatTask(GlobalCoordinatorDistributedTask):
    """Many transfers of reused and fresh buffers: handles and registrations must not grow."""

    def post_init_distributed(self, rounds: int = 200, **kwargs: Any) -> Any:
        comm = self.communicator
        dev = str(self.device)
        rank = self.coordinator.get_rank()
        buf = torch.zeros(1 << 16, dtype=torch.uint8, device=dev)
        comm.expose(buf, "ring")  # type: ignore[attr-defined]
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
def test_one_sided_read_write_many_descriptors_cpu() -> None:
    facts = launch(OneSidedTask)
    assert facts[0]["mem_type"] == "DRAM"
    assert facts[0]["last_xfer_backend"] == "UCX"


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
    assert by_op["send"][0] == "NixlTimeoutError" and by_op["send"][1] < 6, by_op
    # afterwards UCX knows the endpoint is gone: a typed error at once, or at the timeout
    for op in ("recv", "read"):
        assert by_op[op][0] in ("NixlTimeoutError", "NixlTransferError"), by_op
        assert by_op[op][1] < 6, by_op
    assert "closed" in by_op


# -- set-up errors ----------------------------------------------------------------------------


def test_missing_nixl_names_the_install_command() -> None:
    code = (
        "import sys; sys.modules['nixl'] = None\n"
        "import vllm_dist\n"
        "from vllm_dist.registry import get_communicator_class\n"
        "cls = get_communicator_class('nixl_rdt')\n"
        "print('REASON', cls.unavailable_reason('cpu'))\n"
        "from vllm_dist.implementations.communicators.nixl_rdt import _load_nixl\n"
        "try:\n"
        "    _load_nixl()\n"
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
    assert nixl_rdt.check_ray_rdt_version("2.56.0rc1") == "2.56.0rc1"
    with pytest.raises(nixl_rdt.RayRdtUnavailableError, match=r"pip install -U"):
        nixl_rdt.check_ray_rdt_version("2.55.1")
    assert nixl_rdt.ray_rdt_env({}) == {nixl_rdt.CUDA_IPC_GET_ZCOPY: "y"}
    user = {nixl_rdt.CUDA_IPC_GET_ZCOPY: "n"}
    assert nixl_rdt.ray_rdt_env(user) == user  # the user's UCX settings win


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
