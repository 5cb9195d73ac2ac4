"""Weight-transfer set-up reports its phases at INFO, from one reporter per role only."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from vllm_dist.tasks.weight_transfer import progress


def _engine(**ids: int) -> SimpleNamespace:
    fleet = SimpleNamespace(producer_ranks=[0, 1], consumer_ranks=[2, 3, 4, 5])
    index = SimpleNamespace(names=[f"w{i}" for i in range(1200)])
    return SimpleNamespace(
        fleet=fleet,
        index=index,
        setup_phases={"index": 0.5, "expose": 0.25},
        setup_seconds=0.75,
        **ids,
    )


def test_producer_0_reports_each_phase_and_the_total(caplog: pytest.LogCaptureFixture) -> None:
    engine = _engine(producer_id=0)
    with caplog.at_level(logging.INFO, logger="vllm_dist"):
        progress.phase_done(engine, "index", 0.5)
        progress.phase_done(engine, "check plans", 0.1)  # per consumer: summed, not logged
        progress.phase_done(engine, "expose", 0.25)
        progress.setup_done(engine)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "weight-transfer set-up, producer 0: index built (1,200 weights, 2 producers, "
        "4 consumers) (0.50 s)",
        "weight-transfer set-up, producer 0: exposures registered (0.25 s)",
        "weight-transfer set-up, producer 0: ready in 0.75 s (index 0.50 s; expose 0.25 s)",
    ]


def test_other_ranks_and_warning_level_stay_quiet(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="vllm_dist"):
        for engine in (_engine(producer_id=1), _engine(consumer_id=3)):
            progress.phase_done(engine, "index", 0.1)
            progress.setup_done(engine)
    with caplog.at_level(logging.WARNING, logger="vllm_dist"):
        progress.setup_done(_engine(consumer_id=0))
    assert caplog.records == []


def test_an_engine_without_the_expected_fields_still_logs(caplog: pytest.LogCaptureFixture) -> None:
    engine = SimpleNamespace(consumer_id=0, fleet=None)  # progress must never fail a set-up
    with caplog.at_level(logging.INFO, logger="vllm_dist"):
        progress.phase_done(engine, "plan", 0.0)
        progress.setup_done(engine)
    assert [r.getMessage() for r in caplog.records][0].endswith("consumer 0: plan (0.00 s)")


def test_a_consumers_last_phase_reports_it_ready(caplog: pytest.LogCaptureFixture) -> None:
    engine = _engine(consumer_id=0)
    engine.setup_phases = {"index": 0.25, "rings": 0.5}
    with caplog.at_level(logging.INFO, logger="vllm_dist"):
        progress.phase_done(engine, "rings", 0.5)
    assert [r.getMessage() for r in caplog.records] == [
        "weight-transfer set-up, consumer 0: serve rings ready (0.50 s)",
        "weight-transfer set-up, consumer 0: ready in 0.75 s (index 0.25 s; rings 0.50 s)",
    ]
