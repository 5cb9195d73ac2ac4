"""The communicator conformance suite, written once for every backend, shipped for plugins.

``run_conformance(backend, world_size, device)`` launches one ``ConformanceTask`` that runs every
check for the operations the backend declares, and every "unsupported" check for the ones it does
not, on every rank; each check's outcome comes back per rank so a test can name the failing op.
A plugin author runs the suite on their backend with::

    from vllm_dist.testing import CommunicatorConformance
    class TestMyBackend(CommunicatorConformance):
        backend = "my_backend"   # a registered name
        device = "cpu"

This module needs pytest (``pip install vllm_dist[test]``); nothing else of the package imports it.
"""

from __future__ import annotations

import functools
import math
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch

from vllm_dist import (
    CommOp,
    CoordinatorType,
    GlobalCoordinatorDistributedTask,
    MPLauncher,
    ReduceOp,
    UnsupportedOperationError,
    get_communicator_class,
)
from vllm_dist.interfaces import DeviceCommunicator

Check = Callable[[DeviceCommunicator, int, int], str | None]
CHECKS: dict[str, tuple[CommOp, Check]] = {}


def check(name: str, op: CommOp) -> Callable[[Check], Check]:
    def register(fn: Check) -> Check:
        CHECKS[name] = (op, fn)
        return fn

    return register


def _full(comm: DeviceCommunicator, shape: Any, value: float, dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, value, dtype=dtype, device=comm.device)


def _assert_all(t: torch.Tensor, expected: float, what: str) -> None:
    got = t.float()
    if not torch.all(got == expected):
        raise AssertionError(f"{what}: expected {expected}, got values {got.unique()[:8].tolist()}")


@check("all_reduce_sum_in_place", CommOp.ALL_REDUCE)
def _all_reduce_sum(comm: DeviceCommunicator, rank: int, world: int) -> None:
    for numel in (1, 1023, 1 << 18):
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            t = _full(comm, (numel,), rank + 1, dtype)
            out = comm.all_reduce(tensor_in=t)
            assert out is t, "in-place all_reduce must return its input"
            _assert_all(t, world * (world + 1) / 2, f"sum {dtype} x{numel}")


@check("all_reduce_out_of_place", CommOp.ALL_REDUCE)
def _all_reduce_out(comm: DeviceCommunicator, rank: int, world: int) -> None:
    t = _full(comm, (4, 5), rank + 1, torch.float32)
    out = torch.empty_like(t)
    res = comm.all_reduce(tensor_in=t, tensor_out=out)
    assert res is out
    _assert_all(out, world * (world + 1) / 2, "out-of-place result")
    _assert_all(t, rank + 1, "out-of-place input must be untouched")


@check("all_reduce_ops", CommOp.ALL_REDUCE)
def _all_reduce_ops(comm: DeviceCommunicator, rank: int, world: int) -> None:
    expected = {
        ReduceOp.MAX: world,
        ReduceOp.MIN: 1,
        ReduceOp.PRODUCT: math.factorial(world),
        ReduceOp.AVG: (world + 1) / 2,
    }
    for op, value in expected.items():
        t = _full(comm, (33,), rank + 1, torch.float32)
        comm.all_reduce(tensor_in=t, op=op)
        _assert_all(t, value, f"all_reduce {op}")


# the reduction dtypes a backend that declares none (no ``reduce_dtypes``) is held to
DEFAULT_REDUCE_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int32,
    torch.int64,
)
# dtypes no built-in backend reduces: the first one a backend does not declare probes refusal
_UNREDUCED_DTYPES = (torch.bool, torch.int16, torch.complex64, torch.uint16)


def _reduce_dtypes(comm: DeviceCommunicator) -> list[torch.dtype]:
    declared = getattr(comm, "reduce_dtypes", None)
    dtypes = DEFAULT_REDUCE_DTYPES if declared is None else declared
    return sorted(dtypes, key=str)


def _expected_reduction(op: ReduceOp, dtype: torch.dtype, world: int) -> float:
    """What reducing ``rank + 1`` over ``world`` ranks gives; integer AVG as ``ncclAvg`` does
    (the sum's quotient rounded toward zero; the sum is positive here, so that is its floor)."""
    total = world * (world + 1) // 2
    if op is ReduceOp.AVG:
        return total / world if dtype.is_floating_point else total // world
    return {
        ReduceOp.SUM: total,
        ReduceOp.PRODUCT: math.factorial(world),
        ReduceOp.MIN: 1,
        ReduceOp.MAX: world,
    }[op]


