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

import os
import secrets
import time
from abc import abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from vllm_dist import registry
from vllm_dist.interfaces import CommOp, WorkerInfo
from vllm_dist.tasks.base import GlobalCoordinatorDistributedTask
from vllm_dist.tasks.weight_transfer.config import Fleet, Route, TransferConfig
from vllm_dist.tasks.weight_transfer.consumer import WeightConsumer
from vllm_dist.tasks.weight_transfer.producer import WeightProducer
from vllm_dist.tasks.weight_transfer.source import WeightSource

FLEET_TOKEN_ENV = "VLLM_DIST_FLEET_TOKEN"
TOKEN_FILE_WAIT_S = 120.0  # how long a consumer waits for the producer side to write token_file


@dataclass(frozen=True, kw_only=True, slots=True)
class JoinSpec:
    """Where a launch meets the other half of its fleet, and the secret both halves hold.

    Args:
        host: rendezvous address (the producers' launch listens there, on that address only).
        port: rendezvous port.
        role: ``"producer"`` for the trainer launch, ``"consumer"`` for the inference launch.
        num_producers: producers in the whole fleet.
        num_consumers: consumers in the whole fleet.
        token: the fleet's secret (``JoinSpec.new_token()``: at least 32 hex digits, or 16
            bytes); never printed.
        token_file: where the secret is kept when neither ``token`` nor ``VLLM_DIST_FLEET_TOKEN``
            gives it: the producer side creates it (mode 0600) with a fresh token unless it
            exists, the consumer side waits for it and reads it.

    The secret comes from ``token``, else ``VLLM_DIST_FLEET_TOKEN`` (hex, read where the spec is
    made), else ``token_file``. A peer that does not hold it takes no place in the fleet.
    """

    host: str
    port: int
    role: str
    num_producers: int
    num_consumers: int
    token: str | bytes | None = field(default=None, repr=False, compare=False)
    token_file: str | None = None
    _env_token: bytes = field(default=b"", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.role not in ("producer", "consumer"):
            raise ValueError(f"role must be 'producer' or 'consumer', got {self.role!r}")
        if self.num_producers < 1 or self.num_consumers < 1:
            raise ValueError("a fleet needs at least one producer and one consumer")
        if self.token is not None:
            _token_bytes(self.token, "JoinSpec(token=...)")
        elif os.environ.get(FLEET_TOKEN_ENV):
            env = _token_bytes(os.environ[FLEET_TOKEN_ENV], FLEET_TOKEN_ENV)
            object.__setattr__(self, "_env_token", env)

    @staticmethod
    def new_token() -> str:
        """A fresh fleet token (64 hex digits) for ``JoinSpec(token=...)``."""
        return secrets.token_hex(32)

    def check_secret_source(self) -> None:
        """Refuse, before any worker starts, a spec that names no way to its secret."""
        if self.token is None and not self._env_token and not self.token_file:
            raise ValueError(
                "a JoinSpec fleet needs a shared secret: pass JoinSpec(token=JoinSpec.new_token())"
                f" to both launches, or set {FLEET_TOKEN_ENV} (hex) for both, or name a "
                "JoinSpec(token_file=...) that the producer side creates and the consumer side "
                "reads"
            )

    def secret(self) -> bytes:
        """The fleet's secret, from ``token``, ``VLLM_DIST_FLEET_TOKEN`` or ``token_file``."""
        if self.token is not None:
            return _token_bytes(self.token, "JoinSpec(token=...)")
        if self._env_token:
            return self._env_token
        self.check_secret_source()
        assert self.token_file is not None
        if self.role == "producer":
            return _create_or_read_token_file(self.token_file)
        return _wait_for_token_file(self.token_file, TOKEN_FILE_WAIT_S)

    def fleet_info(self, launch_info: WorkerInfo) -> WorkerInfo:
        """This worker's place in the fleet that spans both launches (with the fleet's secret)."""
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
            secret=self.secret(),
        )


def _token_bytes(token: str | bytes, where: str) -> bytes:
    """A token as bytes: hex text of at least 32 digits, or at least 16 raw bytes. Errors
    describe its length only, never its value."""
    if isinstance(token, bytes | bytearray):
        if len(token) < 16:
            raise ValueError(f"{where} holds {len(token)} bytes; give at least 16")
        return bytes(token)
    text = token.strip()
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raw = b""
    if len(raw) < 16:
        raise ValueError(
            f"{where} must be at least 32 hex digits (JoinSpec.new_token() makes one); got "
            f"{len(text)} characters that are not"
        )
    return raw


def _create_or_read_token_file(path: str) -> bytes:
    """The producer side: write a fresh token to ``path`` (mode 0600) unless it exists. The
    file appears whole (linked into place), so a reader never sees half a token."""
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, (JoinSpec.new_token() + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # fails when another producer rank (or launch) made it first
        except FileExistsError:
            pass
        finally:
            os.unlink(tmp)
    return _read_token_file(path)


def _wait_for_token_file(path: str, timeout_s: float) -> bytes:
    """The consumer side: wait up to ``timeout_s`` for the producer side's token file."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"JoinSpec(token_file={path!r}) did not appear within {timeout_s} s: start the "
                "producer launch (it creates the file), or give both launches the same "
                "JoinSpec(token=...)"
            )
        time.sleep(0.05)
    return _read_token_file(path)


def _read_token_file(path: str) -> bytes:
    with open(path) as f:
        return _token_bytes(f.read(), f"JoinSpec(token_file={path!r})")


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
        """Also refuse fleet sizes that are not positive ints, and a ``join`` spec without a way
        to its secret, in the parent (a ``join`` spec brings its own sizes)."""
        super().check_launch_kwargs(world_size, **kwargs)
        join = kwargs.get("join")
        if join is not None:
            if not isinstance(join, JoinSpec):
                raise TypeError(f"join must be a JoinSpec, got {type(join).__name__}")
            join.check_secret_source()
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
