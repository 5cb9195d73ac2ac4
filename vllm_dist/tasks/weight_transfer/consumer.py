"""``WeightConsumer``: receives this consumer's shard of every weight into its parameters.

Set-up: bake the loader of every needed weight into op chains on fake tensors (anything that
needs real data fails here), plan the chunks, send every producer the requests routed to it
with a digest, and build the landing tables (where each chunk lands: straight in its parameter
or in a staging slot, unpacked from there). A sync hands those to the data path chosen once at
set-up (``paths``).

A consumer knows the version it holds (``version``: the last sync received in full) and whether
a failed sync left it torn (``torn``): the bookkeeping is a counter and a flag per sync, nothing
per chunk. ``TransferConfig(atomic=True)`` receives into a staging copy and copies it into the
parameters only once a sync arrived whole, so a failed sync leaves the last version intact.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import numpy as np
import torch

from vllm_dist.interfaces import DeviceCommunicator, WorkerCoordinator
from vllm_dist.interfaces.dataplane import (
    AsyncSendRecvCommunicator,
    PreparedReadCommunicator,
    StridedReadCommunicator,
)
from vllm_dist.tasks import step_record
from vllm_dist.tasks.weight_transfer._memory import CopyProgram
from vllm_dist.tasks.weight_transfer.config import (
    Fleet,
    Route,
    SyncStats,
    TornModelError,
    TransferConfig,
    UnfilledWeightsError,
    WeightTransferSetupError,
)
from vllm_dist.tasks.weight_transfer.exposure import Exposures, gather_parameters
from vllm_dist.tasks.weight_transfer.index import ModelIndex, ProducerFacts
from vllm_dist.tasks.weight_transfer.messages import AdmitMessage, PlanMessage, ReserveMessage
from vllm_dist.tasks.weight_transfer.ops import (
    Copy,
    Loader,
    OpChain,
    UnsafeOpError,
    bake,
    loader_key,
)
from vllm_dist.tasks.weight_transfer.pairs import ConsumerPair
from vllm_dist.tasks.weight_transfer.paths.base import ConsumerPath
from vllm_dist.tasks.weight_transfer.paths.push import ConsumerPushOrdered, ConsumerPushThreaded
from vllm_dist.tasks.weight_transfer.paths.read_consumer import ConsumerRead
from vllm_dist.tasks.weight_transfer.plan import (
    Chunk,
    Request,
    cut_chunks,
    encode_requests,
    item_sizes,
    plan_digest,
    request_kinds,
    slot_bytes,
)
from vllm_dist.tasks.weight_transfer.ring import SerialWorker, ServeRing
from vllm_dist.tasks.weight_transfer.setup import (
    EngineBase,
    gather_verdicts,
    gc_paused,
    item_table,
    pair_layout,
    shared_splits,
)
from vllm_dist.tasks.weight_transfer.views import ViewCache, as_bytes, slot_views


class WeightConsumer(EngineBase):
    """Receives this consumer's shard of every weight into its own parameters.

    Args:
        coordinator: an initialized coordinator over the fleet.
        communicator: a communicator over the same group.
        fleet: the producer and consumer ranks; this worker must be a consumer.
        params: this consumer's parameters by name (written in place by every sync).
        route: ``route(name)`` -> ``[(param name, loader), ...]`` for each model weight; an
            empty result means this consumer does not need the weight.
        config: the deployment settings (must equal the producers').
    """

    def __init__(
        self,
        coordinator: WorkerCoordinator,
        communicator: DeviceCommunicator,
        *,
        fleet: Fleet,
        params: Mapping[str, torch.Tensor],
        route: Route,
        config: TransferConfig | None = None,
    ) -> None:
        super().__init__(coordinator, communicator, fleet, config or TransferConfig())
        rank = coordinator.get_rank()
        if rank not in fleet.consumer_ranks:
            raise ValueError(f"rank {rank} is not a consumer of {fleet}")
        self.consumer_id = fleet.consumer_ranks.index(rank)
        self.params = params
        self.route = route
        # where the bytes land: ``params``, or in atomic mode staging copies of those it fills
        self._recv: Mapping[str, torch.Tensor] = params
        self._staged: dict[str, torch.Tensor] = {}
        self._version: int | None = None
        self._torn = False
        self.chunks: list[Chunk] = []
        self.requests: list[Request] = []
        self._dests: list[torch.Tensor] = []
        self._unpack_views: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        self._unpack_programs: dict[int, CopyProgram] = {}  # by chunk index
        self.bake_seconds = 0.0
        self.gathered_bytes = 0  # gather_cpu_params: parameter bytes moved into an arena
        want = self.config.strided_reads
        strided_comm = communicator if isinstance(communicator, StridedReadCommunicator) else None
        capable = self._one_sided is not None and strided_comm is not None
        if want and not capable:
            raise ValueError(
                "TransferConfig(strided_reads=True) needs the one-sided READ path with a "
                f"communicator that reads strided views (read_strided_async); "
                f"{type(communicator).__name__} on the {self.path!r} path has none: leave "
                "strided_reads=None (auto) or use NIXL_RDT"
            )
        self._strided = capable and (
            want is True
            or (want is None and strided_comm is not None and strided_comm.maps_peer_memory)
        )
        self.layout = pair_layout(self.layout, self._strided)
        # strided reads on a mapping of the producers' memory (a strided view costs its bytes)
        self._maps = (
            self._strided and strided_comm is not None and bool(strided_comm.maps_peer_memory)
        )
        self._strided_comm = strided_comm
        self._preparer: PreparedReadCommunicator | None = (
            communicator if isinstance(communicator, PreparedReadCommunicator) else None
        )
        self._async: AsyncSendRecvCommunicator | None = (
            communicator if isinstance(communicator, AsyncSendRecvCommunicator) else None
        )
        self._pairs: dict[int, ConsumerPair] = {}
        self._views = ViewCache()
        self._dest_params: list[str] = []
        self._direct: list[torch.Tensor | None] = []
        self._items: list[tuple[torch.dtype, tuple[int, ...], int]] = []
        self._suffixes: list[OpChain] = []
        self._stage_slot: list[int] = []
        self._targets: list[torch.Tensor | None] = []
        self._replayed = False
        self._exposures = None if self._one_sided is None else Exposures(self._one_sided)
        self._path: ConsumerPath | None = None  # chosen at set-up, once the tables are built
        self._prepared: tuple[ModelIndex, Any] | None = None  # prepare_join's, for join()

    @gc_paused
    def setup(self, *, defer: bool = False) -> None:
        """Bake, plan and reserve; raises on any rank's refusal (see module docstring).

        ``defer``: take part in the fleet's set-up without a plan (the engine is not ready
        yet); producers serve this consumer nothing until it calls ``join()``.
        """
        start = self._phase_start = time.perf_counter()
        index = self._index(None)
        self._phase("index")
        if defer:
            self._send_plans(index, None, deferred=True)
            gather_verdicts(self.coordinator, None)
            if self._one_sided is not None:
                self._one_sided.exchange_exposed()
            self.setup_seconds = time.perf_counter() - start
            return
        error = self._prepare(index)
        self._send_plans(index, error)
        self._phase("send plans")
        gather_verdicts(self.coordinator, error)
        self._phase("verdicts")
        if self.config.gather_cpu_params and self.communicator.device.type == "cpu":
            # while the producers move their own weights
            moved = gather_parameters(
                self._recv, self.chunks, self._dest_params, self.consumer_id, self.arenas
            )
            self.gathered_bytes = moved
            self._phase("gather parameters")
        path = self._make_rings()
        if isinstance(path, ConsumerRead):
            path.connect()
        self._phase("rings")
        self.setup_seconds = time.perf_counter() - start

    @gc_paused
    def join(self) -> None:
        """Join the fleet between syncs, while every producer calls ``admit(consumer_id)``.

        For a consumer that deferred set-up or a restarted one (a new engine): the producers'
        facts come from producer 0 (or ``prepare_join``), the plan is checked as at set-up, and
        only this consumer and the producers take part. Raises ``WeightTransferSetupError`` (or
        this rank's own error) when any side refused.
        """
        start = self._phase_start = time.perf_counter()
        prods = self.fleet.producer_ranks
        hello = [self.coordinator.recv_object(r) for r in prods]
        for p, msg in enumerate(hello):
            if not (isinstance(msg, AdmitMessage) and msg.producer_id == p):
                raise RuntimeError(f"expected admit() from producer {p}, got {msg!r:.80}")
        self._syncs = hello[0].syncs
        if hello[0].facts is not None:
            self.prepare_join(hello[0].facts)
        prepared, self._prepared = self._prepared, None
        if prepared is None:
            raise RuntimeError("admit() came without the producers' facts and none were prepared")
        index, error = prepared
        self._send_plans(index, error)
        verdicts = [self.coordinator.recv_object(r) for r in prods]
        refused = [f"producer {p}: {v}" for p, v in enumerate(verdicts) if v is not None]
        verdict = (
            f"consumer {self.consumer_id}: {type(error).__name__}: {error}"
            if error is not None
            else ("; ".join(refused) or None)
        )
        for r in prods:
            self.coordinator.send_object(verdict, r)
        if error is not None:
            raise error
        if verdict is not None:
            raise WeightTransferSetupError(f"join refused: {verdict}")
        self._phase("verdicts")
        if self.config.gather_cpu_params and self.communicator.device.type == "cpu":
            moved = gather_parameters(
                self._recv, self.chunks, self._dest_params, self.consumer_id, self.arenas
            )
            self.gathered_bytes = moved
            self._phase("gather parameters")
        path = self._make_rings()
        if isinstance(path, ConsumerRead):
            for pair in self._pairs.values():
                desc = self.coordinator.recv_object(pair.peer_rank)
                path.import_ring(pair, desc)
            path.pin()
        self._phase("rings")
        self.setup_seconds = time.perf_counter() - start

    def prepare_join(self, facts: list[ProducerFacts]) -> None:
        """Bake and plan against ``facts`` (the producers', got elsewhere) before ``join()``: the
        producers' ``admit`` (sending no facts) then waits for the plan to travel and be checked,
        not made. A plan made from facts that differ from theirs is refused as always."""
        self._phase_start = time.perf_counter()
        index = self._build_index(facts)
        self._phase("index")
        self._prepared = (index, self._prepare(index))

    def _prepare(self, index: ModelIndex) -> BaseException | None:
        """Bake and plan; returns the error instead of raising (the fleet must hear of it)."""
        try:
            self.requests, dests = self._bake(index)
            self.bake_seconds = self._phase("bake")
            if self.config.atomic:
                self._stage({name for name, _ in dests})
            self._dests = [self._dest_view(name, chain) for name, chain in dests]
            self._dest_params = [name for name, _ in dests]
            self._phase("destination views")
            self.chunks = self._plan(index)
            self._phase("plan")
        except Exception as exc:  # reported to the fleet by the caller
            return exc
        return None

    def _plan(self, index: ModelIndex) -> list[Chunk]:
        """``build_chunks`` over the index's per-name arrays (a name it lacks: group 0,
        class 0, as the router resolves it; the producer then refuses it)."""
        names = [r.name for r in self.requests]
        pos = np.fromiter((index.position.get(n, -1) for n in names), np.int64, len(names))
        known = pos >= 0
        groups = np.where(known, index.group_ids[np.maximum(pos, 0)], 0) if len(pos) else pos
        classes = np.where(known, index.class_ids[np.maximum(pos, 0)], 0) if len(pos) else pos
        producers = np.asarray(
            [
                index.router.producer_for_group(self.consumer_id, g, k)
                for g, k in zip(groups.tolist(), classes.tolist(), strict=True)
            ],
            dtype=np.int64,
        )
        sizes = item_sizes(self.requests)
        kinds = request_kinds(self.requests)
        return cut_chunks(groups, classes, producers, sizes, self.layout, kinds=kinds)

    def _bake(self, index: ModelIndex) -> tuple[list[Request], list[tuple[str, Any]]]:
        """Run the loader of every needed weight on fakes; the requests and their destinations.

        Loaders that bake alike (``loader_key``) on the same shapes are baked once and their
        recorded copies shared, chain objects included (``ViewCache`` keys on them).
        """
        requests: list[Request] = []
        dests: list[tuple[str, Any]] = []
        metas: dict[Any, torch.Tensor] = {}
        baked: dict[Any, list[tuple[Copy, tuple[int, ...]]]] = {}
        filled: set[str] = set()
        self._refuse_unheld(index)
        for name in index.names:
            meta = index.meta[name]
            for param_name, loader in self.route(name):
                dest = self.params.get(param_name)
                if dest is None:
                    raise KeyError(f"route({name!r}) names parameter {param_name!r}, not in params")
                filled.add(param_name)
                lkey = loader_key(loader)
                key = (
                    None if lkey is None else (meta.shape, meta.dtype, dest.shape, dest.dtype, lkey)
                )
                copies = None if key is None else baked.get(key)
                if copies is None:
                    copies = self._bake_one(loader, meta, dest, name, metas)
                    if key is not None:
                        baked[key] = copies
                for copy, wire in copies:
                    if 0 in copy.shape:
                        continue  # a 0-size slice: nothing to move
                    # what the chain makes of the weight: a view(dtype) reinterprets its bytes
                    dtype = meta.dtype if copy.dtype is None else str(copy.dtype)
                    requests.append(Request(name, copy.src_chain, copy.shape, dtype, wire))
                    dests.append((param_name, copy.dest_chain))
        unfilled = [n for n in self.params if n not in filled]
        if unfilled and not self.config.allow_unfilled_params:
            raise UnfilledWeightsError(
                f"consumer {self.consumer_id}: no route fills parameter(s) {unfilled[:10]} "
                f"({len(unfilled)} in all), so they would stay as they are through every sync; "
                "fix the route, or pass TransferConfig(allow_unfilled_params=True)"
            )
        return requests, dests

    def _refuse_unheld(self, index: ModelIndex) -> None:
        """Refuse weights of the model that this consumer routes but no producer holds."""
        wanted = unheld_routed(index, self.route)
        if wanted:
            raise unheld_error(self.consumer_id, wanted)

    def _stage(self, names: set[str]) -> None:
        """Atomic mode: a staging copy of every parameter the plan fills, where syncs land."""
        self._staged = {n: p.detach().clone() for n, p in self.params.items() if n in names}
        self._recv = {**self.params, **self._staged}

    def _bake_one(
        self, loader: Loader, meta: Any, dest: torch.Tensor, name: str, metas: dict[Any, Any]
    ) -> list[tuple[Copy, tuple[int, ...]]]:
        dtype = meta.torch_dtype
        return [
            (copy, self._shapes(meta.shape, dtype, copy.src_chain)[1])
            for copy in bake(loader, meta.shape, dtype, dest, name, metas)
        ]

    def _dest_view(self, param_name: str, chain: Any) -> torch.Tensor:
        param = self._recv[param_name].data
        if not chain:
            return param
        if self._views.geometry(tuple(param.shape), param.stride(), param.dtype, chain) is None:
            raise UnsafeOpError(
                f"the loader's destination view of {param_name!r} ({chain!r}) is a copy, so "
                "copy_ into it would not reach the parameter; avoid contiguous()/reshape on "
                "non-contiguous destination views"
            )
        return self._views(param, chain)

    def _send_plans(
        self, index: ModelIndex, error: BaseException | None, *, deferred: bool = False
    ) -> None:
        router = index.router
        router.bind(
            actors=list(self.fleet.producer_ranks),
            produce_methods=[self._control(r) for r in self.fleet.producer_ranks],
            consumer_id=self.consumer_id,
        )
        digests: dict[int, str] = {}
        reserve: dict[int, int] = {}
        for p, prank in enumerate(self.fleet.producer_ranks):
            if error is not None or deferred:
                payload: Any = f"consumer {self.consumer_id} " + (
                    "deferred set-up" if deferred else "failed set-up"
                )
            else:
                payload = encode_requests(
                    [self.requests[i] for c in self.chunks if c.producer == p for i in c.items]
                )
                digests[p] = plan_digest(
                    self.consumer_id, p, self.chunks, payload, router, self.layout
                )
            plan = PlanMessage(self.consumer_id, payload, self.path, self._strided, self._maps)
            self.coordinator.send_object(plan, prank)
            reserve[p] = slot_bytes(self.chunks, p, self.layout.align) * self.layout.ring_slots
        router.reserve_serve_buffers(reserve, digests)

    def _control(self, rank: int) -> Callable[..., None]:
        def send(verb: str, consumer_id: int, *args: Any) -> None:
            if verb != "reserve":
                raise RuntimeError(f"the engine's producers take no {verb!r} request")
            self.coordinator.send_object(ReserveMessage(consumer_id, *args), rank)

        return send

    def _make_rings(self) -> ConsumerPath:
        """The pairs' staging rings and landing tables, then the data path over them."""
        read = self._one_sided is not None
        for p, prank in enumerate(self.fleet.producer_ranks):
            chunks = [c for c in self.chunks if c.producer == p]
            if not chunks:
                continue
            slot = slot_bytes(chunks, p, self.layout.align)
            # push: one staging slot per producer (its receiver thread unpacks every chunk
            # before the next recv); READ: K, reads run ahead of unpacks
            k = self.layout.ring_slots if read else 1
            buf = torch.empty(slot * k, dtype=torch.uint8, device=self.communicator.device)
            self._pairs[p] = ConsumerPair(
                peer_rank=prank,
                chunks=chunks,
                slot_bytes=slot,
                ring=ServeRing(buf, k, slot),
                worker=SerialWorker(f"wt-recv-p{p}") if self._threads else None,
                last_seq=max(c.seq for c in chunks),
            )
        self._items = item_table(self.requests)
        self._suffixes = shared_splits(self.requests, 1)
        self._direct = [self._direct_dest(c) for c in self.chunks]
        self._targets = [None] * len(self.chunks)
        self._stage_slot = stage_slots(self.chunks, self._direct, self.layout.ring_slots, read)
        if self._path is not None:
            self._path.close()
        if self._one_sided is not None:
            assert self._exposures is not None
            strided = self._strided_comm if self._strided else None
            one = self._one_sided
            self._path = ConsumerRead(self, one, strided, self._preparer, self._exposures)
        else:
            push = ConsumerPushThreaded if self._threads else ConsumerPushOrdered
            self._path = push(self, self._async)
        return self._path

    @gc_paused
    def sync(self) -> SyncStats:
        """Receive one version of the weights into ``params``; returns this rank's stats."""
        start = time.perf_counter()
        if self.trace is not None:
            self.trace.clear()
        step_record.sync_begins(self)
        if self._path is None:
            raise RuntimeError("sync() needs setup() (or join()) first")
        self._syncs += 1
        self._packed = 0
        try:
            self._replayed = self._path.receive()
        except BaseException as exc:
            self._failed(exc, intact=bool(self._staged))
        if self._staged:
            try:
                self._commit()
            except BaseException as exc:
                self._failed(exc, intact=False)
        self._torn = False
        self._version = step_record.synced(self)
        return SyncStats(
            seconds=time.perf_counter() - start,
            bytes=sum(c.nbytes for c in self.chunks),
            chunks=len(self.chunks),
            path=self.path,
            packed=self._packed,
            replayed=self._replayed,
        )

    @property
    def version(self) -> int | None:
        """The sync whose weights this consumer holds in full (1 for the first), or None
        before the first; a torn sync does not change it."""
        return self._version

    @property
    def torn(self) -> bool:
        """Whether the last sync failed part-way: parameters may be part old, part new (never
        in atomic mode). Do not serve until a sync succeeds."""
        return self._torn

    @property
    def ready(self) -> bool:
        """Whether the parameters hold one whole version (a sync succeeded, none tore since)."""
        return self._version is not None and not self._torn

    def _commit(self) -> None:
        """Atomic mode: the whole sync arrived in staging; copy it into the parameters."""
        for name, staged in self._staged.items():
            self.params[name].data.copy_(staged)

    def _failed(self, exc: BaseException, *, intact: bool) -> NoReturn:
        """A sync failed: mark the model torn (unless ``intact``: atomic mode, before the
        commit), forget the replay records (the next sync reads every chunk) and raise
        ``TornModelError`` from ``exc``."""
        for pair in self._pairs.values():
            if pair.replay is not None:
                with contextlib.suppress(Exception):  # the sync's own error is the one to raise
                    pair.replay.close()
                pair.replay = None
        if not isinstance(exc, Exception):
            self._torn = self._torn or not intact
            raise exc
        if not intact:
            self._torn = True
        raise torn_error(self.consumer_id, self._syncs, self._version, exc, intact=intact) from exc

    def _target(self, j: int) -> torch.Tensor:
        """Where chunk ``j``'s bytes land: its destination (direct) or its staging slot."""
        target = self._targets[j]
        if target is None:
            target = self._targets[j] = self._find_target(j)
        return target

    def _find_target(self, j: int) -> torch.Tensor:
        direct = self._direct[j]
        if direct is not None:
            return direct
        chunk = self.chunks[j]
        pair = self._pairs[chunk.producer]
        assert pair.ring is not None
        start = self._stage_slot[j] * pair.slot_bytes
        return pair.ring.buffer[start : start + chunk.nbytes]

    def _direct_dest(self, chunk: Chunk) -> torch.Tensor | None:
        """A one-item chunk's destination bytes when it is contiguous and of the wire dtype."""
        if len(chunk.items) != 1:
            return None
        i = chunk.items[0]
        dest = self._dests[i]
        if not self._suffixes[i] and dest.is_contiguous() and dest.dtype == self._items[i][0]:
            return as_bytes(dest)
        return None

    def _unpacker(self, j: int) -> Callable[[], None]:
        """What unpacks chunk ``j`` from its staging slot (push path)."""
        return self._unpack_program(j).run

    def _unpack_program(self, j: int) -> CopyProgram:
        """The ``CopyProgram`` that unpacks chunk ``j`` from its staging slot, planned once
        (the slot and destinations never move); its gathers stage in the producer pair's
        buffer (chunks of one producer are unpacked one after another)."""
        prog = self._unpack_programs.get(j)
        if prog is None:
            pair = self._pairs[self.chunks[j].producer]
            dsts, srcs = self._unpack_plan(j)
            prog = self._unpack_programs[j] = CopyProgram(dsts, srcs, staging=pair.stage)
        return prog

    def _unpack_plan(
        self, j: int, slot: torch.Tensor | None = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(destination views, wire views in the chunk's slot) of chunk ``j``, built once: the
        slot of a chunk never moves."""
        views = self._unpack_views.get(j)
        if views is None:
            chunk = self.chunks[j]
            slot = self._target(j) if slot is None else slot
            wires = slot_views(slot, [self._items[i] for i in chunk.items], chunk.offsets)
            srcs = [
                self._views(wire, self._suffixes[i])
                for wire, i in zip(wires, chunk.items, strict=True)
            ]
            views = self._unpack_views[j] = ([self._dests[i] for i in chunk.items], srcs)
        return views

    def close(self) -> None:
        """Release the path's prepared reads and unexpose everything this consumer exposed."""
        if self._path is not None:
            self._path.close()
        for pair in self._pairs.values():
            pair.close()
        self._pairs.clear()
        if self._exposures is not None:
            self._exposures.close()


def unheld_routed(index: ModelIndex, route: Callable[[str], Any]) -> list[str]:
    """The weights ``route`` sends somewhere that no producer holds."""
    unheld = [n for n in index.meta if n not in index.position]
    return [n for n in unheld if any(True for _ in route(n))]


def unheld_error(consumer_id: int, wanted: list[str]) -> UnfilledWeightsError:
    """The set-up error for routed weights ``wanted`` that no producer holds."""
    return UnfilledWeightsError(
        f"consumer {consumer_id} routes weight(s) {wanted[:10]} ({len(wanted)} in "
        "all) that no producer holds, so their parameters would stay stale; make a "
        "producer hold them (held names) or route them nowhere"
    )


def torn_error(
    consumer_id: int, target: int, held: int | None, exc: BaseException, *, intact: bool
) -> TornModelError:
    """The error of sync ``target`` failing with ``exc``: the model is torn, unless ``intact``
    (atomic mode failed before its commit: version ``held`` is whole)."""
    if intact:
        return TornModelError(
            f"consumer {consumer_id}: sync {target} failed; atomic mode kept version "
            f"{held} intact (not torn): {type(exc).__name__}: {exc}",
            held=held,
            target=target,
        )
    return TornModelError(
        f"consumer {consumer_id}: the model is torn: sync {target} failed part-way "
        f"(held version {held}, going to {target}), so parameters may be part "
        f"old, part new; do not serve it until a sync succeeds: "
        f"{type(exc).__name__}: {exc}",
        held=held,
        target=target,
    )


def stage_slots(chunks: list[Chunk], direct: list[Any], ring_slots: int, read: bool) -> list[int]:
    """The staging slot of each chunk: READ, round robin over the producer's chunks that may
    need staging (a direct chunk never does: -1); push, the producer's one slot (0)."""
    if not read:
        return [0] * len(chunks)
    staging: dict[int, int] = {}
    out = []
    for c, dest in zip(chunks, direct, strict=True):
        if dest is None:
            out.append(staging.get(c.producer, 0) % ring_slots)
            staging[c.producer] = staging.get(c.producer, 0) + 1
        else:
            out.append(-1)
    return out
