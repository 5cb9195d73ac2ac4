"""Elastic weight-transfer fleets: consumer launches that join, die (kill -9) and come back.

Every launch is a real ``MPLauncher`` launch; the store is served by this process; a consumer
launch is killed through the pids the roster records for its slots. Consumers raise on any
byte that differs (``strict``), so a member that turned ready had a byte-exact sync. One drill
(``_run_elastic_drill``) runs the same events over each CPU transport and, with ``nixl_rdt``,
on a GPU. Nothing asserts a duration: every wait is bounded and only states are checked.
"""

from __future__ import annotations

import importlib.util
import re
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

HAS_NIXL = importlib.util.find_spec("nixl") is not None
NEEDS_NIXL = pytest.mark.skipif(
    not HAS_NIXL, reason="needs the nixl package (pip install 'vllm_dist[nixl]')"
)
TRANSPORTS = [
    pytest.param(CommunicatorType.NIXL_RDT, id="nixl_rdt", marks=NEEDS_NIXL),
    pytest.param(CommunicatorType.TORCH_DISTRIBUTED, id="torch_distributed"),
]

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
        share_gpu_nccl=device == "cuda" and comm == CommunicatorType.TORCH_DISTRIBUTED,
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


def _store_keys(driver: FleetDriver) -> list[str]:
    """The store's keys at the quietest of a few looks (fewest keys), less the producers'
    collective keys (one in flight at any time, deleted by its last reader) and each slot's
    incarnation counter and heartbeat (one per slot ever taken, bounded by the capacity)."""
    looks = []
    for _ in range(10):
        keys = driver.fleet.store.list_keys()
        looks.append(sorted(k for k in keys if not re.search(r"/coll/|/inc/|/hb/", k)))
        time.sleep(0.1)
    return min(looks, key=len)


def _wait_released(driver: FleetDriver, departed: set[str], timeout: float = 60.0) -> None:
    """Wait until no store key names a member of ``departed`` (its messages, pair rendezvous
    keys): what departed members held is released, not only their roster entries."""
    pattern = re.compile("|".join(rf"{re.escape(m)}(?!\d)" for m in departed))
    deadline = time.monotonic() + timeout
    while stale := [k for k in driver.fleet.store.list_keys() if pattern.search(k)]:
        assert time.monotonic() < deadline, stale
        time.sleep(0.2)


