"""The transfer plan: which bytes travel from which producer to which consumer, and where.

A consumer's baked copies become *items* (a weight name, the op chain a producer replays on it,
the shape and dtype of the result). Items are cut into *chunks* per gather group and owner class
(all served by one producer, see ``RdtRouter``), split further when a chunk would exceed
``max_chunk_bytes``. Each chunk has a byte-exact pack layout: items at offsets aligned to
``align`` bytes, so a producer packs with ``copy_`` into views of one buffer and a consumer
unpacks from views of the same layout. Chunk ``seq`` counts the chunks of one
(producer, consumer) pair in issue order; it picks the serve-ring slot ``seq % K``. An item of
at least ``direct_bytes`` is a chunk of its own: its wire bytes are exactly the item's, so either
side may skip the pack or unpack copy where its view is contiguous (both still agree on bytes).

Producer and consumer build the plan independently from the same inputs and compare a digest
per pair at set-up: two deployments that disagree (router tables, layout settings, model) fail
there instead of stalling or corrupting weights mid-sync.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_dist.tasks.weight_transfer.ops import OpChain
from vllm_dist.tasks.weight_transfer.router import RdtRouter
from vllm_dist.tasks.weight_transfer.source import dtype_from_str

BUFFER_GRANULE = 256 << 20


def buffer_alloc_bytes(nbytes: int, presize: int = 0) -> int:
    """Bytes to allocate for a serve buffer of ``nbytes``.

    ``max(nbytes, presize, nbytes rounded up to a multiple of 256 MiB)``. Buffers are allocated
    once and never regrow: regrowing under an in-flight read would hand the reader freed memory.
    """
    rounded = -(-nbytes // BUFFER_GRANULE) * BUFFER_GRANULE
    return max(nbytes, presize, rounded)


class PlanMismatchError(RuntimeError):
    """A producer and a consumer derived different plans: their deployments differ."""


@dataclass(frozen=True, slots=True)
class Request:
    """One piece of one weight a consumer needs: ``replay(weight, chain)`` of ``shape``.

    On the wire it travels as ``replay(weight, prefix)`` of ``wire_shape`` (see
    ``ops.split_for_wire``); the consumer applies the re-layout suffix when unpacking.
    """

    name: str
    chain: OpChain
    shape: tuple[int, ...]
    dtype: str
    wire_shape: tuple[int, ...] | None = None  # shape after the packed prefix of ``chain``

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_from_str(self.dtype).itemsize


@dataclass(frozen=True, slots=True)
class Chunk:
    """Items packed together into one serve slot, all from ``producer``.

    ``index`` is the position in the consumer's plan; ``seq`` the position among this
    (producer, consumer) pair's chunks; ``items`` index the consumer's request list.
    """

    producer: int
    group: int
    owner_class: int
    index: int
    seq: int
    nbytes: int
    items: tuple[int, ...]
    offsets: tuple[int, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class LayoutConfig:
    """The settings that shape a plan; producers and consumers must agree on them."""

    align: int = 256
    max_chunk_bytes: int = 256 << 20
    ring_slots: int = 2
    direct_bytes: int = 1 << 20

    def __post_init__(self) -> None:
        if self.align < 16 or self.align & (self.align - 1):
            raise ValueError(f"align must be a power of two >= 16, got {self.align}")
        if self.max_chunk_bytes < self.align:
            raise ValueError(f"max_chunk_bytes {self.max_chunk_bytes} is below align")
        if self.ring_slots < 1:
            raise ValueError(f"ring_slots must be >= 1, got {self.ring_slots}")
        if self.direct_bytes < 1:
            raise ValueError(f"direct_bytes must be >= 1, got {self.direct_bytes}")


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def build_chunks(
    consumer_id: int,
    requests: Sequence[Request],
    router: RdtRouter,
    layout: LayoutConfig,
    producer: int | None = None,
) -> list[Chunk]:
    """Cut ``requests`` into chunks in issue order (group, owner class, size split), items of
    one kind (``request_kinds``) side by side within a group and owner class.

    With ``producer`` given, only that producer's chunks are built (``index`` then counts that
    producer's chunks only).
    """
    names = [r.name for r in requests]
    return cut_chunks(
        [router.group_of(n) for n in names],
        [router.class_of(n) for n in names],
        [router.producer_for(consumer_id, n) for n in names],
        item_sizes(requests),
        layout,
        producer,
        kinds=request_kinds(requests),
    )


def request_kinds(requests: Sequence[Request]) -> list[int]:
    """Each request's kind (``KindTable``: loader chain, shapes, dtype), numbered in first-seen
    order. A plan that lays like items side by side turns the packs and unpacks of, say,
    100,000 expert shards into one block of rows each per kind (``RowGather``: one kernel, no
    staging) instead of rows interleaved with other kinds' items."""
    table = KindTable()
    return [table.add(r) for r in requests]


