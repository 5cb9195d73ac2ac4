"""The dry run: the engine's own set-up for every (producer, consumer) pair of a fleet, in one
process, on the meta device — no byte moves, no process per rank.

Every rank's work is the engine's code: ``build_index`` (each rank's shared index), a real
``WeightConsumer`` (on a stand-in coordinator and a meta-device communicator) runs its
``_prepare`` (bake on fake tensors, destination views, ``cut_chunks``) and derives each pair's
``plan_digest`` as ``_send_plans`` does; each producer checks every plan routed to it with
``PlanCheck`` and re-cuts it as ``WeightProducer._accept`` does, and the two digests must
agree. Only the messages are skipped. Rejected: a launch of stub processes per rank, which
costs a process and a gloo rendezvous per simulated rank and measures the launcher.

Replicas: the router resolves routes from ``consumer_id % workers_per_replica``, so the workers
of one replica plan exactly what every replica plans (only the digest's consumer id differs).
``sample=None`` simulates every consumer; an int simulates that many workers of replica 0 and
scales producer loads by the replica count, exact by that property (the tests check it).
"""

from __future__ import annotations

import pickle
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import numpy as np
import torch

from vllm_dist.interfaces import DeviceCommunicator, WorkerCoordinator
from vllm_dist.tasks.weight_transfer.config import Fleet, TransferConfig
from vllm_dist.tasks.weight_transfer.consumer import WeightConsumer
from vllm_dist.tasks.weight_transfer.index import ModelIndex, ProducerFacts, build_index
from vllm_dist.tasks.weight_transfer.plan import (
    Chunk,
    cut_chunks,
    encode_requests,
    item_sizes,
    plan_digest,
)
from vllm_dist.tasks.weight_transfer.router import ENGINE_BALANCE
from vllm_dist.tasks.weight_transfer.setup import PlanCheck, ShapeCache, pair_layout
from vllm_dist.tasks.weight_transfer.source import WeightMeta


class _SoloCoordinator:
    """Answers the two questions an engine's constructor asks; anything else is a bug here."""

    def __init__(self, rank: int, world: int) -> None:
        self._rank, self._world = rank, world

    def get_rank(self) -> int:
        return self._rank

    def get_world_size(self) -> int:
        return self._world


class _MetaCommunicator:
    """A communicator with no operations on the meta device: the engine picks its push path
    (no one-sided READ) and allocates nothing at ``_prepare``."""

    supported_ops: frozenset[Any] = frozenset()
    device = torch.device("meta")


@dataclass(frozen=True, slots=True)
class PairPlan:
    """What one producer serves one consumer per sync."""

    producer: int
    consumer: int
    nbytes: int  # on the wire: chunk sizes, alignment padding included
    payload: int  # the bytes the consumer's requests need
    chunks: int
    items: int
    packed_bytes: int  # bytes in chunks of several items (the producer packs them)
    max_chunk: int
    first_group: int
    last_group: int


@dataclass
class RankCost:
    """Set-up seconds and peak traced bytes of one simulated rank (peak: where measured)."""

    seconds: float = 0.0
    peak_bytes: int | None = None
    pairs: int = 0


@dataclass
class DryRun:
    """The result of ``dry_run``: the index, the pairs, and each simulated rank's cost."""

    num_producers: int
    num_consumers: int
    workers_per_replica: int
    simulated: list[int]
    index_seconds: float
    index_peak_bytes: int | None
    names: int
    gather_seconds: float = 0.0  # unpickling every producer's facts, as each rank does
    gather_bytes: int | None = None  # every producer's unpickled facts (traced)
    pairs: list[PairPlan] = field(default_factory=list)
    consumers: dict[int, RankCost] = field(default_factory=dict)
    producers: dict[int, RankCost] = field(default_factory=dict)
    chunks: dict[int, list[Chunk]] = field(default_factory=dict)  # by simulated consumer

    @property
    def replicas(self) -> int:
        return self.num_consumers // self.workers_per_replica

    def scale(self) -> int:
        """How many consumers each simulated one stands for (1 when all are simulated)."""
        return 1 if len(self.simulated) == self.num_consumers else self.replicas

    def producer_load(self) -> np.ndarray:
        """Bytes each producer serves per sync (over every replica)."""
        load = np.zeros(self.num_producers, dtype=np.int64)
        for p in self.pairs:
            load[p.producer] += p.nbytes
        return load * self.scale()

    def balance(self) -> float:
        """Producer load max / mean over producers that hold anything."""
        load = self.producer_load()
        return float(load.max() / load.mean()) if load.sum() else 1.0

    def schedule(self, consumer: int) -> list[tuple[int, int, int, int]]:
        """(producer, first group, last group, bytes) runs in ``consumer``'s chunk issue order."""
        runs: list[tuple[int, int, int, int]] = []
        for c in self.chunks[consumer]:
            if runs and runs[-1][0] == c.producer:
                p, g0, _, n = runs[-1]
                runs[-1] = (p, g0, c.group, n + c.nbytes)
            else:
                runs.append((c.producer, c.group, c.group, c.nbytes))
        return runs