def _reduce_or_untouched(call: Callable[[], Any], *tensors: torch.Tensor) -> None:
    """Run ``call``; when it raises, every tensor in ``tensors`` must be as it was before."""
    before = [t.clone() for t in tensors]
    try:
        call()
    except Exception as exc:
        for t, old in zip(tensors, before, strict=True):
            if not torch.equal(t, old):
                raise AssertionError(f"the call raised {exc!r} after changing its input") from exc
        raise


@check("all_reduce_every_op_every_dtype", CommOp.ALL_REDUCE)
def _all_reduce_matrix(comm: DeviceCommunicator, rank: int, world: int) -> None:
    for dtype in _reduce_dtypes(comm):
        for op in ReduceOp:
            what = f"all_reduce {op} {dtype}"
            t = _full(comm, (33,), rank + 1, dtype)
            _reduce_or_untouched(functools.partial(comm.all_reduce, tensor_in=t, op=op), t)
            _assert_all(t, _expected_reduction(op, dtype, world), what)
            out = torch.empty_like(t)
            src = _full(comm, (33,), rank + 1, dtype)
            _reduce_or_untouched(
                functools.partial(comm.all_reduce, tensor_in=src, tensor_out=out, op=op), src
            )
            _assert_all(out, _expected_reduction(op, dtype, world), f"{what} out of place")
            _assert_all(src, rank + 1, f"{what}: out-of-place input must be untouched")


@check("reduce_scatter_every_op_every_dtype", CommOp.REDUCE_SCATTER)
def _reduce_scatter_matrix(comm: DeviceCommunicator, rank: int, world: int) -> None:
    for dtype in _reduce_dtypes(comm):
        for op in ReduceOp:
            t = _full(comm, (world * 5,), rank + 1, dtype)
            out = _reduce_or_untouched_result(functools.partial(comm.reduce_scatter, t, op=op), t)
            assert tuple(out.shape) == (5,), out.shape
            _assert_all(out, _expected_reduction(op, dtype, world), f"reduce_scatter {op} {dtype}")
            _assert_all(t, rank + 1, f"reduce_scatter {op} {dtype}: input must be untouched")


def _reduce_or_untouched_result(call: Callable[[], Any], *tensors: torch.Tensor) -> Any:
    box: list[Any] = []
    _reduce_or_untouched(lambda: box.append(call()), *tensors)
    return box[0]


@check("refused_call_leaves_input_untouched", CommOp.ALL_REDUCE)
def _refused_untouched(comm: DeviceCommunicator, rank: int, world: int) -> None:
    """Every refusal comes before any tensor is written: inputs keep their values. A dtype the
    backend does not declare, or a ``tensor_out`` that does not fit, is bad input (ValueError /
    TypeError)."""
    declared = set(_reduce_dtypes(comm))
    odd = next((d for d in _UNREDUCED_DTYPES if d not in declared), None)
    probes: list[tuple[str, torch.Tensor, torch.Tensor | None, ReduceOp]] = []
    if odd is not None:
        for op in ReduceOp:  # values differ per rank, so a reduction that ran shows
            t = _full(comm, (8,), rank % 2, odd)
            probes.append((f"{odd} {op} in place", t, None, op))
            probes.append((f"{odd} {op} out of place", t.clone(), torch.zeros_like(t), op))
    src = _full(comm, (8,), rank + 1, torch.float32)
    wrong_shape = torch.full((9,), -1.0, device=comm.device)
    wrong_dtype = torch.full((8,), -1, dtype=torch.int32, device=comm.device)
    probes.append(("tensor_out of another shape", src, wrong_shape, ReduceOp.SUM))
    probes.append(("tensor_out of another dtype", src, wrong_dtype, ReduceOp.SUM))
    for what, t, out, op in probes:
        before = t.clone()
        with pytest.raises((ValueError, TypeError)):
            comm.all_reduce(tensor_in=t, tensor_out=out, op=op)
        assert torch.equal(t, before), f"{what}: a refused all_reduce changed its input"
    if odd is not None and CommOp.REDUCE_SCATTER in comm.supported_ops:
        for op in ReduceOp:
            t = _full(comm, (world * 2,), rank % 2, odd)
            before = t.clone()
            with pytest.raises((ValueError, TypeError)):
                comm.reduce_scatter(t, op=op)
            assert torch.equal(t, before), f"{odd} {op}: a refused reduce_scatter changed its input"


