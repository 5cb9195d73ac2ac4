"""An elastic fleet over torch_distributed on one GPU: a NCCL communicator per (producer,
consumer) pair (``PairNcclCommunicator``), built when a consumer is admitted, aborted when it
leaves or dies.

Every launch is a real ``MPLauncher`` launch whose ranks NCCL takes for hosts of their own
(``shared_gpu_nccl_env``: two ranks on one GPU are refused otherwise), so the pairs move their
bytes through NCCL's socket transport on loopback. Consumers raise on any byte that differs
(``strict``). Nothing asserts a duration.
"""

from __future__ import annotations

import time
from pathlib import Path
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
from vllm_dist.examples.elastic_demo import FleetDriver
from vllm_dist.examples.llama_tp import tiny_llama_shapes
from vllm_dist.implementations.communicators.common import shared_gpu_nccl_env
from vllm_dist.implementations.coordinators.membership import MembershipConfig
from vllm_dist.tasks.weight_transfer import TransferConfig

MEMBERSHIP = MembershipConfig(heartbeat_interval_s=0.25, lease_s=2.0, timeout_s=90.0)
STALL_S = 60.0  # far above the lease: a dead peer is found by its lease, never by a stall


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


@pytest.mark.gpu
@pytest.mark.skipif(cuda_device_count() < 1, reason="needs 1 CUDA device")
@distributed_test(gpus=1, timeout=400)
def test_nccl_pairs_survive_a_consumer_killed_mid_sync_and_a_producer_restart(
    tmp_path: Path,
) -> None:
    """Consumer b is killed (kill -9) while the producers have its sends queued on their
    streams ahead of consumer a's: the producers abort b's pairs once its lease runs out, a's
    transfers behind them go on, and the producers stay the same members. A new launch takes
    b's slot over new pairs. Then the producer launch is killed and started again: both
    consumers' syncs fail naming the dead producers (torn), they join the new producers over
    new pairs and sync on byte-exact."""
    driver = FleetDriver(
        num_producers=2,
        capacity=2,
        membership=MEMBERSHIP,
        communicator_type=CommunicatorType.TORCH_DISTRIBUTED,
        communicator_options={"timeout": STALL_S},
        device="cuda",
        config=TransferConfig(workers_per_replica=1, stall_timeout=STALL_S),
        shapes=tiny_llama_shapes(),
        tp_size=1,
        strict=True,
        pace_s=0.05,
    )
    hold, arm = tmp_path / "held", tmp_path / "arm"
    gate, gate2 = tmp_path / "gate", tmp_path / "gate2"
    try:
        driver.start("producers", "producer", 0, 2, env=shared_gpu_nccl_env("p1"))
        driver.start("a", "consumer", 0, 1, env=shared_gpu_nccl_env("a"))
        driver.start(
            "b",
            "consumer",
            1,
            1,
            env=shared_gpu_nccl_env("b"),
            hold_at=3,
            hold_file=str(hold),
            arm_file=str(arm),
        )
        driver.start("c", "consumer", 1, 1, env=shared_gpu_nccl_env("c"), gate_file=str(gate))
        driver.start(
            "producers2", "producer", 0, 2, env=shared_gpu_nccl_env("p2"), gate_file=str(gate2)
        )
        view = driver.wait_ready([0, 1])
        producers = {m.id for m in view.role("producer")}
        arm.touch()
        driver.fleet.wait_for(lambda v: hold.exists(), 120.0)  # b sits out a served sync
        driver.kill([1])
        driver.wait_gone([1])
        gate.touch()
        view = driver.wait_ready([1])  # c, in b's slot
        assert {m.id for m in view.role("producer")} == producers  # they lived through it
        driver.kill([0, 1], role="producer")
        driver.wait_gone([0, 1], role="producer")
        gate2.touch()
        driver.wait_joins([0, 1], joins=2)
        results = driver.stop()
    finally:
        for g in (gate, gate2, arm):
            g.touch()
        driver.close()
    assert isinstance(results["b"], Exception) and isinstance(results["producers"], Exception)
    final = len(results["producers2"][0]["syncs"])
    for name in "ac":
        (r,) = results[name]
        assert r["version"] == final and r["joins"] == 2
        assert all(o["verified"] for o in r["outputs"]), r["outputs"]
        assert any("producer" in e and "torn" in e for e in r["errors"]), r["errors"]
        assert all(s["path"] == "send_recv" for s in r["syncs"])
    (a,) = results["a"]
    assert len(a["syncs"]) >= 6  # served before, during and after b's death, then again
