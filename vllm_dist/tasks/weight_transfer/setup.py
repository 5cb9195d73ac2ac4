"""Set-up pieces shared by both engines: the fleet, the index and the timers (``EngineBase``),
the checks a producer makes of a consumer's plan (``PlanCheck``), and the tables set-up builds.

Every check runs at set-up, so a fleet of non-identical deployments fails there, on every rank
(``gather_verdicts``), rather than mid-sync.
"""

from __future__ import annotations

import functools
import gc
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np
import torch

from vllm_dist.interfaces import CommOp, DeviceCommunicator, WorkerCoordinator
from vllm_dist.interfaces.dataplane import OneSidedCommunicator
from vllm_dist.tasks.weight_transfer import progress
from vllm_dist.tasks.weight_transfer._memory import ArenaMap, StreamPool
from vllm_dist.tasks.weight_transfer.config import (
    STRIDED_DIRECT_BYTES,
    Fleet,
    TransferConfig,
    UnservedNameError,
    WeightTransferSetupError,
)
from vllm_dist.tasks.weight_transfer.index import ModelIndex, ProducerFacts, build_index
from vllm_dist.tasks.weight_transfer.messages import ReserveMessage
from vllm_dist.tasks.weight_transfer.ops import (
    OpChain,
    UnsafeOpError,
    chain_dtype,
    check_chain,
    replay,
    split_for_wire,
)
from vllm_dist.tasks.weight_transfer.plan import (
    Chunk,
    LayoutConfig,
    PlanMismatchError,
    Request,
    slot_bytes,
)
from vllm_dist.tasks.weight_transfer.router import ENGINE_BALANCE
from vllm_dist.tasks.weight_transfer.source import dtype_from_str

_T = TypeVar("_T")


def gc_paused(method: Callable[..., _T]) -> Callable[..., _T]:
    """Run ``method`` with Python's cyclic garbage collector paused (as it was, after).

    Set-up and a sync that is not replayed make hundreds of thousands of short-lived objects
    beside the engine's long-lived ones, and every collection they trigger walks all of them.
    Reference counting still frees what they drop; cycles wait for the next collection."""

    @functools.wraps(method)
    def paused(*args: Any, **kwargs: Any) -> _T:
        if not gc.isenabled():
            return method(*args, **kwargs)
        gc.disable()
        try:
            return method(*args, **kwargs)
        finally:
            gc.enable()

    return paused


def gather_verdicts(coordinator: WorkerCoordinator, error: BaseException | None) -> None:
    """All-gather every rank's set-up error; raise this rank's own, else the first other one."""
    verdicts = coordinator.all_gather_object(
        None if error is None else f"{type(error).__name__}: {error}"
    )
    if error is not None:
        raise error
    failed = [(r, v) for r, v in enumerate(verdicts) if v is not None]
    if failed:
        lines = "; ".join(f"rank {r}: {v}" for r, v in failed)
        raise WeightTransferSetupError(f"weight-transfer set-up failed on other ranks: {lines}")


def pair_layout(layout: LayoutConfig, strided: bool) -> LayoutConfig:
    """The layout of a pair: with strided reads every item of at least 8 KiB (a norm of a
    hidden-4096 model) is a chunk of its own, read in place, so producers pack and
    synchronize their device for nothing but tiny items (below that, per-chunk bookkeeping
    costs more than packing)."""
    if not strided or layout.direct_bytes <= STRIDED_DIRECT_BYTES:
        return layout
    return replace(layout, direct_bytes=STRIDED_DIRECT_BYTES)


def wire_shape(req: Request) -> tuple[int, ...]:
    return req.shape if req.wire_shape is None else req.wire_shape


def item_table(requests: list[Request]) -> list[tuple[torch.dtype, tuple[int, ...], int]]:
    """(wire dtype, wire shape, bytes) per request, computed once per distinct kind."""
    memo: dict[tuple[tuple[int, ...], str, tuple[int, ...] | None], Any] = {}
    out = []
    for r in requests:
        key = (r.shape, r.dtype, r.wire_shape)
        item = memo.get(key)
        if item is None:
            item = memo[key] = (dtype_from_str(r.dtype), wire_shape(r), r.nbytes)
        out.append(item)
    return out


def shared_splits(requests: list[Request], part: int) -> list[OpChain]:
    """``split_for_wire(r.chain)[part]`` per request; one object per distinct chain object, so
    ``ViewCache`` (keyed on chain identity) sees a handful of chains, not one per name."""
    memo: dict[int, tuple[OpChain, OpChain]] = {}
    out = []
    for r in requests:
        hit = memo.get(id(r.chain))
        if hit is None:
            hit = memo[id(r.chain)] = (r.chain, split_for_wire(r.chain)[part])
        out.append(hit[1])
    return out