def cut_chunks(
    groups: Sequence[int] | np.ndarray,
    classes: Sequence[int] | np.ndarray,
    producers: Sequence[int] | np.ndarray,
    sizes: Sequence[int] | np.ndarray,
    layout: LayoutConfig,
    producer: int | None = None,
    *,
    kinds: Sequence[int] | np.ndarray | None = None,
) -> list[Chunk]:
    """``build_chunks`` on per-item arrays (group, owner class, producer, bytes), items of one
    kind side by side where ``kinds`` are given, else in the order given. A producer re-cuts
    the items a consumer sent in the consumer's order (without ``kinds``)."""
    g, k, p = (np.asarray(a, dtype=np.int64).reshape(-1) for a in (groups, classes, producers))
    items = np.arange(len(g))
    if producer is not None:
        items = items[p == producer]
    kd = np.zeros_like(g) if kinds is None else np.asarray(kinds, dtype=np.int64).reshape(-1)
    order = items[np.lexsort((items, kd[items], k[items], g[items]))].tolist()
    glist, klist, plist = g.tolist(), k.tolist(), p.tolist()
    nlist = np.asarray(sizes, dtype=np.int64).reshape(-1).tolist()
    chunks: list[Chunk] = []
    seqs: dict[int, int] = {}
    cur: list[int] = []
    offs: list[int] = []
    size = 0
    key: tuple[int, int, int] | None = None
    align, limit, alone_at = layout.align, layout.max_chunk_bytes, layout.direct_bytes

    def flush() -> None:
        if cur and key is not None:
            seq = seqs.get(key[2], 0)
            seqs[key[2]] = seq + 1
            chunks.append(
                Chunk(key[2], key[0], key[1], len(chunks), seq, size, tuple(cur), tuple(offs))
            )

    for i in order:
        nbytes = nlist[i]
        start = -(-size // align) * align
        alone = nbytes >= alone_at
        item_key = (glist[i], klist[i], plist[i])
        if item_key != key or (cur and (alone or start + nbytes > limit)):
            flush()
            cur, offs, size = [], [], 0
            key, start = item_key, 0
        cur.append(i)
        offs.append(start)
        size = start + nbytes
        if alone:
            flush()
            cur, offs, size = [], [], 0
    flush()
    return chunks


def item_sizes(requests: Sequence[Request]) -> list[int]:
    """``[r.nbytes for r in requests]``, computed once per distinct (shape, dtype)."""
    memo: dict[tuple[tuple[int, ...], str], int] = {}
    out = []
    for r in requests:
        key = (r.shape, r.dtype)
        n = memo.get(key)
        if n is None:
            n = memo[key] = r.nbytes
        out.append(n)
    return out


def pair_digest(
    consumer_id: int,
    producer: int,
    requests: Sequence[Request],
    chunks: Sequence[Chunk],
    router: RdtRouter,
    layout: LayoutConfig,
) -> str:
    """A digest of what ``producer`` serves ``consumer_id``: routes, layout and items."""
    mine = [requests[i] for c in chunks if c.producer == producer for i in c.items]
    return plan_digest(consumer_id, producer, chunks, encode_requests(mine), router, layout)


def plan_digest(
    consumer_id: int,
    producer: int,
    chunks: Sequence[Chunk],
    encoded: tuple[list[Kind], list[str], bytes],
    router: RdtRouter,
    layout: LayoutConfig,
) -> str:
    """``pair_digest`` from the encoded items of ``producer``'s chunks, in chunk order.

    Hashes flat arrays (chunk headers, offsets, a kind id per item), the names joined and the
    kind table, so 100,000 items cost a few bulk operations.
    """
    kinds, names, ids = encoded
    h = hashlib.sha256()
    h.update(repr((router.fingerprint(), layout, consumer_id, producer)).encode())
    heads = array("q")
    offsets = array("q")
    for c in chunks:
        if c.producer == producer:
            heads.extend((c.seq, c.group, c.owner_class, c.nbytes, len(c.items)))
            offsets.extend(c.offsets)
    for part in (heads.tobytes(), offsets.tobytes(), bytes(ids)):
        h.update(part)
    h.update("\0".join(names).encode())
    h.update(repr(kinds).encode())
    return h.hexdigest()


Kind = tuple[OpChain, tuple[int, ...], str, "tuple[int, ...] | None"]


class KindTable:
    """Distinct (chain, shape, dtype, wire shape) of requests, numbered in first-seen order.

    Requests that baked alike share their chain object, so the key uses its identity (chains
    hold slices, unhashable before Python 3.12); ``kinds`` keeps the chains alive.
    """

    def __init__(self) -> None:
        self.kinds: list[Kind] = []
        self._ids: dict[tuple[int, tuple[int, ...], str, tuple[int, ...] | None], int] = {}

    def add(self, r: Request) -> int:
        key = (id(r.chain), r.shape, r.dtype, r.wire_shape)
        k = self._ids.get(key)
        if k is None:
            k = self._ids[key] = len(self.kinds)
            self.kinds.append((r.chain, r.shape, r.dtype, r.wire_shape))
        return k


def encode_requests(requests: Sequence[Request]) -> tuple[list[Kind], list[str], bytes]:
    """A compact, picklable form of ``requests``: (kind table, names, int32 kind per item)."""
    kinds = KindTable()
    ids = array("i", [kinds.add(r) for r in requests])
    return kinds.kinds, [r.name for r in requests], ids.tobytes()


def decode_requests(payload: object) -> tuple[list[Kind], list[str], np.ndarray]:
    """Check the structure of an ``encode_requests`` payload: (kinds, names, kind id array).

    Raises ``ValueError`` for anything malformed; chains, names and shapes are checked by the
    producer against its own index.
    """
    kinds: Any
    names: Any
    raw: Any
    try:
        kinds, names, raw = payload  # type: ignore[misc]
        ids = np.frombuffer(raw, dtype=np.int32)
        table: list[Kind] = [
            (chain, tuple(int(d) for d in shape), str(dtype), None if w is None else tuple(w))
            for chain, shape, dtype, w in kinds
        ]
    except (TypeError, ValueError) as exc:
        raise ValueError(f"a malformed plan: {type(exc).__name__}: {exc}") from None
    if not isinstance(names, list) or len(names) != len(ids):
        raise ValueError(
            f"a malformed plan: {len(ids)} kind ids for a names list of {type(names).__name__}"
        )
    if len(ids) and not (int(ids.min()) >= 0 and int(ids.max()) < len(table)):
        raise ValueError(f"a malformed plan: kind ids outside 0..{len(table) - 1}")
    return table, names, ids


def slot_bytes(chunks: Sequence[Chunk], producer: int, align: int = 256) -> int:
    """The serve-slot size of one pair: its largest chunk, rounded up to ``align``."""
    return _round_up(max((c.nbytes for c in chunks if c.producer == producer), default=0), align)
