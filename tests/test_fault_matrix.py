"""Fault injection: one rank of a weight-sync fleet killed or hung at one phase, and what follows.

Each case (``tests/fault_cases.py``) launches a producer and a consumer, injects the fault and
checks what a user sees: a ``LaunchError`` that lists the faulted rank first, with what it was
doing when it hung; the consumer's own report of its state (torn, still holding version 1, was
going to 2) where it outlived the fault; and no worker process left afterwards. The cases here
cover every role, phase, fault and transport at least once, and the Ray launcher where its own
code runs (a hung actor read by its node's peeker); ``benchmarks/faults.py`` runs the whole
matrix and prints the table. No timing is asserted.
"""

from __future__ import annotations

import pytest

from tests.fault_cases import Case, Outcome, run_case
from tests.utils import distributed_test

_TORN = "torn=True version=1 target=2"

# Left out, covered elsewhere: a producer killed mid-sync (tests/test_torn.py, both transports)
# and a rank hung before its first collective (tests/test_faults.py, a collective timeout).
CASES = [
    Case("producer", "mid_sync", "hang", "torch_distributed"),
    Case("consumer", "between_syncs", "kill", "torch_distributed"),
    Case("consumer", "mid_sync", "hang", "nixl_rdt"),
    Case("producer", "replayed_sync", "hang", "nixl_rdt"),
    Case("producer", "between_syncs", "kill", "nixl_rdt"),
    Case("consumer", "setup", "kill", "nixl_rdt"),
]


def _check(out: Outcome) -> None:
    case, text = out.case, out.text
    assert out.error == "LaunchError", text
    assert out.first_rank == case.rank, text  # the faulted rank is listed first
    if case.fault == "kill":
        assert out.first_kind in ("signal", "exited"), text
    else:
        assert out.first_kind in ("hung", "raised") and out.first_last_op, text
    if case.role == "producer" and case.fault == "hang" and case.phase == "mid_sync":
        assert out.consumers == {0: _TORN}, text  # the consumer says it is torn, and how
        assert out.first_last_op.startswith("in producer 0: serving group"), text
    elif case.role == "producer" and case.fault == "hang" and case.phase != "setup":
        # a replayed sync 2 may have landed whole before the producer hung: sync 3 is torn
        assert set(out.consumers) == {0} and out.consumers[0].startswith("torn=True"), text
    assert out.leftovers == [], f"worker processes left behind: {out.leftovers}"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@distributed_test(timeout=150)
def test_fault(case: Case) -> None:
    if case.transport == "nixl_rdt":
        pytest.importorskip("nixl", reason="needs the nixl package")
    _check(run_case(case))


@pytest.mark.ray
@distributed_test(timeout=180)
def test_a_hung_ray_actor_is_named_with_its_sync_step(ray_session) -> None:
    _check(run_case(Case("producer", "mid_sync", "hang", "torch_distributed", "ray")))


def test_step_records_sit_beside_the_coordinators_and_name_who_is_waited_on(tmp_path) -> None:
    from vllm_dist.implementations.coordinators.torch_distributed import ProgressLog
    from vllm_dist.implementations.launchers.progress import (
        Progress,
        describe_progress,
        lagging_ranks,
        read_progress,
    )
    from vllm_dist.tasks.step_record import SyncSteps

    path = str(tmp_path / "rank0.progress")
    log = ProgressLog(path)
    with log.op("all_gather_object", [0, 1, 2]):
        pass
    steps = SyncSteps("producer", 0, [1, 2], path=path)
    steps.sync_begins(2, [0, 1])
    steps.serving(2, 12, 1)
    producer = read_progress(path)
    assert producer is not None and producer.coordinator is not None and producer.step
    assert producer.coordinator[:2] == ("after", "all_gather_object")  # not overwritten
    assert producer.step[:3] == ("in", "producer 0: serving group 12 to consumer 1 in sync 2", (2,))
    assert describe_progress(producer).startswith("in producer 0: serving group 12")
    # consumer 1 (rank 2) gave up waiting on the producer (rank 0): rank 0 is named, not rank 1
    waiting = Progress(step=("in", "consumer 1: sync 2, receiving from producer(s) [0]", (0,), 1.0))
    records = {0: producer, 1: None, 2: waiting}
    assert lagging_ranks(records, live=[0, 1], failed=[2]) == [0]
    steps.synced(2)
    assert read_progress(path).waits_on() == ()  # type: ignore[union-attr]
    log.close()


def test_a_dead_rank_comes_before_the_transport_errors_it_caused() -> None:
    from vllm_dist.implementations.launchers.common import mark_causes
    from vllm_dist.interfaces import WorkerFailure

    ucx = "Traceback ...\nNixlTransferError: add_remote_agent: nixlBackendError: UCX endpoint create failed"
    gloo = (
        "Traceback ...\nRuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer"
    )
    for text in (ucx, gloo):
        producer = WorkerFailure(rank=0, reason="raised", traceback=text, kind="raised", at=1.0)
        consumer = WorkerFailure(rank=1, reason="killed by signal SIGKILL", kind="signal", at=2.0)
        marked = mark_causes([producer, consumer])
        assert [f.rank for f in marked if f.cause] == [1], text
    own = WorkerFailure(rank=0, reason="raised", traceback="ValueError: bad", kind="raised", at=1.0)
    died = WorkerFailure(rank=1, reason="killed", kind="signal", at=2.0)
    assert [f.rank for f in mark_causes([own, died]) if f.cause] == [0]  # its own error: first


def test_a_timeout_shows_the_ranks_own_busy_threads() -> None:
    import threading
    import time

    from vllm_dist.implementations.launchers.common import busy_threads

    stop = threading.Event()

    def stuck_in_its_unpack() -> None:
        while not stop.is_set():
            time.sleep(0.01)

    busy = threading.Thread(target=stuck_in_its_unpack, name="wt-recv-p0", daemon=True)
    idle = threading.Thread(target=stop.wait, name="idle-waiter", daemon=True)
    busy.start()
    idle.start()
    try:
        text = busy_threads(TimeoutError("consumer 0 <- producer 0 (chunk 3)"), 1)
        assert "thread wt-recv-p0" in text and "stuck_in_its_unpack" in text, text
        assert "idle-waiter" not in text, text  # waiting, not busy
        assert busy_threads(ValueError("its own error"), 1) == ""  # only after a timeout
    finally:
        stop.set()
