"""PyNCCL: library loading, errors, unique ids and dtype mapping on CPU; every operation on GPUs.

The CPU tests need a libnccl (the ``nvidia-nccl-cu13`` wheel, torch's copy, the system's, or
``VLLM_DIST_NCCL_SO_PATH``) and skip, saying so, when none is found: ``ncclGetUniqueId`` and the
error strings work without a GPU. The GPU tests start real workers through ``MPLauncher``.

GPU tests: ``python3 -m pytest -q tests/test_pynccl.py -m gpu`` on a machine with 1, 2 or 4 GPUs
(each test skips when it needs more GPUs than there are).
"""

from __future__ import annotations

import inspect
import math
import os
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.utils import cuda_device_count, distributed_test, nccl_env
from vllm_dist import (
    CommOp,
    CommunicatorType,
    CoordinatorType,
    GlobalCoordinatorDistributedTask,
    GroupCoordinatorDistributedTask,
    MPLauncher,
    ReduceOp,
    get_communicator_class,
)
from vllm_dist.implementations.communicators.pynccl import communicator as pynccl_comm
from vllm_dist.implementations.communicators.pynccl import library
from vllm_dist.implementations.communicators.pynccl.communicator import PyNcclCommunicator
from vllm_dist.implementations.communicators.pynccl.library import (
    ENV_VAR,
    NcclDataType,
    NcclError,
    NcclLibraryError,
    NcclRedOp,
    NcclResult,
    NcclUniqueId,
    load_nccl,
)
from vllm_dist.interfaces import BackendUnavailableError

LAUNCH_TIMEOUT = 150.0
NO_GPU = cuda_device_count() == 0


@pytest.fixture(scope="module")
def nccl() -> library.NcclLibrary:
    try:
        return load_nccl()
    except NcclLibraryError as exc:
        pytest.skip(f"no libnccl here (pip install nvidia-nccl-cu13 to run this test): {exc}")


# -- loading ----------------------------------------------------------------------------------
def test_search_records_where_the_library_came_from(nccl: library.NcclLibrary) -> None:
    lib = load_nccl(environ={})
    assert lib.source in {"torch", "nvidia-nccl wheel", "system"}
    if lib.source != "system":
        assert os.path.isfile(lib.path)
    assert all(a.error for a in lib.attempts), "every candidate passed over says why"
    assert lib.path in repr(lib) and lib.version_string in repr(lib)


def test_wheel_copy_is_preferred_over_the_system(nccl: library.NcclLibrary) -> None:
    wheels = [p for s, p in library._auto_candidates() if s == "nvidia-nccl wheel"]
    if not wheels:
        pytest.skip("no nvidia-nccl-cu12/cu13 wheel installed")
    assert load_nccl(environ={}).source in {"torch", "nvidia-nccl wheel"}


def test_env_var_is_used(nccl: library.NcclLibrary) -> None:
    lib = load_nccl(environ={ENV_VAR: nccl.path})
    assert (lib.source, lib.path) == (ENV_VAR, nccl.path)


def test_explicit_path_wins_over_env_var(nccl: library.NcclLibrary) -> None:
    lib = load_nccl(nccl.path, environ={ENV_VAR: "/nonexistent/libnccl.so.2"})
    assert (lib.source, lib.path) == ("argument", nccl.path)


def test_bad_explicit_path_names_the_path_and_the_fix(tmp_path: Any) -> None:
    missing = str(tmp_path / "libnccl.so.2")
    with pytest.raises(NcclLibraryError) as info:
        load_nccl(missing, environ={})
    message = str(info.value)
    assert missing in message and "pass the path of a libnccl.so.2" in message
    assert isinstance(info.value, BackendUnavailableError) and isinstance(info.value, ImportError)


def test_a_file_that_is_no_library_is_refused(tmp_path: Any) -> None:
    junk = tmp_path / "libnccl.so.2"
    junk.write_text("not an ELF file")
    with pytest.raises(NcclLibraryError, match="cannot load libnccl from the path given"):
        load_nccl(str(junk))


