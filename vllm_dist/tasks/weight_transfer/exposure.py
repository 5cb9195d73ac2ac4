"""What a producer exposes to its consumers or moves into arenas, and the consumer's arenas.

``Exposures`` is the one registry of buffers an engine exposed (released at ``close``).
``SourceExposure`` decides which chunks a READ-path producer lets its consumer read straight
from the trainer's storages: a storage met once (a trainer that puts its weights in new
tensors every step) is packed, never registered, so registrations do not grow without end.
``share_source`` / ``gather_parameters`` move storages into arenas in place at set-up.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from vllm_dist.interfaces.dataplane import ExposedDescriptor, OneSidedCommunicator
from vllm_dist.tasks.weight_transfer._memory import (
    DEVICE_ARENA_BYTES,
    ArenaMap,
    gather_device_storages,
    share_storages,
)
from vllm_dist.tasks.weight_transfer.messages import SPREAD
from vllm_dist.tasks.weight_transfer.pairs import ProducerPair
from vllm_dist.tasks.weight_transfer.plan import Chunk
from vllm_dist.tasks.weight_transfer.source import WeightSource
from vllm_dist.tasks.weight_transfer.views import ViewCache


class Exposures:
    """The buffers one engine exposed through its one-sided communicator, by name."""

    def __init__(self, comm: OneSidedCommunicator) -> None:
        self.comm = comm
        self._names: list[str] = []

    def expose(self, tensor: torch.Tensor, name: str) -> Any:
        """Expose ``tensor`` as ``name``, read-only for peers (consumers only READ what a
        producer exposes, and nobody writes into a consumer's); returns its descriptor."""
        desc = self.comm.expose(tensor, name, writable=False)
        self._names.append(name)
        return desc

    def unexpose(self, name: str) -> None:
        self.comm.unexpose(name)
        self._names.remove(name)

    def __contains__(self, name: str) -> bool:
        return name in self._names

    def close(self) -> None:
        """Unexpose everything."""
        for name in self._names:
            self.comm.unexpose(name)
        self._names = []


def storage_address(tensor: torch.Tensor) -> int | None:
    """The address of ``tensor``'s storage; None for a tensor without one of its own (a
    wrapper subclass, such as quantized weights)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except RuntimeError:
        return None


def alone_in_storage(tensors: Iterable[torch.Tensor]) -> Callable[[torch.Tensor], bool]:
    """Whether a tensor of ``tensors`` is the only one of them in its storage, which may then
    move into an arena (a storage that holds several, a flat buffer or fused experts, is one
    home for them already); False for a tensor without a storage of its own."""
    homes = Counter(map(storage_address, tensors))

    def alone(tensor: torch.Tensor) -> bool:
        at = storage_address(tensor)
        return at is not None and homes[at] == 1

    return alone


def home(view: torch.Tensor, arenas: ArenaMap) -> tuple[int, int]:
    """(address, bytes) of the buffer a producer exposes to have ``view`` read in place: the
    ``share_storages`` arena its storage lies in (one exposure for every storage moved
    there), else its storage."""
    storage = view.untyped_storage()
    at = storage.data_ptr()
    arena = arenas.range_of(at)
    return arena if arena is not None else (at, storage.nbytes())


def chunk_bundles(
    pairs: Iterable[ProducerPair], tensors: Mapping[str, torch.Tensor]
) -> list[list[torch.Tensor]]:
    """The tensors of the items that travel together (chunks of several items, of the
    consumers that map this rank's memory), each in a storage of its own, in chunk order,
    cut into bundles of up to ``DEVICE_ARENA_BYTES`` between chunks: one arena each, so
    that no chunk spans two (its items would be packed). A storage that holds several
    weights (a trainer's flat buffer) is one home for them already: it stays."""
    alone = alone_in_storage(tensors.values())
    bundles: list[list[torch.Tensor]] = [[]]
    size, seen = 0, set()
    for pair in pairs:
        for c in pair.chunks if pair.maps else ():
            if len(c.items) < 2:
                continue
            names = [n for n in pair.views[c.index].names if n not in seen and alone(tensors[n])]
            seen.update(names)
            nbytes = sum(tensors[n].untyped_storage().nbytes() for n in names)
            if size and size + nbytes > DEVICE_ARENA_BYTES:
                bundles.append([])
                size = 0
            bundles[-1] += [tensors[n] for n in names]
            size += nbytes
    return bundles


def share_source(
    tensors: Sequence[torch.Tensor],
    names: Sequence[str],
    pairs: Iterable[ProducerPair],
    device: torch.device,
    arenas: ArenaMap,
) -> int:
    """Move a producer's served ``tensors`` (named ``names``, in the order chunks take them)
    into shared memory (CPU) or VRAM arenas (CUDA), in place; returns the bytes moved. In chunk
    order, a consumer's items step evenly through an arena and its copies batch into few."""
    if device.type == "cpu":
        return share_storages(list(tensors), arenas=arenas)
    return sum(
        gather_device_storages(
            bundle, arenas=arenas, max_bytes=DEVICE_ARENA_BYTES, arena_bytes=1 << 62, device=device
        )
        for bundle in chunk_bundles(pairs, dict(zip(names, tensors, strict=True)))
    )


def gather_parameters(
    params: Mapping[str, torch.Tensor],
    chunks: Sequence[Chunk],
    dest_params: Sequence[str],
    consumer_id: int,
    arenas: ArenaMap,
) -> int:
    """Move the consumer's CPU parameters that receive chunks of several items into private
    arenas, in place and in chunk order; returns the bytes moved. Moving only makes copies
    faster: where an arena's memory is not there, its parameters stay (with a warning)."""
    if not hasattr(torch.UntypedStorage, "_swap_data_ptr_"):
        return 0  # re-pointed tensors would leave the destination views behind
    alone = alone_in_storage(params.values())
    order: dict[int, torch.Tensor] = {}  # in chunk order, each parameter once
    for chunk in chunks:
        if len(chunk.items) < 2:
            continue
        for i in chunk.items:
            param = params[dest_params[i]]
            if param.is_cpu and alone(param):
                order.setdefault(id(param), param)
    if not order:
        return 0
    try:
        # an arena at a time: at most DEVICE_ARENA_BYTES are held twice while they move
        return gather_device_storages(
            list(order.values()), arenas=arenas, max_bytes=DEVICE_ARENA_BYTES, device="cpu"
        )
    except (MemoryError, RuntimeError) as exc:
        warnings.warn(
            f"consumer {consumer_id}: parameters left where they are ({exc}); set "
            "TransferConfig(gather_cpu_params=False) to skip trying",
            RuntimeWarning,
            stacklevel=3,
        )
    return 0


class SourceExposure:
    """READ path, producer: which chunks its consumers read in place from the source's own
    storages, and the exposure of those storages (each once, until ``close``)."""

    def __init__(
        self,
        exposures: Exposures,
        source: WeightSource,
        producer_id: int,
        cache: ViewCache,
        arenas: ArenaMap,
    ) -> None:
        self._exposures = exposures
        self._arenas = arenas
        self._source = source
        self._producer_id = producer_id
        self._cache = cache
        # storage (home) -> (exposed name, descriptor)
        self._source_names: dict[tuple[int, int], tuple[str, ExposedDescriptor]] = {}
        self._seen_sources: tuple[set[Any], set[Any]] = (set(), set())  # (last sync, this one)

    def end_sync(self) -> None:
        """The storages met this sync become the ones met last sync."""
        self._seen_sources = (self._seen_sources[1], set())

    def exposed_source(
        self, pair: ProducerPair, chunk: Chunk, tensors: Mapping[str, torch.Tensor]
    ) -> tuple[str, int, Any, Any] | None:
        """(buffer name, byte offset, descriptor if new, strides) of a chunk read in place.

        A one-item chunk: strides are None for a contiguous view, else the view's (strided
        reads). A chunk of several items, for a consumer that reads strided views on a mapping
        of this rank's memory, whose items all lie in one exposed buffer (a trainer's flat
        parameter buffer, or the ``share_storages`` arena its weights were moved into): the
        offset is ``SPREAD`` and the strides are ``(byte offset, strides)`` per item, so the
        consumer copies each item straight from the trainer's memory and nothing is packed.

        Only views of the source's own storage (not copies the chain made) whose storage was
        already there last sync (or lies in an arena) are exposed (a trainer that gathers into
        fresh memory every sync gets packed copies instead of an ever-growing set of
        registrations); it stays exposed until ``close``.
        """
        single = len(chunk.items) == 1
        if not (single or pair.maps):
            return None  # through NIXL, a descriptor per row of a small weight: packed
        srcs = pair.sources(chunk, tensors, self._cache)
        plan = pair.views[chunk.index]
        if plan.inplace is not None and plan.inplace[0] is srcs:
            return plan.inplace[1], plan.inplace[2], None, plan.inplace[3]  # as last sync
        if plan.copies:
            return None
        if single:
            view = srcs[0]
            contiguous = view.is_contiguous()
            if not (contiguous or pair.strided):
                return None
            strides: Any = None if contiguous else tuple(view.stride())
        else:
            where = home(srcs[0], self._arenas)
            if any(home(s, self._arenas) != where for s in srcs):
                return None  # several storages (not in one arena): packed
            strides = tuple((s.data_ptr() - where[0], tuple(s.stride())) for s in srcs)
        known = self.exposed_storage(pair, srcs[0])
        if known is None:
            return None
        if (strides is not None or not single) and pair.maps and not self.mappable(srcs[0]):
            # a consumer that maps its producers' memory reads strided views of this one, which
            # it cannot map (a DRAM storage out of shared memory), through NIXL: a descriptor
            # per row (per item of a flat buffer), not what it asked for. Packed instead.
            return None
        name, desc = known
        offset = srcs[0].data_ptr() - home(srcs[0], self._arenas)[0] if single else SPREAD
        plan.inplace = (srcs, name, offset, strides)
        return name, offset, desc, strides

    def mappable(self, view: torch.Tensor) -> bool:
        """Whether the exposed storage of ``view`` can be mapped by a same-node peer (a DRAM
        storage can stay out of shared memory: ``NixlOptions.shared_memory``)."""
        _, desc = self._source_names[home(view, self._arenas)]
        return desc.mapping is not None

    def exposed_storage(self, pair: ProducerPair, view: torch.Tensor) -> tuple[str, Any] | None:
        """(exposed name, descriptor the first time this consumer hears of it, else None) of
        ``view``'s storage (of the arena it lies in: ``_home``), exposing it if it was there
        last sync, lies in an arena, or the source vouches that its tensors stay where they
        are (``WeightSource.in_place``); None if it is new: a storage met once (a trainer that
        puts its weights in new tensors every step) is packed, never registered."""
        storage = view.untyped_storage()
        key = home(view, self._arenas)
        known = self._source_names.get(key)
        if known is None:
            arena = self._arenas.shared(storage.data_ptr())
            fresh = key not in self._seen_sources[0] and arena is None
            if fresh and not self._source.in_place:
                self._seen_sources[1].add(key)
                if pair.replay is not None:
                    pair.replay.ok = False  # read in place next sync: not a state to repeat
                return None
            name = f"wt-src-p{self._producer_id}-{len(self._source_names)}"
            whole = arena
            if whole is None:
                whole = torch.empty(0, dtype=torch.uint8, device=view.device)
                whole.set_(storage, 0, (key[1],), (1,))
            desc = self._exposures.expose(whole, name)
            known = self._source_names[key] = (name, desc)
        name, desc = known
        if name in pair.told:
            return name, None
        pair.told.add(name)  # this consumer imports the descriptor once
        return name, desc