@check("all_gather", CommOp.ALL_GATHER)
def _all_gather(comm: DeviceCommunicator, rank: int, world: int) -> None:
    t = _full(comm, (2, 3), rank, torch.float32)
    out = comm.all_gather(tensor_in=t)
    assert tuple(out.shape) == (2 * world, 3), out.shape
    for r in range(world):
        _assert_all(out[2 * r : 2 * r + 2], r, f"all_gather slot {r}")
    given = torch.empty((2 * world, 3), device=comm.device)
    assert comm.all_gather(tensor_in=t, tensor_out=given) is given


@check("reduce_scatter", CommOp.REDUCE_SCATTER)
def _reduce_scatter(comm: DeviceCommunicator, rank: int, world: int) -> None:
    base = torch.arange(world * 4, dtype=torch.float32, device=comm.device)
    out = comm.reduce_scatter(tensor_in=base + rank)
    expected = world * base.chunk(world)[rank] + world * (world - 1) / 2
    assert torch.equal(out, expected), (out, expected)


@check("broadcast", CommOp.BROADCAST)
def _broadcast(comm: DeviceCommunicator, rank: int, world: int) -> None:
    for src in range(world):
        t = _full(comm, (17,), rank, torch.float32)
        assert comm.broadcast(t, src=src) is t
        _assert_all(t, src, f"broadcast from {src}")


@check("send_recv_pairs", CommOp.SEND)
def _send_recv(comm: DeviceCommunicator, rank: int, world: int) -> None:
    if world < 2:
        return
    peer = rank ^ 1
    if peer >= world:
        return
    for numel in (1, 4097, 1 << 20):
        mine = torch.arange(numel, dtype=torch.float32, device=comm.device) + rank * 1000
        got = torch.zeros(numel, dtype=torch.float32, device=comm.device)
        if rank % 2 == 0:
            comm.send(mine, dst=peer)
            comm.recv(got, src=peer)
        else:
            comm.recv(got, src=peer)
            comm.send(mine, dst=peer)
        expected = torch.arange(numel, dtype=torch.float32, device=comm.device) + peer * 1000
        assert torch.equal(got, expected), f"recv from {peer} x{numel}"


@check("posted_send_recv", CommOp.SEND)
def _posted_send_recv(comm: DeviceCommunicator, rank: int, world: int) -> str | None:
    """A backend offering ``isend`` / ``irecv`` (the weight-transfer push path posts receives
    ahead with them): several in flight per peer land in posting order."""
    isend, irecv = getattr(comm, "isend", None), getattr(comm, "irecv", None)
    if isend is None or irecv is None:
        return "skipped"
    peer = rank ^ 1
    if peer >= world:
        return None
    sizes = (3, 1 << 16, 5, 1 << 20)
    if rank % 2 == 0:
        outs = [
            torch.arange(n, dtype=torch.float32, device=comm.device) + i
            for i, n in enumerate(sizes)
        ]
        handles = [isend(t, peer) for t in outs]
    else:
        outs = [torch.zeros(n, dtype=torch.float32, device=comm.device) for n in sizes]
        handles = [irecv(t, peer) for t in outs]
    for h in handles:
        assert h.wait(60.0) is not False
    if rank % 2:
        for i, (t, n) in enumerate(zip(outs, sizes, strict=True)):
            expected = torch.arange(n, dtype=torch.float32, device=comm.device) + i
            assert torch.equal(t, expected), f"posted recv {i} ({n} elements) from {peer}"
    return None


@check("bad_input_rejected", CommOp.ALL_REDUCE)
def _bad_input(comm: DeviceCommunicator, rank: int, world: int) -> None:
    strided = torch.zeros(8, 8, device=comm.device).t()
    with pytest.raises(ValueError, match="contiguous"):
        comm.all_reduce(tensor_in=strided)
    other = "cpu" if comm.device.type != "cpu" else "meta"
    with pytest.raises(ValueError):
        comm.all_reduce(tensor_in=torch.zeros(4, device=other))
    with pytest.raises(ValueError, match="shape"):
        comm.all_reduce(
            tensor_in=torch.zeros(4, device=comm.device),
            tensor_out=torch.zeros(5, device=comm.device),
        )