def test_a_library_without_nccl_symbols_is_refused() -> None:
    with pytest.raises(NcclLibraryError, match="no symbol ncclGetVersion"):
        load_nccl("libc.so.6")


def test_bad_env_var_names_the_variable() -> None:
    with pytest.raises(NcclLibraryError) as info:
        load_nccl(environ={ENV_VAR: "/nonexistent/libnccl.so.2"})
    message = str(info.value)
    assert f"{ENV_VAR}='/nonexistent/libnccl.so.2'" in message and "unset it" in message


def test_nothing_found_lists_every_attempt_and_the_install(monkeypatch: Any) -> None:
    candidates = [("torch", "/nope/torch/lib/libnccl.so.2"), ("system", "/nope/libnccl.so.2")]
    monkeypatch.setattr(library, "_auto_candidates", lambda: iter(candidates))
    with pytest.raises(NcclLibraryError) as info:
        load_nccl(environ={})
    message = str(info.value)
    for _, path in candidates:
        assert path in message
    assert "pip install nvidia-nccl-cu13" in message and ENV_VAR in message


# -- version, errors, unique ids ---------------------------------------------------------------
def test_version(nccl: library.NcclLibrary) -> None:
    major, minor, patch = nccl.version
    assert major == 2 and minor >= 0 and patch >= 0
    assert nccl.version_string == f"{major}.{minor}.{patch}"


@pytest.mark.parametrize(
    ("code", "version"), [(23203, (2, 32, 3)), (21903, (2, 19, 3)), (2708, (2, 7, 8))]
)
def test_decode_version(code: int, version: tuple[int, int, int]) -> None:
    assert library.decode_version(code) == version


def test_error_strings_come_from_nccl(nccl: library.NcclLibrary) -> None:
    assert "invalid argument" in nccl.error_string(NcclResult.INVALID_ARGUMENT)
    nccl.check(NcclResult.SUCCESS)
    with pytest.raises(NcclError) as info:
        nccl.check(NcclResult.INVALID_USAGE, "ncclAllReduce")
    err = info.value
    assert err.result is NcclResult.INVALID_USAGE
    assert "ncclAllReduce" in str(err) and "invalid usage" in str(err)
    assert err.error_string == nccl.error_string(NcclResult.INVALID_USAGE)


def test_unknown_result_code_still_raises(nccl: library.NcclLibrary) -> None:
    with pytest.raises(NcclError, match="unknown result") as info:
        nccl.check(42)
    assert info.value.result == 42


@pytest.mark.skipif(not NO_GPU, reason="checks the failure of ncclCommInitRank without a GPU")
def test_comm_init_without_gpu_raises_nccl_error_with_last_error(
    nccl: library.NcclLibrary,
) -> None:
    with pytest.raises(NcclError) as info:
        nccl.comm_init_rank(1, nccl.get_unique_id(), 0)
    err = info.value
    assert err.result != NcclResult.SUCCESS and err.error_string in str(err)
    if nccl.version >= (2, 13, 0):
        assert err.last_error, "ncclGetLastError explains the failure"


def test_unique_ids_work_without_gpu(nccl: library.NcclLibrary) -> None:
    first, second = nccl.get_unique_id(), nccl.get_unique_id()
    assert len(first) == len(second) == library.UNIQUE_ID_BYTES == 128
    assert first != second and any(first)
    assert NcclUniqueId.from_bytes(first).to_bytes() == first


def test_unique_id_of_wrong_size_is_refused() -> None:
    with pytest.raises(ValueError, match="128 bytes, got 5"):
        NcclUniqueId.from_bytes(b"short")


