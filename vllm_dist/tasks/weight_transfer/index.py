"""The fleet's shared view of the model: merged metadata, gather groups, owner classes, router.

Every rank builds the same ``ModelIndex`` from the producers' facts, gathered over the
coordinator at set-up, so routes need no further messages. The facts hold one copy of the
model's metadata and each producer's held names; owners are worked out once per distinct held
set, not per (name, producer), so the index grows with the model and the number of distinct
shards, not with the fleet.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from vllm_dist.tasks.weight_transfer.groups import layerwise_groups
from vllm_dist.tasks.weight_transfer.messages import (
    ProducerFacts,
    decode_held_columns,
    metadata_digest,
)
from vllm_dist.tasks.weight_transfer.router import RdtRouter
from vllm_dist.tasks.weight_transfer.source import WeightMeta, dtype_from_str

__all__ = ["ModelIndex", "ProducerFacts", "build_index"]


@dataclass(frozen=True, kw_only=True)
class ModelIndex:
    """Names in gather order, their metadata, groups and the router over them.

    The arrays are per name in ``names`` order (``position[name]``): the gather group, the
    owner class, and the id of its (shape, dtype) in ``shapes``; they let a producer check and
    plan 100,000 requested names with array operations instead of per-name calls.
    """

    names: list[str]
    meta: dict[str, WeightMeta]
    groups: list[list[str]]
    holders: dict[str, list[int]]
    router: RdtRouter
    position: dict[str, int] = field(default_factory=dict)
    group_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    class_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    shape_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    shapes: list[tuple[tuple[int, ...], str]] = field(default_factory=list)

    def routes(self, consumer_id: int, positions: np.ndarray) -> np.ndarray:
        """The producer that serves each name at ``positions`` to ``consumer_id``."""
        g = self.group_ids[positions]
        k = self.class_ids[positions]
        pairs, inverse = np.unique(np.stack([g, k]), axis=1, return_inverse=True)
        per_pair = [
            self.router.producer_for_group(consumer_id, int(gi), int(ki)) for gi, ki in pairs.T
        ]
        return np.asarray(per_pair, dtype=np.int64)[inverse.reshape(-1)]

    def held_by(self, producer: int) -> np.ndarray:
        """Per name: whether ``producer`` holds it."""
        owning = [k for k, owners in enumerate(self.router.owner_sets) if producer in owners]
        return np.isin(self.class_ids, owning)


def build_index(
    facts: Sequence[ProducerFacts],
    num_consumers: int,
    workers_per_replica: int,
    *,
    balance: str = "block",
) -> ModelIndex:
    """Merge the producers' facts into one index (the same on every rank).

    ``balance``: the router's rule (``RdtRouter``); every rank of a fleet must pass the same.

    Raises:
        ValueError: no facts carry the model's metadata, or two producers disagree on a
            weight's dtype or shape.
    """
    meta, held_sets = _merge(facts)
    owners_of = _owner_classes(meta, held_sets)
    holders = dict(zip(meta, owners_of, strict=True))
    groups = layerwise_groups(n for n in meta if holders[n])
    names = [n for g in groups for n in g]
    classes: dict[int, int] = {}  # owner list (by identity) -> class, in gather order
    name_class = [classes.setdefault(id(holders[n]), len(classes)) for n in names]
    by_id = {id(o): o for o in owners_of}
    shape_table: dict[tuple[tuple[int, ...], str], int] = {}
    shape_ids = [
        shape_table.setdefault((meta[n].shape, meta[n].dtype), len(shape_table)) for n in names
    ]
    item_bytes = [math.prod(shape) * dtype_from_str(dtype).itemsize for shape, dtype in shape_table]
    router = RdtRouter(
        len(facts),
        num_consumers,
        owner_sets=[by_id[k] for k in classes] or None,
        name_owner_class=name_class,
        names=names,
        group_lens=[len(g) for g in groups],
        workers_per_replica=workers_per_replica,
        balance=balance,
        name_bytes=(np.asarray(item_bytes, dtype=np.int64)[shape_ids]).tolist(),
    )
    router.validate()
    return ModelIndex(
        names=names,
        meta=meta,
        groups=groups,
        holders=holders,
        router=router,
        position={n: i for i, n in enumerate(names)},
        group_ids=np.repeat(np.arange(len(groups)), [len(g) for g in groups]),
        class_ids=np.asarray(name_class, dtype=np.int64),
        shape_ids=np.asarray(shape_ids, dtype=np.int64),
        shapes=list(shape_table),
    )


def _merge(
    facts: Sequence[ProducerFacts],
) -> tuple[dict[str, WeightMeta], list[frozenset[str] | None]]:
    """The merged metadata and each producer's held names (None = every name).

    Metadata objects and held-name blobs that several producers share are read once."""
    shipped = next((f.metadata for f in facts if f.metadata is not None), None)
    if shipped is None:
        if not facts:
            return {}, []
        raise ValueError(
            "no producer's facts carry the model's metadata: producer 0 must ship it "
            "(ProducerFacts(ships_metadata=True))"
        )
    meta: dict[str, WeightMeta] = {}
    digest = metadata_digest(shipped) if any(f.metadata is None for f in facts) else b""
    seen: set[int] = set()
    decoded: dict[bytes, frozenset[str]] = {}
    held: list[frozenset[str] | None] = []
    for p, f in enumerate(facts):
        if f.metadata is not None:
            if id(f.metadata) not in seen:
                seen.add(id(f.metadata))
                _add(meta, f.metadata, p)
            held.append(f.held)
        elif f.held_blob is None:  # holds every weight of the shipped model
            if f.digest != digest:
                raise ValueError(
                    f"producer {p} holds every weight but describes another model than the "
                    "metadata shipped (digests differ); every producer must describe the same "
                    "model, or name what it holds"
                )
            held.append(None)
        else:
            names = decoded.get(f.held_blob)
            if names is None:
                columns = decode_held_columns(f.held_blob, f"producer {p}'s facts")
                for name, dtype, shape in zip(*columns, strict=True):
                    m = meta.get(name)  # known and alike: nothing to build
                    if m is None or m.dtype != dtype or m.shape != shape:
                        _add(meta, [WeightMeta(name=name, dtype=dtype, shape=shape)], p)
                names = decoded[f.held_blob] = frozenset(columns[0])
            held.append(names)
    return meta, held


def _add(meta: dict[str, WeightMeta], metas: Sequence[WeightMeta], producer: int) -> None:
    """Add ``metas`` to ``meta``; a name seen before must have the same dtype and shape."""
    for m in metas:
        seen = meta.setdefault(m.name, m)
        if seen is not m and seen != m:
            raise ValueError(
                f"producers disagree on weight {m.name!r}: {seen} vs producer {producer}'s {m}; "
                "every producer must describe the same model"
            )


def _owner_classes(
    meta: dict[str, WeightMeta], held: list[frozenset[str] | None]
) -> list[list[int]]:
    """Per name of ``meta``: the producers holding it, one shared list per distinct owner set."""
    sets: dict[frozenset[str] | None, list[int]] = {}
    for p, h in enumerate(held):
        sets.setdefault(h, []).append(p)
    if not meta:
        return []
    if list(sets) == [None]:  # every producer holds everything: one shared list
        everyone = sets[None]
        return [everyone] * len(meta)
    position = {n: i for i, n in enumerate(meta)}
    mask = np.zeros((len(sets), len(meta)), dtype=bool)
    for row, h in enumerate(sets):
        if h is None:
            mask[row] = True
        else:
            mask[row, [position[n] for n in h if n in position]] = True
    signature = np.ascontiguousarray(np.packbits(mask, axis=0).T)  # per name: sets holding it
    if signature.shape[1] <= 8:  # one integer per name: a flat unique instead of a row sort
        wide = np.zeros((len(meta), 8), dtype=np.uint8)
        wide[:, : signature.shape[1]] = signature
        keys, inverse = np.unique(wide.view(np.uint64).reshape(-1), return_inverse=True)
        unique = keys.view(np.uint8).reshape(-1, 8)
    else:
        unique, inverse = np.unique(signature, axis=0, return_inverse=True)
    owner_lists = [
        sorted(p for row, ps in enumerate(sets.values()) if bits[row] for p in ps)
        for bits in np.unpackbits(unique, axis=1, count=len(sets)).astype(bool)
    ]
    return [owner_lists[k] for k in inverse.reshape(-1).tolist()]
