"""The fleet's shared view of the model: merged metadata, gather groups, owner classes, router.

Every rank builds the same ``ModelIndex`` from the producers' (metadata, held names) facts,
gathered over the coordinator at set-up, so routes need no further messages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_dist.tasks.weight_transfer.groups import layerwise_groups
from vllm_dist.tasks.weight_transfer.router import RdtRouter
from vllm_dist.tasks.weight_transfer.source import WeightMeta


@dataclass(frozen=True, kw_only=True, slots=True)
class ProducerFacts:
    """What one producer tells the fleet at set-up."""

    metadata: tuple[WeightMeta, ...]
    held: frozenset[str] | None

    def __reduce__(self) -> tuple[Any, ...]:
        # by columns: pickling 100,000 slotted dataclasses one by one takes seconds
        m = self.metadata
        columns = ([w.name for w in m], [w.dtype for w in m], [w.shape for w in m])
        return (_facts_from_columns, (*columns, self.held))


def _facts_from_columns(
    names: list[str], dtypes: list[str], shapes: list[tuple[int, ...]], held: Any
) -> ProducerFacts:
    interned: dict[str, str] = {}
    metadata = tuple(
        WeightMeta(name=n, dtype=interned.setdefault(d, d), shape=tuple(s))
        for n, d, s in zip(names, dtypes, shapes, strict=True)
    )
    return ProducerFacts(metadata=metadata, held=held)


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
    facts: Sequence[ProducerFacts], num_consumers: int, workers_per_replica: int
) -> ModelIndex:
    """Merge the producers' facts into one index (the same on every rank).

    Raises:
        ValueError: two producers disagree on a weight's dtype or shape.
    """
    meta: dict[str, WeightMeta] = {}
    for p, f in enumerate(facts):
        for m in f.metadata:
            seen = meta.setdefault(m.name, m)
            if seen is not m and seen != m:
                raise ValueError(
                    f"producers disagree on weight {m.name!r}: {seen} vs producer {p}'s {m}; "
                    "every producer must describe the same model"
                )
    if all(f.held is None for f in facts):  # every producer holds everything: one shared list
        everyone = list(range(len(facts)))
        holders = dict.fromkeys(meta, everyone)
    else:
        holders = {
            n: [p for p, f in enumerate(facts) if f.held is None or n in f.held] for n in meta
        }
    groups = layerwise_groups(n for n in meta if holders[n])
    names = [n for g in groups for n in g]
    classes: dict[tuple[int, ...], int] = {}
    name_class = [classes.setdefault(tuple(holders[n]), len(classes)) for n in names]
    router = RdtRouter(
        len(facts),
        num_consumers,
        owner_sets=[list(s) for s in classes] or None,
        name_owner_class=name_class,
        names=names,
        group_lens=[len(g) for g in groups],
        workers_per_replica=workers_per_replica,
    )
    router.validate()
    shape_table: dict[tuple[tuple[int, ...], str], int] = {}
    shape_ids = [
        shape_table.setdefault((meta[n].shape, meta[n].dtype), len(shape_table)) for n in names
    ]
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