# -- dtypes and reduce ops ---------------------------------------------------------------------
NEW = (2, 32, 0)


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (torch.int8, NcclDataType.INT8),
        (torch.uint8, NcclDataType.UINT8),
        (torch.int32, NcclDataType.INT32),
        (torch.int64, NcclDataType.INT64),
        (torch.float16, NcclDataType.FLOAT16),
        (torch.float32, NcclDataType.FLOAT32),
        (torch.float64, NcclDataType.FLOAT64),
        (torch.bfloat16, NcclDataType.BFLOAT16),
        (torch.float8_e4m3fn, NcclDataType.FLOAT8_E4M3),
        (torch.float8_e5m2, NcclDataType.FLOAT8_E5M2),
    ],
)
def test_torch_dtypes_map_to_nccl(dtype: torch.dtype, expected: NcclDataType) -> None:
    assert library.nccl_dtype(dtype, NEW) is expected
    assert library.torch_dtype_table(NEW)[dtype] is expected


@pytest.mark.parametrize("dtype", [torch.complex64, torch.bool, torch.int16, torch.float8_e4m3fnuz])
def test_unsupported_dtype_names_itself_and_the_fix(dtype: torch.dtype) -> None:
    with pytest.raises(ValueError) as info:
        library.nccl_dtype(dtype, NEW)
    message = str(info.value)
    assert str(dtype) in message and "bfloat16" in message and "Cast the tensor" in message


@pytest.mark.parametrize(
    ("dtype", "version", "needed"),
    [
        (torch.float8_e4m3fn, (2, 21, 5), "2.24.0"),
        (torch.float8_e5m2, (2, 23, 4), "2.24.0"),
        (torch.bfloat16, (2, 8, 4), "2.10.0"),
    ],
)
def test_dtype_too_new_for_the_library(dtype: torch.dtype, version: Any, needed: str) -> None:
    with pytest.raises(ValueError, match=f"needs NCCL >= {needed}"):
        library.nccl_dtype(dtype, version)
    assert dtype not in library.torch_dtype_table(version)


def test_reduce_ops_map_to_nccl() -> None:
    expected = {
        ReduceOp.SUM: NcclRedOp.SUM,
        ReduceOp.PRODUCT: NcclRedOp.PROD,
        ReduceOp.MIN: NcclRedOp.MIN,
        ReduceOp.MAX: NcclRedOp.MAX,
        ReduceOp.AVG: NcclRedOp.AVG,
    }
    assert {op: library.nccl_red_op(op, NEW) for op in ReduceOp} == expected
    with pytest.raises(ValueError, match="needs NCCL >= 2.10.0"):
        library.nccl_red_op(ReduceOp.AVG, (2, 9, 9))
    with pytest.raises(ValueError, match="valid: sum"):
        library.nccl_red_op("xor", NEW)


# -- the communicator without a GPU ------------------------------------------------------------
class _NoCallsCoordinator:
    """Enough of a coordinator for the checks made before any collective."""

    def get_local_rank(self) -> int:
        return 0

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the communicator reached coordinator.{name} before validating")


def test_registry_resolves_pynccl_with_cuda_graph_support() -> None:
    cls = get_communicator_class(CommunicatorType("pynccl"))
    assert cls is PyNcclCommunicator
    assert CommOp.CUDA_GRAPH in cls.supported_ops
    assert {CommOp.ALL_REDUCE, CommOp.SEND, CommOp.RECV} <= cls.supported_ops


