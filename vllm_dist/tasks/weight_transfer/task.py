"""WeightTransferTask: producers and consumers of one fleet as a DistributedTask.

Ranks ``[0, P)`` are producers and ``[P, P + C)`` consumers of one launch. With ``join`` the
fleet spans two launches instead — a trainer launch (``role="producer"``) and an inference
launch (``role="consumer"``) that meet at ``join.host:join.port`` — and each worker takes the
fleet-wide rank ``offset + launch rank``; the engines are the same, since they only see a
coordinator and a communicator over the fleet.

Subclasses say what is transferred: ``make_source`` (a producer's weights), ``make_consumer``
(a consumer's parameters and routes) and the optional per-step hooks. The base composes the
coordinator and communicator through the registry only.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from vllm_dist import registry
from vllm_dist.interfaces import CommOp, WorkerInfo
from vllm_dist.tasks.base import GlobalCoordinatorDistributedTask
from vllm_dist.tasks.weight_transfer.config import Fleet, Route, TransferConfig
from vllm_dist.tasks.weight_transfer.consumer import WeightConsumer
from vllm_dist.tasks.weight_transfer.producer import WeightProducer
from vllm_dist.tasks.weight_transfer.source import WeightSource


@dataclass(frozen=True, kw_only=True, slots=True)
class JoinSpec:
    """Where a launch meets the other half of its fleet.

    Args:
        host: rendezvous address (the producers' launch listens there).
        port: rendezvous port.
        role: ``"producer"`` for the trainer launch, ``"consumer"`` for the inference launch.
        num_producers: producers in the whole fleet.
        num_consumers: consumers in the whole fleet.
    """

    host: str
    port: int
    role: str
    num_producers: int
    num_consumers: int

    def __post_init__(self) -> None:
        if self.role not in ("producer", "consumer"):
            raise ValueError(f"role must be 'producer' or 'consumer', got {self.role!r}")
        if self.num_producers < 1 or self.num_consumers < 1:
            raise ValueError("a fleet needs at least one producer and one consumer")

    def fleet_info(self, launch_info: WorkerInfo) -> WorkerInfo:
        """This worker's place in the fleet that spans both launches."""
        size = self.num_producers if self.role == "producer" else self.num_consumers
        if launch_info.world_size != size:
            raise ValueError(
                f"the {self.role} launch has {launch_info.world_size} workers but the fleet "
                f"expects {size} {self.role}s"
            )
        offset = 0 if self.role == "producer" else self.num_producers
        return WorkerInfo(
            rank=offset + launch_info.rank,
            world_size=self.num_producers + self.num_consumers,
            local_rank=launch_info.local_rank,
            local_world_size=launch_info.local_world_size,
            master_addr=self.host,
            master_port=self.port,
            node_rank=launch_info.node_rank,
        )


@dataclass(kw_only=True)
class ConsumerSpec:
    """A consumer's parameters (written in place) and its routes (see ``WeightConsumer``)."""

    params: Mapping[str, torch.Tensor]
    route: Route


class WeightTransferTask(GlobalCoordinatorDistributedTask):
    """Set up a weight-transfer fleet and run ``syncs`` syncs.

    ``launch(..., num_producers=P, num_consumers=C, syncs=1, config=TransferConfig(...),
    join=None, **task_kwargs)``; ``task_kwargs`` reach the hooks. Returns, per rank, a dict with
    the role, index, set-up seconds, per-sync stats and whatever the step hooks returned; a
    consumer's also has its ``version`` and ``torn`` (see ``WeightConsumer``).
    """

    required_ops: ClassVar[frozenset[CommOp]] = frozenset()
    producer_class: ClassVar[type[WeightProducer]] = WeightProducer
    consumer_class: ClassVar[type[WeightConsumer]] = WeightConsumer

    @classmethod
    def check_launch_kwargs(cls, world_size: int, **kwargs: Any) -> None:
        """Also refuse fleet sizes that are not positive ints, in the parent (a ``join`` spec
        brings its own sizes)."""
        super().check_launch_kwargs(world_size, **kwargs)
        if kwargs.get("join") is not None:
            return
        for name in ("num_producers", "num_consumers"):
            value = kwargs.get(name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"{name} must be an int >= 1 (ranks of that role), got {value!r}")

    def run(self, *, join: JoinSpec | None = None, **kwargs: Any) -> Any:  # type: ignore[override]
        if join is not None:
            self.worker_info = join.fleet_info(self.worker_info)
            kwargs.update(num_producers=join.num_producers, num_consumers=join.num_consumers)
        return super().run(**kwargs)

    def post_init_distributed(  # type: ignore[override]
        self,
        *,
        num_producers: int,
        num_consumers: int,
        syncs: int = 1,
        config: TransferConfig | None = None,
        **task_kwargs: Any,
    ) -> dict[str, Any]:
        fleet = Fleet.split(num_producers, num_consumers)
        config = config or TransferConfig()
        self._check_ops()
        rank = self.coordinator.get_rank()
        if rank in fleet.producer_ranks:
            return self._run_producer(fleet, config, syncs, task_kwargs)
        return self._run_consumer(fleet, config, syncs, task_kwargs)

    def _check_ops(self) -> None:
        ops = self.communicator.supported_ops
        if CommOp.READ not in ops and not {CommOp.SEND, CommOp.RECV} <= ops:
            raise registry.unsupported_operation(type(self.communicator), CommOp.SEND)

    def _run_producer(
        self, fleet: Fleet, config: TransferConfig, syncs: int, kw: dict[str, Any]
    ) -> dict[str, Any]:
        pid = fleet.producer_ranks.index(self.coordinator.get_rank())
        source = self.make_source(pid, len(fleet.producer_ranks), **kw)
        engine = self.producer_class(
            self.coordinator, self.communicator, fleet=fleet, source=source, config=config
        )
        try:
            engine.setup()
            stats, outputs = [], []
            for step in range(syncs):
                self.before_producer_sync(step, source, **kw)
                stats.append(engine.sync().as_dict())
                outputs.append(self.after_producer_sync(step, source, **kw))
        finally:
            engine.close()
        result = self._result("producer", pid, engine.setup_seconds, stats, outputs)
        result["setup_phases"] = engine.setup_phases
        result["shared_bytes"] = engine.shared_bytes
        if engine.trace is not None:
            result["trace"] = engine.trace
        return result

    def _run_consumer(
        self, fleet: Fleet, config: TransferConfig, syncs: int, kw: dict[str, Any]
    ) -> dict[str, Any]:
        cid = fleet.consumer_ranks.index(self.coordinator.get_rank())
        spec = self.make_consumer(cid, len(fleet.consumer_ranks), **kw)
        engine = self.consumer_class(
            self.coordinator,
            self.communicator,
            fleet=fleet,
            params=spec.params,
            route=spec.route,
            config=config,
        )
        try:
            engine.setup()
            stats, outputs = [], []
            for step in range(syncs):
                self.before_consumer_sync(step, spec, **kw)
                stats.append(engine.sync().as_dict())
                outputs.append(self.after_consumer_sync(step, spec, **kw))
        finally:
            engine.close()
        result = self._result("consumer", cid, engine.setup_seconds, stats, outputs)
        result["version"] = engine.version
        result["torn"] = engine.torn
        result["bake_seconds"] = engine.bake_seconds
        result["gathered_bytes"] = engine.gathered_bytes
        result["setup_phases"] = engine.setup_phases
        if engine.trace is not None:
            result["trace"] = engine.trace
        return result

    @staticmethod
    def _result(
        role: str, idx: int, setup_s: float, stats: list[dict[str, Any]], outputs: list[Any]
    ) -> dict[str, Any]:
        return {
            "role": role,
            "index": idx,
            "setup_seconds": setup_s,
            "syncs": stats,
            "outputs": outputs,
        }

    # -- hooks ---------------------------------------------------------------------------------
    @abstractmethod
    def make_source(self, producer_idx: int, num_producers: int, **kwargs: Any) -> WeightSource:
        """The weights producer ``producer_idx`` serves."""

    @abstractmethod
    def make_consumer(self, consumer_idx: int, num_consumers: int, **kwargs: Any) -> ConsumerSpec:
        """Consumer ``consumer_idx``'s parameters and routes."""

    def before_producer_sync(self, step: int, source: WeightSource, **kwargs: Any) -> None:  # noqa: B027
        """Called on producers before sync ``step`` (e.g. a training step changes the weights)."""

    def after_producer_sync(self, step: int, source: WeightSource, **kwargs: Any) -> Any:
        """Called on producers after sync ``step``; its value lands in the result."""
        return None

    def before_consumer_sync(self, step: int, spec: ConsumerSpec, **kwargs: Any) -> None:  # noqa: B027
        """Called on consumers before sync ``step``."""

    def after_consumer_sync(self, step: int, spec: ConsumerSpec, **kwargs: Any) -> Any:
        """Called on consumers after sync ``step`` (e.g. verify); its value lands in the result."""
        return None
