"""``PairNcclCommunicator``: a NCCL communicator per peer, built and aborted at run time (the
elastic fleet's torch_distributed on CUDA; its fleet drill is in test_elastic.py).

The launch's ranks pass for hosts of their own to NCCL (``shared_gpu_nccl_env``: two ranks on
one GPU are refused otherwise), so a pair moves its bytes through NCCL's socket transport.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from tests.utils import cuda_device_count, distributed_test
from vllm_dist import (
    CommunicatorType,
    CoordinatorType,
    GlobalCoordinatorDistributedTask,
    MPLauncher,
)
from vllm_dist.implementations.communicators.common import shared_gpu_nccl_env


class _Pairs(GlobalCoordinatorDistributedTask):
    """Two ranks build a NCCL pair over the launch's coordinator, move bytes both ways, and
    rank 1 aborts the pair while a receive that rank 0 never matches holds its stream."""

    def post_init_distributed(self, **_: Any) -> dict[str, Any]:
        from vllm_dist.implementations.communicators.pynccl.pair import PairNcclCommunicator

        rank, out = self.coordinator.get_rank(), {}
        comm = PairNcclCommunicator(self.coordinator, device="cuda", timeout=60.0)
        peer = 1 - rank
        comm.add_peer(peer)
        data = torch.arange(4099, device=comm.device).to(torch.bfloat16)
        got = torch.zeros_like(data)
        if rank == 0:
            comm.send(data, 1)
            comm.recv(got, 1)
        else:
            comm.recv(got, 0)
            comm.send(got, 0)
        torch.cuda.synchronize()
        out["equal"] = bool(torch.equal(got, data))
        if rank == 1:
            comm.recv(torch.zeros(16, device=comm.device), 0)  # never matched
            held = torch.cuda.Event()
            held.record()
            time.sleep(1.0)
            out["held"] = not held.query()
            comm.remove_peer(0)
            deadline = time.monotonic() + 60.0
            while not held.query() and time.monotonic() < deadline:
                time.sleep(0.01)
            out["freed"] = held.query()
            try:
                comm.send(data, 0)
                out["refused"] = ""
            except ValueError as exc:
                out["refused"] = str(exc)
        self.coordinator.barrier()
        comm.close()
        return out


@pytest.mark.gpu
@pytest.mark.skipif(cuda_device_count() < 1, reason="needs 1 CUDA device")
@distributed_test(gpus=1, timeout=180)
def test_a_nccl_pair_moves_bytes_and_its_abort_frees_a_held_stream() -> None:
    """Bytes move both ways over a pair; ``remove_peer`` ends a receive its peer never
    matched (the stream it held goes on) and later sends to that rank are refused."""
    results = MPLauncher(2, timeout=150, env=shared_gpu_nccl_env("pair")).launch(
        task_type=_Pairs,
        coordinator_type=CoordinatorType.TORCH_DISTRIBUTED,
        communicator_type=CommunicatorType.TORCH_DISTRIBUTED,
        device="cpu",
    )
    assert results[0]["equal"] and results[1]["equal"]
    assert results[1]["held"] and results[1]["freed"], results[1]
    assert "not a peer" in results[1]["refused"]