def test_importing_creates_no_cuda_context() -> None:
    code = (
        "import torch\n"
        "from vllm_dist.implementations.communicators.pynccl.communicator import PyNcclCommunicator\n"
        "PyNcclCommunicator.unavailable_reason('cuda')\n"
        "assert not torch.cuda.is_initialized(), 'a CUDA context was created'\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=root, env=env)


def test_unavailable_on_cpu_says_nccl_needs_cuda() -> None:
    reason = PyNcclCommunicator.unavailable_reason("cpu")
    assert reason is not None and "NCCL needs CUDA devices" in reason


@pytest.mark.skipif(not NO_GPU, reason="checks the reason given on a machine without CUDA")
def test_unavailable_on_cuda_without_gpu_says_why() -> None:
    reason = PyNcclCommunicator.unavailable_reason("cuda")
    assert reason is not None and "CUDA" in reason


def test_unavailable_on_cuda_without_libnccl_names_the_fix(monkeypatch: Any) -> None:
    monkeypatch.setattr(pynccl_comm, "_no_cuda_reason", lambda: None)
    monkeypatch.setenv(ENV_VAR, "/nonexistent/libnccl.so.2")
    reason = PyNcclCommunicator.unavailable_reason("cuda")
    assert reason is not None and ENV_VAR in reason and "libnccl" in reason


def test_constructor_refuses_a_cpu_device() -> None:
    with pytest.raises(ValueError, match="CUDA memory.*TORCH_DISTRIBUTED"):
        PyNcclCommunicator(_NoCallsCoordinator(), device="cpu")  # type: ignore[arg-type]


@pytest.mark.skipif(not NO_GPU, reason="checks the error raised on a machine without CUDA")
@pytest.mark.parametrize("device", [None, "cuda"])
def test_constructor_without_cuda_is_backend_unavailable(device: str | None) -> None:
    with pytest.raises(BackendUnavailableError, match="NCCL needs CUDA devices"):
        PyNcclCommunicator(_NoCallsCoordinator(), device=device)  # type: ignore[arg-type]


# -- GPU: tasks run in every worker ------------------------------------------------------------
def _launch(n: int, task: type, **kwargs: Any) -> list[Any]:
    return MPLauncher(n, timeout=LAUNCH_TIMEOUT, env=nccl_env(n)).launch(
        task_type=task,
        coordinator_type=CoordinatorType.TORCH_DISTRIBUTED,
        communicator_type=CommunicatorType.PYNCCL,
        device="cuda",
        **kwargs,
    )


def _expect(tensor: torch.Tensor, value: float) -> None:
    expected = torch.full_like(tensor, value)
    torch.testing.assert_close(tensor, expected, rtol=0, atol=0)


class CollectivesTask(GlobalCoordinatorDistributedTask):
    """Every operation with rank-dependent values; checks the results in the worker."""

    def post_init_distributed(self) -> dict[str, Any]:
        comm = self.communicator
        assert isinstance(comm, PyNcclCommunicator)
        self.rank, self.world = comm.rank, comm.world_size
        self._all_reduce(comm)
        self._all_gather(comm)
        self._reduce_scatter(comm)
        self._broadcast(comm)
        if self.world > 1:
            self._point_to_point(comm)
        torch.cuda.synchronize(self.device)
        return comm.describe()

    def _all_reduce(self, comm: PyNcclCommunicator) -> None:
        w, r = self.world, self.rank
        values = [float(i + 1) for i in range(w)]
        expected = {
            ReduceOp.SUM: sum(values),
            ReduceOp.PRODUCT: math.prod(values),
            ReduceOp.MIN: 1.0,
            ReduceOp.MAX: float(w),
            ReduceOp.AVG: sum(values) / w,
        }
        for op, value in expected.items():
            _expect(comm.all_reduce(torch.full((1000,), r + 1.0, device=self.device), op=op), value)
        for dtype in (torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8):
            t = torch.full((17,), r + 1, dtype=dtype, device=self.device)
            _expect(comm.all_reduce(t), w * (w + 1) // 2)
        t_in = torch.full((33,), r + 1.0, device=self.device)
        t_out = torch.empty_like(t_in)
        assert comm.all_reduce(t_in, t_out) is t_out
        _expect(t_out, sum(values))
        _expect(t_in, r + 1.0)  # out of place leaves the input alone

    def _all_gather(self, comm: PyNcclCommunicator) -> None:
        w, r = self.world, self.rank
        out = comm.all_gather(torch.full((2, 3), float(r), device=self.device))
        assert out.shape == (2 * w, 3)
        for i in range(w):
            _expect(out[2 * i : 2 * i + 2], float(i))
        # NCCL has no complex type: it travels as bytes
        z = torch.full((4,), complex(r, -r), dtype=torch.complex64, device=self.device)
        out_z = torch.empty((4 * w,), dtype=torch.complex64, device=self.device)
        assert comm.all_gather(z, out_z) is out_z
        for i in range(w):
            _expect(out_z[4 * i : 4 * i + 4], complex(i, -i))

    def _reduce_scatter(self, comm: PyNcclCommunicator) -> None:
        w, r = self.world, self.rank
        base = torch.arange(w * 4, dtype=torch.float32, device=self.device)
        out = comm.reduce_scatter(base + r)
        full = base * w + sum(range(w))
        torch.testing.assert_close(out, full[4 * r : 4 * r + 4], rtol=0, atol=0)
        out_max = torch.empty(4, device=self.device)
        comm.reduce_scatter(base + r, out_max, op=ReduceOp.MAX)
        torch.testing.assert_close(out_max, (base + w - 1)[4 * r : 4 * r + 4], rtol=0, atol=0)

    def _broadcast(self, comm: PyNcclCommunicator) -> None:
        for src in range(self.world):
            t = torch.full((5,), float(self.rank), device=self.device)
            _expect(comm.broadcast(t, src), float(src))
            flags = torch.full((7,), self.rank == src, dtype=torch.bool, device=self.device)
            assert bool(comm.broadcast(flags, src).all())
        t = torch.full((9,), float(self.rank), device=self.device)
        comm.reduce(t, dst=0)
        if self.rank == 0:
            _expect(t, float(sum(range(self.world))))

    def _point_to_point(self, comm: PyNcclCommunicator) -> None:
        w, r = self.world, self.rank
        if r == 0:
            comm.send(torch.full((64,), 42.0, device=self.device), dst=1)
        elif r == 1:
            _expect(comm.recv(torch.zeros(64, device=self.device), src=0), 42.0)
        # a ring exchange deadlocks one call at a time; group() fuses it into one launch
        got = torch.zeros(8, device=self.device)
        with comm.group():
            comm.send(torch.full((8,), float(r), device=self.device), dst=(r + 1) % w)
            comm.recv(got, src=(r - 1) % w)
        _expect(got, float((r - 1) % w))


class ValidationTask(GlobalCoordinatorDistributedTask):
    """Bad arguments raise ValueError / TypeError naming the fix, before NCCL sees them."""

    def post_init_distributed(self) -> list[str]:
        comm = self.communicator
        assert isinstance(comm, PyNcclCommunicator)
        dev = self.device
        ones = torch.ones(8, device=dev)
        cases: list[tuple[Any, type[Exception], str]] = [
            (lambda: comm.all_reduce(torch.ones(8)), ValueError, "move it with .to"),
            (lambda: comm.all_reduce(torch.ones(4, 4, device=dev).t()), ValueError, "contiguous"),
            (lambda: comm.all_reduce(ones, torch.empty(3, device=dev)), ValueError, "shape"),
            (
                lambda: comm.all_reduce(ones, torch.empty(8, dtype=torch.int32, device=dev)),
                ValueError,
                "dtype",
            ),
            (lambda: comm.all_gather(ones, torch.empty(1, device=dev)), ValueError, "shape"),
            (lambda: comm.reduce_scatter(torch.tensor(1.0, device=dev)), ValueError, "divisible"),
            (
                lambda: comm.all_reduce(torch.ones(2, dtype=torch.complex64, device=dev)),
                ValueError,
                "cannot reduce",
            ),
            (lambda: comm.broadcast(ones, src=comm.world_size), ValueError, "outside"),
            (lambda: comm.send(ones, dst=comm.rank), ValueError, "itself"),
            (lambda: comm.all_reduce(ones, stream=7), TypeError, "torch.cuda.Stream"),
        ]
        if torch.cuda.device_count() > 1:
            other = torch.device("cuda", (dev.index + 1) % torch.cuda.device_count())
            cases.append(
                (lambda: comm.all_reduce(torch.ones(8, device=other)), ValueError, str(dev))
            )
            cases.append(
                (
                    lambda: comm.all_reduce(ones, stream=torch.cuda.Stream(device=other)),
                    ValueError,
                    "torch.cuda.Stream(device=",
                )
            )
        messages = [_raises(fn, exc, text) for fn, exc, text in cases]
        comm.close()
        comm.close()  # idempotent
        messages.append(_raises(lambda: comm.all_reduce(ones), RuntimeError, "closed"))
        return messages


def _raises(fn: Any, exc: type[Exception], text: str) -> str:
    try:
        fn()
    except exc as err:
        assert text in str(err), f"{text!r} not in {err!r}"
        return str(err)
    raise AssertionError(f"expected {exc.__name__} containing {text!r}")


class GraphTask(GlobalCoordinatorDistributedTask):
    """Capture collectives into a CUDA graph; each replay reduces the buffer's new values."""

    def post_init_distributed(self) -> list[float]:
        comm, dev = self.communicator, self.device
        assert isinstance(comm, PyNcclCommunicator)
        r, w = comm.rank, comm.world_size
        x = torch.zeros(1024, device=dev)
        out = torch.empty_like(x)
        side = torch.cuda.Stream(device=dev)  # warm up off the default stream, as torch advises
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            comm.all_reduce(x, out)
            comm.all_gather(x[:4])
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            comm.all_reduce(x, out)
            gathered = comm.all_gather(x[:4])  # allocated inside the capture, from its pool
            doubled = out * 2
        seen = []
        for step in range(3):
            x.fill_(float(10 * step + r))
            graph.replay()
            torch.cuda.synchronize(dev)
            total = float(sum(10 * step + i for i in range(w)))
            _expect(out, total)
            _expect(doubled, 2 * total)
            for i in range(w):
                _expect(gathered[4 * i : 4 * i + 4], float(10 * step + i))
            seen.append(out[0].item())
        assert len(set(seen)) == 3, f"replays did not see the new values: {seen}"
        return seen


class StreamTask(GlobalCoordinatorDistributedTask):
    """``stream=`` puts the operation on that stream, not on the current one."""

    def post_init_distributed(self) -> bool:
        comm, dev = self.communicator, self.device
        assert isinstance(comm, PyNcclCommunicator)
        w, r = comm.world_size, comm.rank
        current = torch.cuda.current_stream(dev)
        stream = torch.cuda.Stream(device=dev)
        x = torch.full((1 << 16,), float(r + 1), device=dev)
        ones = torch.ones(2 * w, device=dev)
        comm.all_reduce(torch.zeros_like(x))  # connect first, so that the timed call only enqueues
        current.synchronize()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(1_000_000_000)  # keep `stream` busy so the all-reduce queues behind
        comm.all_reduce(x, stream=stream)
        queued_on_stream = not stream.query() and current.query()
        stream.synchronize()
        _expect(x, float(w * (w + 1) // 2))
        extern = torch.cuda.ExternalStream(stream.cuda_stream, device=dev)
        gathered = comm.all_gather(x[:2], stream=extern)
        scattered = comm.reduce_scatter(ones, stream=stream)
        comm.broadcast(x, src=0, stream=stream)
        stream.synchronize()
        _expect(gathered, float(w * (w + 1) // 2))
        _expect(scattered, float(w))
        return queued_on_stream


class DeadPeerTask(GlobalCoordinatorDistributedTask):
    """Rank 1 leaves; rank 0's unmatched all-reduce must not stop close() from returning."""

    def post_init_distributed(self) -> float | None:
        comm = self.communicator
        x = torch.ones(1 << 20, device=self.device)
        comm.all_reduce(x)  # connect both ranks first, so the next call only enqueues
        torch.cuda.synchronize(self.device)
        if self.coordinator.get_rank() == 1:
            return None
        comm.all_reduce(x)  # never matched: the kernel waits for rank 1
        start = time.monotonic()
        comm.close()
        return time.monotonic() - start


class GroupTask(GroupCoordinatorDistributedTask):
    """Each group's communicator reduces and gathers its own members only."""

    def post_init_distributed(self) -> dict[str, Any]:
        comm = self.communicator
        assert isinstance(comm, PyNcclCommunicator)
        me = self.worker_info.rank
        x = comm.all_reduce(torch.full((256,), float(me), device=self.device))
        members = comm.all_gather(torch.tensor([me], device=self.device))
        return {
            "group": self.group_index,
            "rank": comm.rank,
            "world": comm.world_size,
            "sum": x[0].item(),
            "members": members.tolist(),
        }


# -- GPU: the tests ----------------------------------------------------------------------------
@distributed_test(gpus=1, timeout=240)
def test_world_size_1_every_collective() -> None:
    (facts,) = _launch(1, CollectivesTask)
    assert facts["backend"] == "pynccl" and facts["world_size"] == 1
    assert facts["setup_seconds"] >= facts["comm_init_seconds"] > 0


@distributed_test(gpus=1, timeout=240)
def test_world_size_1_validation_names_the_fix() -> None:
    (messages,) = _launch(1, ValidationTask)
    assert len(messages) >= 11


@distributed_test(gpus=1, timeout=240)
def test_world_size_1_cuda_graph_replays_new_values() -> None:
    assert _launch(1, GraphTask) == [[0.0, 10.0, 20.0]]


@distributed_test(gpus=1, timeout=240)
def test_world_size_1_explicit_stream() -> None:
    assert _launch(1, StreamTask) == [True]


@distributed_test(gpus=2, timeout=240, share=True)
def test_two_ranks_every_collective() -> None:
    facts = _launch(2, CollectivesTask)
    assert [f["rank"] for f in facts] == [0, 1]
    if cuda_device_count() >= 2:
        assert facts[0]["device"] != facts[1]["device"]


@distributed_test(gpus=2, timeout=240, share=True)
def test_two_ranks_validation_including_wrong_device() -> None:
    wrong_device_cases = 2 if cuda_device_count() >= 2 else 0  # a second GPU to be wrong about
    for messages in _launch(2, ValidationTask):
        assert len(messages) >= 11 + wrong_device_cases


@distributed_test(gpus=2, timeout=240, share=True)
def test_two_ranks_cuda_graph_replays_new_values() -> None:
    assert _launch(2, GraphTask) == [[1.0, 21.0, 41.0]] * 2


@distributed_test(gpus=2, timeout=240, share=True)
def test_two_ranks_explicit_stream() -> None:
    assert _launch(2, StreamTask) == [True, True]


# Not on a shared GPU: there NCCL's socket transport runs the ranks' proxy threads, and once
# (of two runs on one H200) the departing rank's own abort did not return within 150 s.
@distributed_test(gpus=2, timeout=240)
def test_close_returns_when_a_peer_is_gone() -> None:
    seconds, gone = _launch(2, DeadPeerTask)
    assert gone is None and seconds < 30


@distributed_test(gpus=4, timeout=300, share=True)
@pytest.mark.parametrize("groups", [[[0, 1], [2, 3]], [[0, 3], [2, 1]]])
def test_two_groups_of_two_are_independent(groups: list[list[int]]) -> None:
    unsorted = any(g != sorted(g) for g in groups)
    if unsorted and "sort_ranks" not in inspect.signature(dist.new_group).parameters:
        pytest.skip(f"torch {torch.__version__} cannot keep an unsorted group's order")
    results = _launch(4, GroupTask, groups=groups)
    for rank, result in enumerate(results):
        group = next(g for g in groups if rank in g)
        assert result["group"] == groups.index(group)
        assert (result["rank"], result["world"]) == (group.index(rank), 2)
        assert result["sum"] == float(sum(group))
        assert result["members"] == group