class ShapeCache:
    """(final shape, wire shape) of a weight through a chain, from meta tensors, memoised.

    100,000 expert weights share a handful of (shape, dtype, chain) triples, so set-up replays
    each triple once. One per engine: no module-level state.
    """

    def __init__(self) -> None:
        self._memo: dict[tuple[int, tuple[int, ...], torch.dtype], Any] = {}

    def __call__(
        self, shape: tuple[int, ...], dtype: torch.dtype, chain: OpChain
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        key = (id(chain), tuple(shape), dtype)  # the memo keeps ``chain`` alive: ids stay unique
        hit = self._memo.get(key)
        if hit is None or hit[0] is not chain:
            probe = torch.empty(shape, dtype=dtype, device="meta")
            prefix, suffix = split_for_wire(chain)
            wire = replay(probe, prefix) if prefix else probe
            out = replay(wire, suffix) if suffix else wire
            hit = self._memo[key] = (chain, tuple(out.shape), tuple(wire.shape))
        return hit[1], hit[2]


def one_sided(communicator: DeviceCommunicator, transport: str) -> OneSidedCommunicator | None:
    """The communicator as the one-sided READ path uses it under ``transport``, or None when
    it gets the send/recv path."""
    has_read = CommOp.READ in communicator.supported_ops and isinstance(
        communicator, OneSidedCommunicator
    )
    if transport == "read" and not has_read:
        raise ValueError(
            f"TransferConfig(transport='read') needs a communicator with one-sided READ "
            f"(CommOp.READ and the OneSidedCommunicator API); {type(communicator).__name__} has "
            "none: use transport='auto' or a communicator such as NIXL_RDT"
        )
    if not has_read or transport == "send_recv":
        return None
    assert isinstance(communicator, OneSidedCommunicator)
    return communicator


class EngineBase:
    """What producers and consumers share: the fleet, the index, the timers."""

    def __init__(
        self,
        coordinator: WorkerCoordinator,
        communicator: DeviceCommunicator,
        fleet: Fleet,
        config: TransferConfig,
    ) -> None:
        if coordinator.get_world_size() != len(fleet.producer_ranks) + len(fleet.consumer_ranks):
            raise ValueError(
                f"the coordinator has {coordinator.get_world_size()} members but the fleet names "
                f"{len(fleet.producer_ranks)} producers and {len(fleet.consumer_ranks)} consumers"
            )
        self.coordinator = coordinator
        self.communicator = communicator
        self.fleet = fleet
        self.config = config
        self.layout = config.layout()
        self.index: ModelIndex | None = None
        self.producer_facts: list[ProducerFacts] = []
        self.setup_seconds = 0.0
        self._shapes = ShapeCache()
        self._one_sided = one_sided(communicator, config.transport)
        threads = config.push_threads
        if threads is None:
            threads = communicator.device.type != "cuda"
        self._threads = self._one_sided is None and threads  # push path: a thread per pair
        self._syncs = 0
        self.setup_phases: dict[str, float] = {}  # seconds per set-up step, for benchmarks
        # VLLM_DIST_WT_TRACE=1: (monotonic time, event) of the last sync, for benchmarks
        self.trace: list[tuple[float, str]] | None = (
            [] if os.environ.get("VLLM_DIST_WT_TRACE") == "1" else None
        )
        self._phase_start = time.perf_counter()
        self._packed = 0  # this sync's pack (producer) or unpack (consumer) copies, in chunks
        self.arenas = ArenaMap()  # the arenas this engine moved storages into, for lookups
        self.streams = StreamPool()  # where its replayed copy programs record CUDA graphs

    @property
    def path(self) -> str:
        """``"read"`` (one-sided) or ``"send_recv"``: the data path this engine uses."""
        return "send_recv" if self._one_sided is None else "read"

    def _mark(self, event: str) -> None:
        if self.trace is not None:
            self.trace.append((time.perf_counter(), event))

    def _phase(self, name: str) -> float:
        """Record the seconds since the previous phase ended under ``name``; returns them."""
        now = time.perf_counter()
        spent = now - self._phase_start
        self.setup_phases[name] = self.setup_phases.get(name, 0.0) + spent
        self._phase_start = now
        progress.phase_done(self, name, spent)
        return spent

    def _index(self, facts: ProducerFacts | None) -> ModelIndex:
        gathered = self.coordinator.all_gather_object(facts)
        return self._build_index([gathered[r] for r in self.fleet.producer_ranks])

    def _build_index(self, producer_facts: list[ProducerFacts]) -> ModelIndex:
        self.producer_facts = producer_facts
        self.index = build_index(
            producer_facts,
            len(self.fleet.consumer_ranks),
            self.config.workers_per_replica,
            balance=ENGINE_BALANCE,
        )
        return self.index


class PlanCheck:
    """A producer's checks of one consumer's plan: names it serves, safe chains, shapes that
    follow from the metadata, the same digest and ring size as the consumer derived."""

    def __init__(self, producer_id: int, layout: LayoutConfig, shapes: ShapeCache) -> None:
        self.producer_id = producer_id
        self.layout = layout
        self._shapes = shapes

    def compare(self, cid: int, chunks: list[Chunk], digest: str, reserve_msg: Any) -> None:
        if not isinstance(reserve_msg, ReserveMessage) or reserve_msg.consumer_id != cid:
            raise RuntimeError(
                f"expected a reservation from consumer {cid}, got {reserve_msg!r:.80}"
            )
        nbytes, their_digest = reserve_msg.nbytes, reserve_msg.digest
        if their_digest != digest:
            raise PlanMismatchError(
                f"producer {self.producer_id} and consumer {cid} derived different plans "
                f"(digest {digest[:12]} vs {str(their_digest)[:12]}): their deployments differ "
                "(model, TransferConfig, workers_per_replica, or held names); deploy both sides "
                "from the same configuration"
            )
        ring_bytes = (
            slot_bytes(chunks, self.producer_id, self.layout.align) * self.layout.ring_slots
        )
        if nbytes != ring_bytes:
            raise PlanMismatchError(
                f"consumer {cid} reserved {nbytes} B of serve ring but the plan needs {ring_bytes}"
            )

    def check_names(self, cid: int, index: ModelIndex, names: list[str]) -> np.ndarray:
        """Positions of ``names`` in the index; refuses names this producer does not serve."""
        pos = np.fromiter((index.position.get(n, -1) for n in names), np.int64, len(names))
        known = pos >= 0
        held = np.zeros(len(pos), dtype=bool)
        held[known] = index.held_by(self.producer_id)[pos[known]]
        if not held.all():
            name = names[int(np.argmin(held))]
            raise UnservedNameError(
                f"consumer {cid} asked producer {self.producer_id} for {name!r}, which it "
                "does not hold; refusing to serve it"
            )
        routed = index.routes(cid, pos)
        if (routed != self.producer_id).any():
            i = int(np.argmax(routed != self.producer_id))
            raise UnservedNameError(
                f"consumer {cid} asked producer {self.producer_id} for {names[i]!r}, which this "
                f"deployment routes to producer {int(routed[i])}; refusing to serve it"
            )
        return pos

    def check_kinds(
        self,
        cid: int,
        index: ModelIndex,
        kinds: list[Any],
        names: list[str],
        ids: np.ndarray,
        pos: np.ndarray,
    ) -> np.ndarray:
        """Check each distinct (chain, source shape) once; returns the bytes of each kind."""
        pairs, first = np.unique(
            np.stack([ids.astype(np.int64), index.shape_ids[pos]]), axis=1, return_index=True
        )
        for (k, _sid), i in zip(pairs.T.tolist(), first.tolist(), strict=True):
            self.check_request(cid, index, Request(names[i], *kinds[k]))
        return np.asarray([Request("", *k).nbytes for k in kinds] or [0], dtype=np.int64)

    def check_request(self, cid: int, index: ModelIndex, req: Request) -> None:
        """Refuse an unsafe chain or a shape that does not follow from the weight's metadata."""
        meta = index.meta[req.name]
        check_chain(req.chain)
        try:
            shape, wire = self._shapes(meta.shape, meta.torch_dtype, req.chain)
        except UnsafeOpError:
            raise
        except Exception as exc:
            raise UnsafeOpError(
                f"consumer {cid}: op chain {req.chain!r} does not apply to {req.name!r} "
                f"of shape {meta.shape}: {exc}"
            ) from exc
        dtype = str(chain_dtype(meta.torch_dtype, req.chain))
        if shape != tuple(req.shape) or req.dtype != dtype or req.wire_shape != wire:
            raise UnsafeOpError(
                f"consumer {cid}: {req.name!r} through {req.chain!r} is {shape} {dtype}, "
                f"(wire shape {wire}), but the request claims {req.shape} {req.dtype} "
                f"(wire shape {req.wire_shape})"
            )
