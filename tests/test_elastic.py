"""Elastic weight-transfer fleets: consumer launches that join, die (kill -9) and come back.

Every launch is a real ``MPLauncher`` launch; the store is served by this process; a consumer
launch is killed through the pids the roster records for its slots. Consumers raise on any
byte that differs (``strict``), so a member that turned ready had a byte-exact sync. Nothing
asserts a duration: every wait is bounded and only states are checked.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.utils import cuda_device_count, distributed_test
from vllm_dist import CommunicatorType
from vllm_dist.examples.elastic_demo import FleetDriver
from vllm_dist.examples.llama_tp import tiny_llama_shapes
from vllm_dist.implementations.coordinators.membership import MembershipConfig
from vllm_dist.tasks.weight_transfer import TransferConfig
from vllm_dist.tasks.weight_transfer.elastic import ProducerGoneError, watch_producers

pytest.importorskip("nixl", reason="needs the nixl package (pip install 'vllm_dist[nixl]')")

MEMBERSHIP = MembershipConfig(heartbeat_interval_s=0.25, lease_s=2.0, timeout_s=60.0)
STALL_S = 30.0  # far above the lease: a dead consumer is found by its lease, not a stall


def _driver(
    capacity: int,
    device: str = "cpu",
    comm: CommunicatorType = CommunicatorType.NIXL_RDT,
    stall: float = STALL_S,
) -> FleetDriver:
    """Two producers and replicas of one worker each (a launch per replica: fewer processes
    to start than TP-2 replicas, the same membership changes)."""
    return FleetDriver(
        num_producers=2,
        capacity=capacity,
        membership=MEMBERSHIP,
        communicator_type=comm,
        communicator_options={"timeout": stall},
        device=device,
        config=TransferConfig(workers_per_replica=1, stall_timeout=stall),
        shapes=tiny_llama_shapes(),
        tp_size=1,
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
    """Two replicas; one is killed (kill -9 of the launch) while the producers serve it; a new
    launch takes its slot and two more join (four replicas); then one leaves cleanly and two
    are killed between syncs (one replica)."""
    driver = _driver(capacity=4, device=device)
    hold, arm, gate = tmp_path / "held", tmp_path / "arm", tmp_path / "gate"
    try:
        driver.start("producers", "producer", 0, 2)
        driver.start("a", "consumer", 0, 1)
        driver.start("b", "consumer", 1, 1, hold_at=3, hold_file=str(hold), arm_file=str(arm))
        for name, slot in (("c", 1), ("d", 2), ("e", 3)):  # started now, joining at the gate
            driver.start(name, "consumer", slot, 1, gate_file=str(gate))
        driver.wait_ready([0, 1])
        assert len(driver.view().role("consumer")) == 2  # two replicas
        arm.touch()  # both ready: b may hold now (not before a's launch came up)
        _wait_for(hold, driver)  # b sits out a sync the producers are serving
        old = set(driver.kill([1]))  # kill -9 mid-sync
        driver.wait_gone([1])
        gate.touch()  # c: a new launch in b's slot; d and e: two more replicas
        view = driver.wait_ready([0, 1, 2, 3])
        assert len(view.role("consumer")) == 4  # four replicas
        assert not old & {m.pid for m in view.role("consumer")}  # new processes
        driver.leave([1])
        driver.kill([2, 3])  # kill -9 between syncs
        view = driver.wait_gone([1, 2, 3])
        assert {m.slot for m in view.role("consumer")} == {0}  # one replica
        results = driver.stop()
    finally:
        gate.touch()  # a launch still at its gate goes on, and ends on the closed store
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
    assert "consumer/1#1" in lost  # b: given up on mid-sync
    assert {"consumer/1#2", "consumer/2#1", "consumer/3#1"} <= gone


@distributed_test(timeout=300)
def test_consumer_launches_join_die_and_scale_between_syncs(tmp_path: Path) -> None:
    """kill -9 of consumer launches mid-sync and between syncs, a new launch in a dead one's
    slot, growth from two replicas to four and shrinkage to one: the replica that stays gets
    every sync byte-exact, each new launch turns ready after a byte-exact first sync, and the
    producers record who was lost mid-sync and who left."""
    _run_elastic_drill(tmp_path, "cpu")


def _store_keys(driver: FleetDriver) -> list[str]:
    """The store's keys at the quietest of a few looks (fewest keys), less the producers'
    collective keys (one in flight at any time, deleted by its last reader)."""
    looks = []
    for _ in range(10):
        looks.append(sorted(k for k in driver.fleet.store.list_keys() if "/coll/" not in k))
        time.sleep(0.1)
    return min(looks, key=len)


@distributed_test(timeout=300)
def test_torch_distributed_fleet_and_a_restarted_producer_launch(tmp_path: Path) -> None:
    """torch_distributed in an elastic fleet (a gloo group per producer/consumer pair, built
    over the fleet store at admission): a consumer launch killed between syncs takes only its
    pairs down, a new launch in its slot gets new ones, and the store holds no more keys than
    before (pair rendezvous keys and the dead one's messages are deleted). Then the producer
    launch is killed: every consumer's sync fails naming a dead producer, its model torn;
    started again (same weights, as from a checkpoint), every consumer joins the new producers,
    its plan checked again, and syncs on byte-exact."""
    driver = _driver(capacity=2, comm=CommunicatorType.TORCH_DISTRIBUTED, stall=8.0)
    gate, gate2 = tmp_path / "gate", tmp_path / "gate2"
    try:
        driver.start("producers", "producer", 0, 2)
        driver.start("a", "consumer", 0, 1)
        driver.start("b", "consumer", 1, 1)
        driver.start("c", "consumer", 1, 1, gate_file=str(gate))  # joins at the gate
        driver.start("producers2", "producer", 0, 2, gate_file=str(gate2))
        driver.wait_ready([0, 1])
        before = _store_keys(driver)
        driver.kill([1])
        driver.wait_gone([1])
        gate.touch()
        driver.wait_ready([1])
        after = _store_keys(driver)
        assert len(after) <= len(before), sorted(set(after) ^ set(before))
        driver.kill([0, 1], role="producer")
        driver.wait_gone([0, 1], role="producer")
        gate2.touch()
        driver.wait_joins([0, 1], joins=2)
        results = driver.stop()
    finally:
        gate.touch()  # a launch still at its gate goes on, and ends on the closed store
        gate2.touch()
        driver.close()
    assert isinstance(results["b"], Exception) and isinstance(results["producers"], Exception)
    final = len(results["producers2"][0]["syncs"])
    for name in "ac":
        _check_served_throughout(results[name], final)
        for r in _consumers(results[name]):
            assert r["joins"] == 2
            # the dead producers are named (from the roster) and the model is marked torn
            assert any("producer/" in e and "torn" in e for e in r["errors"]), r["errors"]
    assert all(r["syncs"][0]["path"] == "send_recv" for r in _consumers(results["a"]))


class _Waits:
    """A communicator's notification wait that never gets a message."""

    def wait_notification(self, peer: int, timeout: float | None = None) -> bytes:
        time.sleep(timeout or 0.0)
        raise TimeoutError(f"nothing from {peer}")


class _Roster:
    """The roster side of a ``SlotCoordinator``: ``producer/0#1`` dies after ``dies_s``."""

    num_producers = 2

    def __init__(self, dies_s: float) -> None:
        self.dies = time.monotonic() + dies_s

    def gone(self, rank: int) -> bool:
        return rank == 0 and time.monotonic() > self.dies

    def bound(self, rank: int) -> str:
        return f"producer/{rank}#1"


def test_a_consumer_wait_on_a_dead_producer_fails_through_the_roster() -> None:
    """A consumer waiting on a producer's notification fails with ``ProducerGoneError`` naming
    it once the roster shows it gone, long before the wait's own timeout; waits on a live
    producer still time out as before."""
    comm = watch_producers(_Waits, _Roster(dies_s=0.5))()  # type: ignore[arg-type]
    with pytest.raises(ProducerGoneError, match=r"producer 0 \(producer/0#1\)"):
        comm.wait_notification(0, 600.0)
    with pytest.raises(TimeoutError):
        comm.wait_notification(1, 0.5)


@pytest.mark.gpu
@pytest.mark.skipif(cuda_device_count() < 1, reason="needs 1 CUDA device")
@distributed_test(gpus=1, timeout=300)
def test_consumer_launch_killed_and_replaced_on_the_gpu(tmp_path: Path) -> None:
    """The same drill with every worker's tensors in VRAM of one GPU."""
    _run_elastic_drill(tmp_path, "cuda")