_T = TypeVar("_T")


def _measured(fn: Callable[[], _T], measure: bool) -> tuple[_T, float, int | None]:
    """``fn()``, its seconds untraced and, with ``measure``, the peak bytes tracemalloc sees in
    a second call (tracing slows Python several times, so it never touches the timed call)."""
    start = time.perf_counter()
    value = fn()
    seconds = time.perf_counter() - start
    if not measure:
        return value, seconds, None
    tracemalloc.start()
    try:
        fn()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return value, seconds, peak


def dry_run(
    metas: Sequence[WeightMeta],
    facts: list[ProducerFacts],
    num_consumers: int,
    workers_per_replica: int,
    layout_of: Any,
    *,
    config: TransferConfig | None = None,
    strided: bool = False,
    sample: int | None = None,
    measure_memory: bool = False,
    balance: str = ENGINE_BALANCE,
    wire: bool = True,
) -> DryRun:
    """Plan every pair of the fleet with the engine's own set-up code.

    ``layout_of(worker)`` gives a worker's (meta params, routes by HF name). ``strided``: the
    consumers' READ path with strided reads (``pair_layout``). ``measure_memory``: trace the
    peak Python allocation of the index, consumer 0 and the most loaded producer in a second,
    traced call of each (the timed calls are untraced).
    ``balance``: the router's rule (the engine's by default; ``"block"`` is DESIGN's rule).
    ``wire``: build the index from facts that went through pickle, as ``all_gather_object``
    hands them to every rank (objects of their own per producer), and time their unpickling;
    else from the shared objects given (cheaper, and optimistic about the merge).
    """
    config = config or TransferConfig(workers_per_replica=workers_per_replica)
    num_producers = len(facts)
    fleet = Fleet.split(num_producers, num_consumers)
    world = num_producers + num_consumers
    simulated = list(range(num_consumers)) if sample is None else list(range(sample))
    if sample is not None and not 0 < sample <= workers_per_replica:
        raise ValueError(f"sample={sample} must be 1..workers_per_replica={workers_per_replica}")

    gathered, gather_s, gather_bytes = _gather(facts, measure_memory) if wire else (facts, 0, None)

    def index_now() -> ModelIndex:
        return build_index(gathered, num_consumers, workers_per_replica, balance=balance)

    index, index_s, index_peak = _measured(index_now, measure_memory)
    run = DryRun(
        num_producers,
        num_consumers,
        workers_per_replica,
        simulated,
        index_s,
        index_peak,
        len(index.names),
        gather_s,
        gather_bytes,
    )
    plans: dict[int, tuple[WeightConsumer, dict[int, tuple[Any, str]]]] = {}
    for cid in simulated:
        params, routes = layout_of(cid % workers_per_replica)

        def consume(cid: int = cid, params: Any = params, routes: Any = routes) -> Any:
            consumer = WeightConsumer(
                cast(WorkerCoordinator, _SoloCoordinator(fleet.consumer_ranks[cid], world)),
                cast(DeviceCommunicator, _MetaCommunicator()),
                fleet=fleet,
                params=params,
                route=_router(routes),
                config=config,
            )
            consumer.layout = pair_layout(consumer.layout, strided)
            error = consumer._prepare(index)
            if error is not None:
                raise error
            return consumer, _consumer_digests(consumer, index, num_producers)

        measure = measure_memory and cid == simulated[0]
        (consumer, payloads), seconds, peak = _measured(consume, measure)
        run.consumers[cid] = RankCost(seconds, peak, len(payloads))
        run.chunks[cid] = consumer.chunks
        plans[cid] = (consumer, payloads)
        run.pairs.extend(_pair_plans(cid, consumer.chunks, item_sizes(consumer.requests)))
    _check_producers(run, index, plans, config, strided, measure_memory)
    return run