@check("cuda_graph_capture", CommOp.CUDA_GRAPH)
def _cuda_graph(comm: DeviceCommunicator, rank: int, world: int) -> None:
    if comm.device.type != "cuda":
        return
    t = _full(comm, (1024,), 1.0, torch.float32)
    stream = torch.cuda.Stream(device=comm.device)
    stream.wait_stream(torch.cuda.current_stream(comm.device))
    with torch.cuda.stream(stream):
        comm.all_reduce(tensor_in=t)  # warm-up outside capture
    torch.cuda.current_stream(comm.device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        comm.all_reduce(tensor_in=t)
    for step in range(3):
        t.fill_(float(step + 1))
        graph.replay()
        torch.cuda.synchronize(comm.device)
        _assert_all(t, (step + 1) * world, f"graph replay {step}")


UNSUPPORTED_PROBES: dict[CommOp, Callable[[DeviceCommunicator, torch.Tensor], Any]] = {
    CommOp.ALL_REDUCE: lambda comm, t: comm.all_reduce(tensor_in=t),
    CommOp.ALL_GATHER: lambda comm, t: comm.all_gather(tensor_in=t),
    CommOp.REDUCE_SCATTER: lambda comm, t: comm.reduce_scatter(tensor_in=t),
    CommOp.BROADCAST: lambda comm, t: comm.broadcast(t, src=0),
}


def _unsupported(comm: DeviceCommunicator, op: CommOp) -> None:
    """An op the backend does not declare must raise, naming the op, before any traffic."""
    t = torch.zeros(4 * 8, device=comm.device)
    with pytest.raises(UnsupportedOperationError, match=op.value):
        UNSUPPORTED_PROBES[op](comm, t)


class ConformanceTask(GlobalCoordinatorDistributedTask):
    def post_init_distributed(self, **_: Any) -> dict[str, str]:
        comm = self.communicator
        rank, world = self.coordinator.get_rank(), self.coordinator.get_world_size()
        report: dict[str, str] = {}
        for name, (op, fn) in CHECKS.items():
            if op not in comm.supported_ops:
                report[name] = "skipped"
                continue
            try:
                report[name] = fn(comm, rank, world) or "ok"  # a check may answer "skipped"
            except BaseException:  # noqa: BLE001 - reported per check
                report[name] = traceback.format_exc()
            self.coordinator.barrier()
        for op in UNSUPPORTED_PROBES:
            if op not in comm.supported_ops:
                try:
                    _unsupported(comm, op)
                    report[f"unsupported_{op.value}"] = "ok"
                except BaseException:  # noqa: BLE001
                    report[f"unsupported_{op.value}"] = traceback.format_exc()
        return report


def nccl_env(ranks: int) -> dict[str, str]:
    """Launcher ``env`` that lets ``ranks`` NCCL ranks share fewer GPUs (each rank names its own
    host, so NCCL takes them for separate machines); empty when each rank has a GPU."""
    from vllm_dist.implementations.communicators.common import shared_gpu_nccl_env

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return {} if ranks <= gpus else shared_gpu_nccl_env("")


@functools.cache
def run_conformance(backend: str, world_size: int, device: str) -> tuple[dict[str, str], ...]:
    """One launch per (backend, world size, device); its per-rank reports, cached."""
    env = nccl_env(world_size) if device == "cuda" else {}
    results = MPLauncher(world_size, timeout=120, env=env).launch(
        task_type=ConformanceTask,
        coordinator_type=CoordinatorType.TORCH_DISTRIBUTED,
        communicator_type=backend,
        device=device,
    )
    return tuple(results)


class CommunicatorConformance:
    """Subclass with ``backend`` and ``device`` set; parametrise ``world_size`` if you like."""

    backend: str = ""
    device: str = "cpu"

    @pytest.fixture(params=[2, 4], ids=lambda n: f"world{n}")
    def world_size(self, request: pytest.FixtureRequest) -> int:
        return int(request.param)

    def _skip_if_unavailable(self) -> None:
        reason = get_communicator_class(self.backend).unavailable_reason(self.device)
        if reason:
            pytest.skip(f"{self.backend} on {self.device}: {reason}")

    @pytest.mark.timeout(240)
    @pytest.mark.parametrize(
        "check_name", [*CHECKS, *(f"unsupported_{op.value}" for op in UNSUPPORTED_PROBES)]
    )
    def test_check(self, check_name: str, world_size: int) -> None:
        self._skip_if_unavailable()
        reports = run_conformance(self.backend, world_size, self.device)
        outcomes = {rank: rep.get(check_name, "skipped") for rank, rep in enumerate(reports)}
        if all(v == "skipped" for v in outcomes.values()):
            pytest.skip(f"{self.backend} does not declare this operation")
        failed = {rank: v for rank, v in outcomes.items() if v not in ("ok", "skipped")}
        assert not failed, "\n".join(f"rank {r}:\n{tb}" for r, tb in failed.items())
