"""Torn models: a sync that fails part-way marks its consumers torn, and says so.

Real CPU fleets (two launches that meet at a loopback port, so that the consumers outlive a
producer that dies): a producer killed in the middle of a sync leaves every consumer torn,
still holding the version of the last whole sync, with a ``TornModelError`` that names both.
The consumers report their state in the error they raise (the launch cannot return results
after a producer death).
"""

from __future__ import annotations

import os
import re
from typing import Any

import pytest
import torch

from tests.test_weight_transfer import _assert_verified, _free_port, _launch, _launch_halves
from tests.utils import distributed_test
from vllm_dist import CommunicatorType, LaunchError
from vllm_dist.examples.llama_tp import llama_shapes, tensor_digest, tiny_llama_config
from vllm_dist.examples.weight_sync_demo import LlamaTransferTask
from vllm_dist.tasks.weight_transfer import (
    ConsumerSpec,
    StateDictSource,
    SyncStats,
    TornModelError,
    TransferConfig,
    WeightConsumer,
    WeightProducer,
)


@pytest.fixture(scope="module")
def shapes() -> dict[str, Any]:
    return llama_shapes(tiny_llama_config())


class MidSyncDyingProducer(WeightProducer):
    """Serves its first chunk of sync 2, then dies (SIGKILL-like: no clean-up at all)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        serve = self._path.serve
        served = [0]

        def dying(*a: Any, **kw: Any) -> None:
            if self._syncs == 2:
                served[0] += 1
                if served[0] > 1:
                    os._exit(9)
            serve(*a, **kw)

        self._path.serve = dying  # type: ignore[method-assign]


class MidSyncDyingTask(LlamaTransferTask):
    producer_class = MidSyncDyingProducer


class ReportingConsumer(WeightConsumer):
    """On a failed sync, raises a line with its own state beside the ``TornModelError``."""

    def sync(self) -> Any:
        assert not self.torn and (self.version is None) == (self._syncs == 0)
        try:
            stats = super().sync()
        except TornModelError as exc:
            intact = self._digests == self._snapshot()
            raise RuntimeError(
                f"STATE torn={self.torn} ready={self.ready} version={self.version} "
                f"held={exc.held} target={exc.target} intact={intact} "
                f"cause={type(exc.__cause__).__name__} | {exc}"
            ) from exc
        self._digests = self._snapshot()
        return stats

    def _snapshot(self) -> dict[str, str]:
        return {n: tensor_digest(p) for n, p in self.params.items()}


class ReportingTask(LlamaTransferTask):
    consumer_class = ReportingConsumer


_TRANSPORTS = {
    "pair_threads": {"config": TransferConfig(stall_timeout=5.0, push_threads=True)},
    "fleet_order": {"config": TransferConfig(stall_timeout=5.0, push_threads=False)},
    # chunk by chunk: a replayed sync serves no chunk one by one
    "read": {
        "config": TransferConfig(stall_timeout=5.0, replay=False),
        "comm": CommunicatorType.NIXL_RDT,
    },
}


@pytest.mark.parametrize("transport", list(_TRANSPORTS))
@distributed_test(timeout=120)
def test_producer_death_mid_sync_leaves_consumers_torn(
    shapes: dict[str, Any], transport: str
) -> None:
    if transport == "read":
        pytest.importorskip("nixl", reason="needs the nixl package")
    producers, consumers = _launch_halves(
        _free_port(),
        MidSyncDyingTask,
        ReportingTask,
        90,
        syncs=3,
        shapes=shapes,
        coordinator_options={"timeout": 20.0},
        **_TRANSPORTS[transport],
    )
    assert isinstance(producers, LaunchError) and "exited with code 9" in str(producers)
    assert isinstance(consumers, LaunchError), consumers
    text = str(consumers)
    states = re.findall(
        r"STATE torn=(\w+) ready=(\w+) version=(\w+) held=(\w+) target=(\w+) ", text
    )
    assert states, text
    # every consumer that reported: torn, still holding sync 1, was going to sync 2
    assert set(states) == {("True", "False", "1", "1", "2")}, text
    assert "the model is torn" in text and "held version 1, going to 2" in text, text


@distributed_test(timeout=120)
def test_failed_atomic_sync_keeps_the_previous_version(shapes: dict[str, Any]) -> None:
    producers, consumers = _launch_halves(
        _free_port(),
        MidSyncDyingTask,
        ReportingTask,
        90,
        syncs=3,
        shapes=shapes,
        config=TransferConfig(stall_timeout=5.0, atomic=True),
        coordinator_options={"timeout": 20.0},
    )
    assert isinstance(producers, LaunchError) and "exited with code 9" in str(producers)
    assert isinstance(consumers, LaunchError), consumers
    text = str(consumers)
    states = re.findall(
        r"STATE torn=(\w+) ready=(\w+) version=(\w+) held=(\w+) target=(\w+) intact=(\w+)", text
    )
    assert states, text
    # not torn: still serving sync 1, its bytes untouched
    assert set(states) == {("False", "True", "1", "1", "2", "True")}, text
    assert "kept version 1 intact" in text, text


class SetupOnlyConsumer(WeightConsumer):
    """Checks the state of a consumer that has not synced yet."""

    def sync(self) -> Any:
        if self._syncs == 0:
            assert self.version is None and not self.torn and not self.ready
        stats = super().sync()
        assert self.version == self._syncs and self.ready and not self.torn
        return stats


class SetupOnlyTask(LlamaTransferTask):
    consumer_class = SetupOnlyConsumer


@distributed_test(timeout=120)
def test_version_counts_whole_syncs(shapes: dict[str, Any]) -> None:
    producers, consumers = _launch_halves(
        _free_port(), LlamaTransferTask, SetupOnlyTask, 90, syncs=2, shapes=shapes
    )
    assert isinstance(producers, list) and isinstance(consumers, list), (producers, consumers)
    for r in consumers:
        assert all(o["verified"] for o in r["outputs"]), r["outputs"]
        assert r["version"] == 2 and r["torn"] is False


def test_torn_model_error_is_a_runtime_error() -> None:
    err = TornModelError("torn", held=1, target=2)
    assert isinstance(err, RuntimeError) and (err.held, err.target) == (1, 2)


# -- set-up refuses weights that would never arrive ----------------------------------------------
class ExtraParamTask(LlamaTransferTask):
    """Consumers hold a parameter that no route fills; verified without it."""

    def make_consumer(self, consumer_idx: int, num_consumers: int, **kw: Any) -> ConsumerSpec:
        spec = super().make_consumer(consumer_idx, num_consumers, **kw)
        self._extra = torch.ones(4)
        return ConsumerSpec(params={**spec.params, "extra.weight": self._extra}, route=spec.route)

    def after_consumer_sync(self, step: int, spec: ConsumerSpec, **kw: Any) -> Any:
        routed = {n: t for n, t in spec.params.items() if n != "extra.weight"}
        out = super().after_consumer_sync(step, ConsumerSpec(params=routed, route=spec.route), **kw)
        out["extra_untouched"] = bool((self._extra == 1).all())
        return out


@distributed_test(timeout=120)
def test_setup_refuses_parameters_no_route_fills(shapes: dict[str, Any]) -> None:
    with pytest.raises(LaunchError, match=r"no route fills parameter\(s\) \['extra.weight'\]"):
        _launch(3, task=ExtraParamTask, num_producers=1, num_consumers=2, shapes=shapes)
    results = _launch(
        3,
        task=ExtraParamTask,
        num_producers=1,
        num_consumers=2,
        shapes=shapes,
        syncs=2,
        config=TransferConfig(allow_unfilled_params=True),
    )
    _assert_verified(results, 2)
    assert all(
        o["extra_untouched"] for r in results if r["role"] == "consumer" for o in r["outputs"]
    )


class UnheldWeightTask(LlamaTransferTask):
    """The producer describes the whole model but holds all of it but the final norm."""

    def make_source(self, producer_idx: int, num_producers: int, **kw: Any) -> Any:
        super().make_source(producer_idx, num_producers, **kw)  # sets self._state
        held = [n for n in self._state if n != "model.norm.weight"]
        return StateDictSource(self._state, held=held)


@distributed_test(timeout=120)
def test_setup_refuses_weights_no_producer_holds(shapes: dict[str, Any]) -> None:
    with pytest.raises(
        LaunchError, match=r"weight\(s\) \['model.norm.weight'\].*no producer holds"
    ):
        _launch(3, task=UnheldWeightTask, num_producers=1, num_consumers=2, shapes=shapes)


@distributed_test(timeout=120)
def test_zero_size_weights_sync(shapes: dict[str, Any]) -> None:
    dtype = shapes["model.norm.weight"][1]
    with_empty = {
        **shapes,
        "model.layers.0.extra.weight": ((0,), dtype),
        "model.layers.1.extra.weight": ((0, 8), dtype),
        # sliced by tensor-parallel loaders: 0-size strided views on both sides
        "model.layers.0.extra.o_proj.weight": ((8, 0), dtype),
        "model.layers.1.extra.down_proj.weight": ((8, 0), dtype),
        "model.layers.1.extra.embed_tokens.weight": ((0, 8), dtype),
    }
    results = _launch(3, num_producers=1, num_consumers=2, shapes=with_empty, syncs=2)
    _assert_verified(results, 2)


# -- a torn consumer is repaired by the next sync ------------------------------------------------
class FailingOnceConsumer(WeightConsumer):
    """Sync 2 lands in full, then raises: the consumer is torn (it cannot know better) and
    the fleet goes on; the failed sync's stats carry the state it reported."""

    def _make_rings(self) -> Any:
        path = super()._make_rings()
        receive = path.receive

        def failing() -> bool:
            replayed = receive()
            if self._syncs == 2:
                raise RuntimeError("INJECTED after sync 2 landed")
            return replayed

        path.receive = failing  # type: ignore[method-assign]
        return path

    def sync(self) -> Any:
        try:
            return super().sync()
        except TornModelError as exc:
            state = f"torn={self.torn} version={self.version} target={exc.target}"
            return SyncStats(seconds=0.0, bytes=0, chunks=0, path=state)


class FailingOnceTask(LlamaTransferTask):
    consumer_class = FailingOnceConsumer


@pytest.mark.parametrize("transport", ["send_recv", "read"])
@distributed_test(timeout=150)
def test_the_sync_after_a_torn_one_repairs_it(shapes: dict[str, Any], transport: str) -> None:
    kw: dict[str, Any] = {}
    if transport == "read":
        pytest.importorskip("nixl", reason="needs the nixl package")
        kw["comm"] = CommunicatorType.NIXL_RDT
    results = _launch(
        3, task=FailingOnceTask, num_producers=1, num_consumers=2, shapes=shapes, syncs=4, **kw
    )
    _assert_verified(results, 4)
    for r in results:
        if r["role"] != "consumer":
            continue
        assert r["syncs"][1]["path"] == "torn=True version=1 target=2", r["syncs"]
        # the sync after the torn one reads every chunk (no replay of a record it dropped)
        assert r["syncs"][2]["replayed"] is False
        assert r["version"] == 4 and r["torn"] is False
    if transport == "read":
        consumers = [r for r in results if r["role"] == "consumer"]
        assert all(r["syncs"][3]["replayed"] for r in consumers), [r["syncs"] for r in consumers]