def _gather(
    facts: list[ProducerFacts], measure: bool
) -> tuple[list[ProducerFacts], float, int | None]:
    """The facts as a rank receives them (each unpickled), the seconds that takes, and (with
    ``measure``) the peak bytes of unpickling them all again, traced."""
    blobs: dict[tuple[int, int, bool], bytes] = {}  # producers with the same facts pickle alike
    wire = [
        blobs.setdefault((id(f.metadata), id(f.held), f.ships_metadata), pickle.dumps(f))
        for f in facts
    ]
    start = time.perf_counter()
    gathered = [pickle.loads(b) for b in wire]  # our own bytes, never a peer's
    seconds = time.perf_counter() - start
    if not measure or not wire:
        return gathered, seconds, None
    tracemalloc.start()
    try:
        again = [pickle.loads(b) for b in wire]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    del again
    return gathered, seconds, peak


def _router(routes: Any) -> Any:
    """``route(name)`` over a dict of routes by HF name (no entry: the weight is not needed)."""

    def route(name: str) -> Any:
        return routes.get(name, ())

    return route


def _consumer_digests(
    consumer: WeightConsumer, index: ModelIndex, num_producers: int
) -> dict[int, tuple[Any, str]]:
    """(encoded requests, digest) per producer with chunks, as ``_send_plans`` derives them
    (it walks every producer, so this does too)."""
    out = {}
    for p in range(num_producers):
        mine = [consumer.requests[i] for c in consumer.chunks if c.producer == p for i in c.items]
        if not mine:
            continue
        payload = encode_requests(mine)
        digest = plan_digest(
            consumer.consumer_id, p, consumer.chunks, payload, index.router, consumer.layout
        )
        out[p] = (payload, digest)
    return out


def _pair_plans(cid: int, chunks: list[Chunk], sizes: list[int]) -> list[PairPlan]:
    by: dict[int, list[Chunk]] = {}
    for c in chunks:
        by.setdefault(c.producer, []).append(c)
    return [
        PairPlan(
            producer=p,
            consumer=cid,
            nbytes=sum(c.nbytes for c in cs),
            payload=sum(sizes[i] for c in cs for i in c.items),
            chunks=len(cs),
            items=sum(len(c.items) for c in cs),
            packed_bytes=sum(c.nbytes for c in cs if len(c.items) > 1),
            max_chunk=max(c.nbytes for c in cs),
            first_group=min(c.group for c in cs),
            last_group=max(c.group for c in cs),
        )
        for p, cs in sorted(by.items())
    ]


def _check_producers(
    run: DryRun,
    index: ModelIndex,
    plans: dict[int, tuple[WeightConsumer, dict[int, tuple[Any, str]]]],
    config: TransferConfig,
    strided: bool,
    measure_memory: bool,
) -> None:
    """Each producer's ``_accept`` checks and re-cut of every plan sent to it; digests must
    equal the consumer's (``PlanMismatchError`` semantics, raised as AssertionError here)."""
    load = run.producer_load()
    heaviest = int(np.argmax(load)) if len(load) else 0
    layout = pair_layout(config.layout(), strided)
    by_producer: dict[int, list[int]] = {}
    for cid, (_, payloads) in plans.items():
        for p in payloads:
            by_producer.setdefault(p, []).append(cid)
    for p in range(run.num_producers):
        mine = by_producer.get(p, [])

        def accept(p: int = p, mine: list[int] = mine) -> None:
            checks = PlanCheck(p, config.layout(), ShapeCache())  # one cache per producer
            for cid in mine:
                payload, their = plans[cid][1][p]
                kinds, names, raw = payload
                ids = np.frombuffer(raw, dtype=np.int32)
                pos = checks.check_names(cid, index, names)
                sizes = checks.check_kinds(cid, index, kinds, names, ids, pos)
                chunks = cut_chunks(
                    index.group_ids[pos],
                    index.class_ids[pos],
                    np.full(len(pos), p),
                    sizes[ids],
                    layout,
                )
                ours = plan_digest(cid, p, chunks, payload, index.router, layout)
                if ours != their:
                    raise AssertionError(f"producer {p} and consumer {cid} planned differently")

        _, seconds, peak = _measured(accept, measure_memory and p == heaviest)
        run.producers[p] = RankCost(seconds, peak, len(mine))
