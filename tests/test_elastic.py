"""Elastic weight-transfer fleets: consumer launches that join, die (kill -9) and come back.

Every launch is a real ``MPLauncher`` launch; the store is served by this process; a consumer
launch is killed through the pids the roster records for its slots. Consumers raise on any
byte that differs (``strict``), so a member that turned ready had a byte-exact sync. Nothing
asserts a duration: every wait is bounded and only states are checked.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.utils import cuda_device_count, distributed_test
from vllm_dist import CommunicatorType
from vllm_dist.examples.elastic_demo import FleetDriver
from vllm_dist.examples.llama_tp import tiny_llama_shapes
from vllm_dist.implementations.coordinators.membership import MembershipConfig
from vllm_dist.tasks.weight_transfer import TransferConfig

pytest.importorskip("nixl", reason="needs the nixl package (pip install 'vllm_dist[nixl]')")

MEMBERSHIP = MembershipConfig(heartbeat_interval_s=0.25, lease_s=2.0, timeout_s=60.0)
STALL_S = 30.0  # far above the lease: a dead consumer is found by its lease, not a stall


def _driver(
    capacity: int,
    device: str = "cpu",
    comm: CommunicatorType = CommunicatorType.NIXL_RDT,
    stall: float = STALL_S,
) -> FleetDriver:
    return FleetDriver(
        num_producers=2,
        capacity=capacity,
        membership=MEMBERSHIP,
        communicator_type=comm,
        communicator_options={"timeout": stall},
        device=device,
        config=TransferConfig(workers_per_replica=2, stall_timeout=stall),
        shapes=tiny_llama_shapes(),
        tp_size=2,
        strict=True,
        pace_s=0.05,
    )


def _consumers(result: Any) -> list[dict[str, Any]]:
    assert isinstance(result, list), result
    return [r for r in result if r["role"] == "consumer"]


def _check_served_throughout(result: Any, final: int) -> None:
    """A consumer launch that lived to the end got every sync, each byte-exact, up to the last."""
    for r in _consumers(result):
        assert r["version"] == final, r["version"]
        assert all(o["verified"] for o in r["outputs"]), r["outputs"]
        assert r["ready"] is not None


def _events(producers: Any) -> list[dict[str, Any]]:
    assert isinstance(producers, list), producers
    return [e for r in producers for e in r["events"]]


def _wait_for(path: Path, driver: FleetDriver, seconds: float = 120.0) -> None:
    driver.fleet.wait_for(lambda v: path.exists(), seconds)


def _run_elastic_drill(tmp_path: Path, device: str) -> None:
    """Two TP-2 replicas; one is killed (kill -9 of the launch) while the producers serve it; a
    new launch takes its slots and two more join (four replicas); then one leaves cleanly and
    two are killed between syncs (one replica)."""
    driver = _driver(capacity=8, device=device)
    hold = tmp_path / "held"
    try:
        driver.start("producers", "producer", 0, 2)
        driver.start("a", "consumer", 0, 2)
        driver.start("b", "consumer", 2, 2, hold_at=3, hold_file=str(hold))
        driver.wait_ready([0, 1, 2, 3])
        _wait_for(hold, driver)  # b sits out sync 4, which the producers are serving
        old = set(driver.kill([2, 3]))  # kill -9 mid-sync
        driver.wait_gone([2, 3])
        driver.start("c", "consumer", 2, 2)  # a new launch in the same slots
        driver.start("d", "consumer", 4, 2)
        driver.start("e", "consumer", 6, 2)
        view = driver.wait_ready(list(range(8)))
        assert len(view.role("consumer")) == 8  # four replicas
        assert not old & {m.pid for m in view.role("consumer")}  # new processes
        driver.leave([2, 3])
        driver.kill([4, 5, 6, 7])  # kill -9 between syncs
        view = driver.wait_gone([2, 3, 4, 5, 6, 7])
        assert {m.slot for m in view.role("consumer")} == {0, 1}  # one replica
        results = driver.stop()
    finally:
        driver.close()
    for name in "bde":
        assert isinstance(results[name], Exception), results[name]
    producers = results["producers"]
    final = len(producers[0]["syncs"])
    _check_served_throughout(results["a"], final)  # never stalled: every sync arrived
    for r in _consumers(results["c"]):  # joined, then left cleanly between syncs
        assert r["outputs"] and all(o["verified"] for o in r["outputs"])
    lost = {m for e in _events(producers) for m in e["lost"]}
    gone = lost | {m for e in _events(producers) for m in e["left"]}
    assert {"consumer/2#1", "consumer/3#1"} <= lost  # b: given up on mid-sync
    assert {"consumer/2#2", "consumer/3#2"} | {f"consumer/{s}#1" for s in range(4, 8)} <= gone


@distributed_test(timeout=300)
def test_consumer_launches_join_die_and_scale_between_syncs(tmp_path: Path) -> None:
    """kill -9 of whole consumer launches mid-sync and between syncs, a new launch in a dead
    one's slots, growth from two replicas to four and shrinkage to one: the replica that
    stays gets every sync byte-exact, each new launch turns ready after a byte-exact first
    sync, and the producers record who was lost mid-sync and who left."""
    _run_elastic_drill(tmp_path, "cpu")


@distributed_test(timeout=300)
def test_torch_distributed_fleet_and_a_restarted_producer_launch() -> None:
    """torch_distributed in an elastic fleet (a gloo group per producer/consumer pair, built
    over the fleet store at admission): a consumer launch killed between syncs takes only its
    pairs down and a new launch in its slots gets new ones. Then the producer launch is
    killed and started again (same weights, as from a checkpoint): every consumer joins the
    new producers, its plan checked again, and syncs on byte-exact."""
    driver = _driver(capacity=4, comm=CommunicatorType.TORCH_DISTRIBUTED, stall=8.0)
    try:
        driver.start("producers", "producer", 0, 2)
        driver.start("a", "consumer", 0, 2)
        driver.start("b", "consumer", 2, 2)
        driver.wait_ready([0, 1, 2, 3])
        driver.kill([2, 3])
        driver.wait_gone([2, 3])
        driver.start("c", "consumer", 2, 2)
        driver.wait_ready([2, 3])
        driver.kill([0, 1], role="producer")
        driver.wait_gone([0, 1], role="producer")
        driver.start("producers2", "producer", 0, 2)
        driver.wait_joins([0, 1, 2, 3], joins=2)
        results = driver.stop()
    finally:
        driver.close()
    assert isinstance(results["b"], Exception) and isinstance(results["producers"], Exception)
    final = len(results["producers2"][0]["syncs"])
    for name in "ac":
        _check_served_throughout(results[name], final)
        assert all(r["joins"] == 2 for r in _consumers(results[name]))
    assert all(r["syncs"][0]["path"] == "send_recv" for r in _consumers(results["a"]))


@pytest.mark.gpu
@pytest.mark.skipif(cuda_device_count() < 1, reason="needs 1 CUDA device")
@distributed_test(gpus=1, timeout=300)
def test_consumer_launch_killed_and_replaced_on_the_gpu(tmp_path: Path) -> None:
    """The same drill with every worker's tensors in VRAM of one GPU."""
    _run_elastic_drill(tmp_path, "cuda")
