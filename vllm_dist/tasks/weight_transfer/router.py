"""RdtRouter: which producer serves each weight to each consumer.

Ownership is per name: producers that hold the same names form an *owner class* (a pipeline
stage, an expert shard), and a name can only come from one of its owners. A route depends on
(worker in its replica, owner class, gather group) only, so every name of a group comes from
one producer and worker i of every inference replica resolves the same producer (replicas then
read identical bytes from identical places).

Two rules pick the producer. ``balance="block"`` (the default, DESIGN's rule) gives worker w the
block ``assign_producer_indices(len(owners), workers, w)``. Where a class has fewer owners than a
replica has workers, that block is one owner for every group, and expert-parallel consumers make
it lopsided: the workers that need one expert shard are neighbours, so they all land on one owner.
``balance="rotate"`` (what the engine uses) takes ``owners[(w + g * s) % len(owners)]`` for group
g where owners are fewer than workers, s being the workers likely to need the class (a replica
over the class and its disjoint siblings, e.g. the other expert shards), so neighbours spread
over every owner and consecutive groups tile the owners; where
they are at least as many, it lays every worker's groups of the class end to end, weighted by
their bytes, and cuts that line into one equal piece per owner, so uneven blocks (24 owners, 16
workers) and uneven groups (embeddings) stay balanced while a worker still reaches few owners.
Rejected: routing by the bytes each worker needs, which producers cannot know before the plans
arrive (both sides must resolve routes alone from the shared index).

The router is pure data plus, after ``bind``, a thin send side: ``produce_methods[i]`` is a
callable ``(verb, consumer_id, *args)`` that reaches producer i (an actor method, a control
message), so the same routing drives Ray actors and communicator ranks alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

ProduceMethod = Callable[..., Any]

BALANCE_RULES = ("block", "rotate")
"""The routing rules ``RdtRouter(balance=...)`` accepts (see the module docstring)."""
ENGINE_BALANCE = "rotate"
"""The rule the weight-transfer engine (and its dry run) routes by."""


def assign_producer_indices(num_producers: int, num_consumers: int, consumer_idx: int) -> list[int]:
    """The producers consumer ``consumer_idx`` binds, by the block rule.

    With ``P = max(1, num_producers)`` and ``C = max(1, num_consumers)``: the block
    ``range(c*P//C, (c+1)*P//C)`` when ``P >= C``, else the single producer ``[c*P//C]``.
    """
    p = max(1, num_producers)
    c = max(1, num_consumers)
    if p >= c:
        return list(range(consumer_idx * p // c, (consumer_idx + 1) * p // c))
    return [consumer_idx * p // c]


class RdtRouter:
    """Routes every name to one producer per consumer.

    Args:
        num_producers: producers in the fleet.
        num_consumers: consumers in the fleet (every replica's workers).
        owner_sets: the distinct producer sets that own names (deduplicated and sorted here);
            None = one class owning every producer.
        name_owner_class: ``name_owner_class[i]`` is the owner class of ``names[i]``; a missing
            entry (or None) is class 0.
        names: the model's names, in gather order.
        group_lens: cuts ``names`` into consecutive gather groups.
        workers_per_replica: consumers per inference replica (0 = the whole fleet is one replica).
        balance: ``"block"`` (DESIGN's rule) or ``"rotate"`` (balanced); see the module
            docstring.
        name_bytes: ``name_bytes[i]`` is the size of ``names[i]``; the rotating rule weighs
            groups by it where owners are at least as many as workers (missing = 1 per name).

    Raises:
        ValueError: ``workers_per_replica`` does not divide ``num_consumers`` (or exceeds it),
            ``group_lens`` does not cut ``names``, or ``balance`` is not a known rule.
    """

    def __init__(
        self,
        num_producers: int,
        num_consumers: int,
        owner_sets: Sequence[Sequence[int]] | None = None,
        name_owner_class: Sequence[int] | None = None,
        names: Sequence[str] | None = None,
        group_lens: Sequence[int] | None = None,
        workers_per_replica: int = 0,
        *,
        balance: str = "block",
        name_bytes: Sequence[int] | None = None,
    ) -> None:
        if balance not in BALANCE_RULES:
            raise ValueError(f"balance={balance!r}: use one of {', '.join(BALANCE_RULES)}")
        self.balance = balance
        self._bytes = list(name_bytes or [])
        self._line: dict[int, dict[int, tuple[int, int]]] | None = None
        self._strides: dict[int, int] | None = None
        if num_producers < 0 or num_consumers < 0:
            raise ValueError(f"negative fleet size: {num_producers} producers, {num_consumers}")
        self.num_producers = num_producers
        self.num_consumers = num_consumers
        block = workers_per_replica or num_consumers
        if (
            workers_per_replica < 0
            or block > max(1, num_consumers)
            or (num_consumers and num_consumers % block)
        ):
            raise ValueError(
                f"workers_per_replica={workers_per_replica} must divide num_consumers="
                f"{num_consumers} (0 = one replica of every consumer)"
            )
        self.workers_per_replica = max(1, block)
        if owner_sets is None:
            owner_sets = [range(num_producers)]
        self.owner_sets = [sorted(set(s)) for s in owner_sets]
        self.names = list(names or [])
        classes = list(name_owner_class or [])
        self._class = {n: (classes[i] if i < len(classes) else 0) for i, n in enumerate(self.names)}
        self._group: dict[str, int] = {}
        self.group_names: list[list[str]] = []
        if group_lens is not None:
            if any(n < 0 for n in group_lens) or sum(group_lens) != len(self.names):
                raise ValueError(
                    f"group_lens {list(group_lens)[:8]} (sum {sum(group_lens)}) must cut the "
                    f"{len(self.names)} names into consecutive groups"
                )
            start = 0
            for g, n in enumerate(group_lens):
                self.group_names.append(self.names[start : start + n])
                self._group.update((name, g) for name in self.names[start : start + n])
                start += n
        self._routes: dict[tuple[int, int, int], int] = {}
        self._consumer_id: int | None = None
        self._actors: list[Any] = []
        self._produce: list[ProduceMethod] = []

    # -- tables --------------------------------------------------------------------------------
    def validate(self) -> None:
        """Check that every name can be served.

        Raises:
            ValueError: an empty or out-of-range owner set, or a class index that resolves to
                no owner set.
        """
        for k in range(len(self.owner_sets)):
            self._check_owner_set(k)
        for name, k in self._class.items():
            if not isinstance(k, int) or not 0 <= k < len(self.owner_sets):
                raise ValueError(
                    f"name {name!r} has owner class {k!r}, but only classes "
                    f"0..{len(self.owner_sets) - 1} exist"
                )

    def _check_owner_set(self, k: int) -> list[int]:
        """Owner set ``k``, or the ``ValueError`` of ``validate`` when it cannot serve."""
        owners = self.owner_sets[k]
        if not owners:
            raise ValueError(f"owner set {k} is empty; every owner class needs a producer")
        bad = [p for p in owners if not 0 <= p < self.num_producers]
        if bad:
            raise ValueError(
                f"owner set {k} has producers {bad} outside 0..{self.num_producers - 1}"
            )
        return owners

    def class_of(self, name: str) -> int:
        """The owner class of ``name`` (0 for a name the router was not given)."""
        return self._class.get(name, 0)

    def owners(self, name: str) -> list[int]:
        """The producers that own ``name``."""
        k = self.class_of(name)
        if not 0 <= k < len(self.owner_sets):
            raise ValueError(f"name {name!r}: owner class {k} does not exist; call validate()")
        return self.owner_sets[k]

    def group_of(self, name: str) -> int:
        """The gather group of ``name`` (0 when it has none)."""
        return self._group.get(name, 0)

    def group_owners(self, g: int) -> list[int]:
        """Every producer owning a name of group ``g``; every producer when there are no groups."""
        if not self.group_names:
            return list(range(self.num_producers))
        if not 0 <= g < len(self.group_names):
            raise ValueError(f"group {g} is outside 0..{len(self.group_names) - 1}")
        found: set[int] = set()
        for k in {self.class_of(n) for n in self.group_names[g]}:
            found.update(self.owner_sets[k])
        return sorted(found)

    def producer_for(self, consumer_id: int, name: str) -> int:
        """The producer that serves ``name`` to consumer ``consumer_id``."""
        return self.producer_for_group(
            consumer_id, self._group.get(name, 0), self._class.get(name, 0), name
        )

    def producer_for_group(
        self, consumer_id: int, group: int, owner_class: int, name: str = "?"
    ) -> int:
        """The producer that serves consumer ``consumer_id`` the names of ``owner_class`` in
        gather group ``group`` (what ``producer_for`` resolves a name to)."""
        b = self.workers_per_replica
        key = (consumer_id % b, owner_class, group)
        p = self._routes.get(key)  # depends on (worker, class, group) only: memoised
        if p is None:
            if not 0 <= owner_class < len(self.owner_sets):
                raise ValueError(
                    f"name {name!r}: owner class {owner_class} does not exist; call validate()"
                )
            owners = self._check_owner_set(owner_class)
            if self.balance == "rotate" and len(owners) < b:
                p = owners[(key[0] + group * self._stride(owner_class)) % len(owners)]
            elif self.balance == "rotate":
                p = owners[self._cut(key[0], owner_class, group, len(owners))]
            else:
                block = assign_producer_indices(len(owners), b, key[0])
                p = owners[block[group % len(block)]]
            self._routes[key] = p
        return p

    def _stride(self, owner_class: int) -> int:
        """How far the rotation turns per group: the workers likely to need the class (a
        replica's workers over the class and its disjoint siblings of as many owners, e.g. the
        other expert shards), so consecutive groups tile the owners instead of overlapping."""
        if self._strides is None:
            groups_of: dict[int, set[int]] = {}
            classes_in: dict[int, set[int]] = {}
            for name, k in self._class.items():
                g = self._group.get(name, 0)
                groups_of.setdefault(k, set()).add(g)
                classes_in.setdefault(g, set()).add(k)
            self._strides = {}
            for k, groups in groups_of.items():
                mine = set(self.owner_sets[k])
                near = {j for g in groups for j in classes_in[g]}
                siblings = sum(
                    1
                    for j in near
                    if len(self.owner_sets[j]) == len(mine)
                    and (j == k or not mine.intersection(self.owner_sets[j]))
                )
                self._strides[k] = max(1, self.workers_per_replica // siblings)
        return self._strides.get(owner_class, 1)

    def _cut(self, worker: int, owner_class: int, group: int, n: int) -> int:
        """The owner index of (worker, group) when the class's groups of every worker, laid
        end to end in bytes, are cut into ``n`` equal pieces: each owner serves an equal share,
        and a worker reaches only the few owners its stretch of the line crosses."""
        if self._line is None:
            self._line = self._class_lines()
        mid2, total = self._line[owner_class].get(group, (0, 1))
        b = self.workers_per_replica
        return min(n - 1, (worker * 2 * total + mid2) * n // (b * 2 * total))

    def _class_lines(self) -> dict[int, dict[int, tuple[int, int]]]:
        """Per class, per group: twice the midpoint of the group's bytes on the class's line
        (groups in order), and the line's length. Missing bytes count as 1 per name."""
        sizes: dict[int, dict[int, int]] = {}
        for i, name in enumerate(self.names):
            k, g = self._class[name], self._group.get(name, 0)
            nbytes = self._bytes[i] if i < len(self._bytes) else 1
            per_group = sizes.setdefault(k, {})
            per_group[g] = per_group.get(g, 0) + max(1, nbytes)
        lines: dict[int, dict[int, tuple[int, int]]] = {}
        for k, per_group in sizes.items():
            total, start, line = sum(per_group.values()), 0, {}
            for g in sorted(per_group):
                line[g] = (2 * start + per_group[g], total)
                start += per_group[g]
            lines[k] = line
        return lines

    def fingerprint(self) -> tuple[Any, ...]:
        """What two deployments must agree on for their routes to agree."""
        common = (
            self.num_producers,
            self.num_consumers,
            self.workers_per_replica,
            tuple(tuple(s) for s in self.owner_sets),
        )
        return common if self.balance == "block" else (*common, self.balance)

    # -- send side -----------------------------------------------------------------------------
    def bind(
        self, actors: Sequence[Any], produce_methods: Sequence[ProduceMethod], consumer_id: int
    ) -> None:
        """Attach the handles of the producers (index = producer id) for consumer ``consumer_id``.

        Raises:
            ValueError: the lists differ in length or ``consumer_id`` is out of range.
        """
        if len(actors) != len(produce_methods):
            raise ValueError(
                f"bind() got {len(actors)} actors but {len(produce_methods)} produce methods; "
                "pass one of each per producer"
            )
        if not 0 <= consumer_id < max(1, self.num_consumers):
            raise ValueError(f"consumer_id {consumer_id} is outside 0..{self.num_consumers - 1}")
        self._actors = list(actors)
        self._produce = list(produce_methods)
        self._consumer_id = consumer_id

    @property
    def actors(self) -> list[Any]:
        return list(self._actors)

    def pull(self, owner: int, keys: Any, seq: int) -> Any:
        """Ask producer ``owner`` to pack ``keys`` into serve slot ``seq % K``; its reply."""
        return self._send(owner, "pull", keys, seq)

    def free_group(self, g: int) -> list[Any]:
        """Tell every owner of group ``g`` that this consumer is done with it."""
        return [self._send(p, "free", g) for p in self.group_owners(g)]

    def reserve_serve_buffers(
        self,
        bytes_by_producer: Mapping[int, int],
        plan_digests: Mapping[int, str] | None = None,
    ) -> list[Any]:
        """Ask each producer to reserve ``bytes`` of serve buffer, checking its plan digest."""
        digests = plan_digests or {}
        return [
            self._send(p, "reserve", nbytes, digests.get(p))
            for p, nbytes in sorted(bytes_by_producer.items())
        ]

    def _send(self, producer: int, verb: str, *args: Any) -> Any:
        if self._consumer_id is None:
            raise RuntimeError(f"RdtRouter.{verb}: call bind(actors, produce_methods, ...) first")
        if not 0 <= producer < len(self._produce):
            raise ValueError(f"producer {producer} is not bound (bound: {len(self._produce)})")
        return self._produce[producer](verb, self._consumer_id, *args)