def _run_elastic_drill(
    tmp_path: Path, device: str, comm: CommunicatorType = CommunicatorType.NIXL_RDT
) -> None:
    """The fleet's events in turn, each launch started ahead and let in at its gate:

    two replicas (a, b); the producer launch killed (a and b fail naming it, torn and not
    ready) and a new one started, which both join again; j killed (kill -9 of its launch) in its join, while the
    producers admit it; b killed mid-sync; c takes b's slot (the store holds no more keys than
    before); d takes j's slot and e a fourth (four replicas); c leaves cleanly and d, e are
    killed between syncs (one replica); nothing left in the store names a departed member."""
    driver = _driver(capacity=4, device=device, comm=comm)
    f = {n: tmp_path / n for n in ("held_j", "held_b", "arm_b", "p2", "j", "c", "de")}
    try:
        driver.start("producers", "producer", 0, 2)
        driver.start("a", "consumer", 0, 1)
        driver.start(
            "b", "consumer", 1, 1, hold_at=3, hold_file=str(f["held_b"]), arm_file=str(f["arm_b"])
        )
        driver.start("producers2", "producer", 0, 2, gate_file=str(f["p2"]))
        driver.start(
            "j", "consumer", 2, 1, hold_at="join", hold_file=str(f["held_j"]), gate_file=str(f["j"])
        )
        driver.start("c", "consumer", 1, 1, gate_file=str(f["c"]))
        for name, slot in (("d", 2), ("e", 3)):
            driver.start(name, "consumer", slot, 1, gate_file=str(f["de"]))
        driver.wait_ready([0, 1])
        driver.kill([0, 1], role="producer")
        driver.wait_gone([0, 1], role="producer")
        # torn: no consumer is ready until a whole version from new producers
        driver.fleet.wait_for(lambda v: not any(m.ready for m in v.role("consumer")), 30.0)
        f["p2"].touch()  # the producer launch again, from the same weights (its checkpoint)
        driver.wait_joins([0, 1], joins=2)
        before = _store_keys(driver)
        f["j"].touch()  # j joins the roster, introduces itself, then holds at its plan
        _wait_for(f["held_j"], driver)
        assert [m.ready for m in driver.view().role("consumer") if m.slot == 2] == [False]
        driver.kill([2])  # kill -9 in its join
        driver.wait_gone([2])
        f["arm_b"].touch()  # b sits out a sync the producers are serving
        _wait_for(f["held_b"], driver)
        old = set(driver.kill([1]))  # kill -9 mid-sync
        driver.wait_gone([1])
        f["c"].touch()  # a new launch in b's slot
        view = driver.wait_ready([0, 1])
        assert not old & {m.pid for m in view.role("consumer")}  # a new process
        after = _store_keys(driver)
        assert len(after) <= len(before), sorted(set(after) ^ set(before))
        f["de"].touch()  # a new launch in j's slot, and a fourth replica
        view = driver.wait_ready([0, 1, 2, 3])
        assert len(view.role("consumer")) == 4  # four replicas
        driver.leave([1])
        driver.kill([2, 3])  # kill -9 between syncs
        view = driver.wait_gone([1, 2, 3])
        assert {m.slot for m in view.role("consumer")} == {0}  # one replica
        departed = {"consumer/1#1", "consumer/2#1", "consumer/1#2", "consumer/2#2", "consumer/3#1"}
        _wait_released(driver, departed | {"producer/0#1", "producer/1#1"})
        results = driver.stop()
    finally:
        for gate in ("p2", "j", "c", "de"):  # a launch still at its gate ends on the closed store
            f[gate].touch()
        driver.close()
    for name in ("producers", "b", "j", "d", "e"):
        assert isinstance(results[name], Exception), (name, results[name])
    final = len(results["producers2"][0]["syncs"])
    _check_served_throughout(results["a"], final)  # never stalled: every sync arrived
    for r in _consumers(results["a"]):
        assert r["joins"] == 2  # once more, to the restarted producers
        # the dead producers are named (from the roster) and the model is marked torn
        assert any("producer/" in e and "torn" in e for e in r["errors"]), r["errors"]
        if comm == CommunicatorType.TORCH_DISTRIBUTED:
            assert r["syncs"][0]["path"] == "send_recv"
    for r in _consumers(results["c"]):  # joined, then left cleanly between syncs
        assert r["outputs"] and all(o["verified"] for o in r["outputs"])
    for r in _consumers(results["a"]) + _consumers(results["c"]):
        assert r["ready"] >= r["syncs"][0]["at"]  # ready only after its first complete sync
    events = _events(results["producers2"])
    lost = {m for e in events for m in e["lost"]}
    assert "consumer/2#1" in {m for e in events for m in e["refused"]}  # j: dropped in its join
    assert "consumer/1#1" in lost  # b: given up on mid-sync
    gone = lost | {m for e in events for m in e["left"]}
    assert {"consumer/1#2", "consumer/2#2", "consumer/3#1"} <= gone


@pytest.mark.parametrize("comm", TRANSPORTS)
@distributed_test(timeout=300)
def test_consumer_launches_killed_at_each_phase_and_the_producers_restarted(
    tmp_path: Path, comm: CommunicatorType
) -> None:
    """kill -9 of consumer launches in their join, mid-sync and between syncs, new launches in
    their slots, growth from two replicas to four and shrinkage to one, and the producer launch
    killed and started again, over each CPU transport (``torch_distributed`` is a gloo group per
    producer/consumer pair): the replica that stays gets every sync byte-exact, each new launch
    turns ready after a byte-exact first sync, the producers record who was refused, lost and
    left, and the store keeps nothing of the departed."""
    _run_elastic_drill(tmp_path, "cpu", comm)


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
@pytest.mark.parametrize("comm", TRANSPORTS)
@pytest.mark.skipif(cuda_device_count() < 1, reason="needs 1 CUDA device")
@distributed_test(gpus=1, timeout=300)
def test_consumer_launch_killed_and_replaced_on_the_gpu(
    tmp_path: Path, comm: CommunicatorType
) -> None:
    """The same drill with every worker's tensors in VRAM of one GPU; ``torch_distributed`` is
    a NCCL communicator per pair there (the ranks pass for hosts of their own to NCCL)."""
    _run_elastic_drill(tmp_path, "cuda", comm)
