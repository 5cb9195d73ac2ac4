"""Every message that crosses a process boundary in a weight transfer, as typed dataclasses.

Two channels. The data plane's notifications (``notify`` / ``wait_notification``) carry bytes:
``Ready`` (announcements), ``Done``, ``Alive`` and ``Replay``, each encoded here with ``struct``
behind a versioned header and checked when decoded (``MessageError`` names what was wrong).
The coordinator's object channel carries ``ProducerFacts``, ``PlanMessage``, ``ReserveMessage``
and ``AdmitMessage`` at set-up; ``ProducerFacts`` pickles to an explicit compact form (one
producer ships the model's metadata, the others its digest and what they hold). An announcement of a source the consumer has not heard of carries
that source's exposure descriptor as opaque bytes (``ExposedDescriptor.to_bytes``, read back by
the communicator's ``decode_exposed``), so it arrives with the message that names it. Rejected:
pickling announcements into notifications (a peer's bytes must never reach ``pickle.loads``),
and sending descriptors beside them through the coordinator (a thread per pair and a second
channel to wait on).
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_dist.tasks.weight_transfer.source import WeightMeta

VERSION = 2
"""The wire version; a message of another version is refused."""
_MAGIC = b"WT"
_HEADER = struct.Struct("<2sBB")  # magic, version, kind
_READY, _DONE, _ALIVE, _REPLAY = 1, 2, 3, 4
_KIND_NAMES = {_READY: "ready", _DONE: "done", _ALIVE: "alive", _REPLAY: "replay"}
_SYNC = struct.Struct("<q")
_SYNC_SEQ = struct.Struct("<qq")
_COUNT = struct.Struct("<I")
_ENTRY = struct.Struct("<qqqqBBH")  # sync, seq, offset, nbytes, flags, strides kind, len(source)
_SPREAD_ITEM = struct.Struct("<qB")  # byte offset, number of strides
_BLOB = struct.Struct("<I")
_DESCRIPTOR = struct.Struct("<I")  # length of the descriptor bytes that follow the source name
_HAS_SOURCE, _NEW_SOURCE = 1, 2
_NO_STRIDES, _FLAT, _PER_ITEM = 0, 1, 2
_MEMO = 1 << 16  # encodings a codec remembers
MAX_DESCRIPTOR = 1 << 24
"""The largest exposure descriptor a 'ready' message may carry, in bytes."""

SPREAD = -1
"""The offset of an announced chunk whose items are read in place one by one."""


class MessageError(RuntimeError):
    """Bytes that are not the message expected: wrong magic, version, kind or length."""


@dataclass(slots=True)
class Announcement:
    """Chunk ``seq`` of sync ``sync`` is ready: ``nbytes`` at byte ``offset`` of the pair's
    ring (``source`` None) or of the exposed buffer ``source``.

    ``strides``: None for packed bytes; the element strides of the producer's view for a
    one-item chunk read in place; ``((byte offset, strides), ...)`` per item when ``offset`` is
    ``SPREAD``. ``descriptor``: the exposure descriptor of ``source`` as bytes, carried only
    the first time this consumer hears of ``source`` (import it before reading), else None.
    """

    sync: int
    seq: int
    offset: int
    nbytes: int
    source: str | None = None
    strides: Any = None
    descriptor: bytes | None = None


@dataclass(frozen=True, slots=True)
class Done:
    """Consumer -> producer: every chunk of the pair up to ``seq`` of sync ``sync`` is read."""

    sync: int
    seq: int


@dataclass(frozen=True, slots=True)
class Alive:
    """Consumer -> producer: still in sync ``sync``, reading other producers first."""

    sync: int


@dataclass(frozen=True, slots=True)
class Replay:
    """Producer -> consumer: sync ``sync`` is ready, every chunk where the last sync had it."""

    sync: int


@dataclass(slots=True)
class Ready:
    """Producer -> consumer: several chunks of one pair are ready, in seq order."""

    announcements: list[Announcement]


DIGEST_BYTES = 32
"""The length of a ``metadata_digest``."""
MAX_HELD_BYTES = 1 << 30
"""The most bytes a producer's held names may decode to."""
_HELD = struct.Struct("<IIII")  # names, bytes of the joined names, bytes of the dtype table, dims


@dataclass(frozen=True, kw_only=True, slots=True)
class ProducerFacts:
    """What one producer tells the fleet at set-up: the model's metadata and what it holds.

    Pickled (``all_gather_object``), only facts with ``ships_metadata`` carry the metadata; the
    others carry its digest and their held names with dtypes and shapes, compressed, so each
    rank receives one copy of the model and P lists of held names, not P copies of the model.
    Rejected: shipping held names as positions in the metadata, which breaks when a producer
    describes only the part of the model it holds.
    """

    metadata: tuple[WeightMeta, ...] | None
    """The model's weights in model order; None in facts that arrived without it."""
    held: frozenset[str] | None
    """The names this producer serves; None = every name (see ``held_blob`` when
    ``metadata`` is None)."""
    ships_metadata: bool = True
    """Whether the pickled facts carry ``metadata``; one producer (0) of a fleet is enough."""
    digest: bytes = b""
    """``metadata_digest`` of the producer's metadata, in facts that arrived without it."""
    held_blob: bytes | None = None
    """``encode_held`` of the held weights, in facts that arrived without metadata; None =
    every weight of the model."""

    def __post_init__(self) -> None:
        if self.metadata is None and (len(self.digest) != DIGEST_BYTES or self.held is not None):
            raise MessageError(
                f"producer facts without metadata need a {DIGEST_BYTES}-byte digest and their "
                f"held names in held_blob (got a {len(self.digest)}-byte digest, held="
                f"{None if self.held is None else len(self.held)})"
            )

    def __reduce__(self) -> tuple[Any, ...]:
        m = self.metadata
        if m is None:
            return (_facts_from_wire, (self.digest, self.held_blob))
        if not self.ships_metadata:
            held = None if self.held is None else [w for w in m if w.name in self.held]
            blob = None if held is None else encode_held(held)
            return (_facts_from_wire, (metadata_digest(m), blob))
        # by columns: pickling 100,000 slotted dataclasses one by one takes seconds
        columns = ([w.name for w in m], [w.dtype for w in m], [w.shape for w in m])
        held_names = None if self.held is None else sorted(self.held)
        return (_facts_from_columns, (*columns, held_names))


def _facts_from_columns(
    names: list[str], dtypes: list[str], shapes: list[tuple[int, ...]], held: Any
) -> ProducerFacts:
    interned: dict[str, str] = {}
    metadata = tuple(
        WeightMeta(name=n, dtype=interned.setdefault(d, d), shape=tuple(s))
        for n, d, s in zip(names, dtypes, shapes, strict=True)
    )
    return ProducerFacts(metadata=metadata, held=None if held is None else frozenset(held))


def _facts_from_wire(digest: Any, blob: Any) -> ProducerFacts:
    if not isinstance(digest, bytes) or not (blob is None or isinstance(blob, bytes)):
        raise MessageError(
            f"producer facts: digest and held names must be bytes, got {type(digest).__name__} "
            f"and {type(blob).__name__}"
        )
    return ProducerFacts(
        metadata=None, held=None, ships_metadata=False, digest=digest, held_blob=blob
    )


def metadata_digest(metas: Sequence[WeightMeta]) -> bytes:
    """A digest of the names, dtypes and shapes of ``metas``, in order."""
    h = hashlib.sha256()
    h.update("\0".join(m.name for m in metas).encode())
    h.update(b"\1")
    h.update("\0".join(m.dtype for m in metas).encode())
    h.update(repr([m.shape for m in metas]).encode())
    return h.digest()


def encode_held(metas: Sequence[WeightMeta]) -> bytes:
    """The weights ``metas`` as compressed columns: joined names, a dtype table, shapes."""
    table: dict[str, int] = {}
    dtype_ids = bytes(table.setdefault(m.dtype, len(table)) for m in metas)
    ndims = bytes(len(m.shape) for m in metas)
    dims = np.fromiter((d for m in metas for d in m.shape), dtype="<i8")
    names = "\0".join(m.name for m in metas).encode()
    dtypes = "\0".join(table).encode()
    head = _HELD.pack(len(metas), len(names), len(dtypes), len(dims))
    return zlib.compress(b"".join((head, names, dtypes, dtype_ids, ndims, dims.tobytes())), 1)


def decode_held(blob: bytes, what: str) -> list[WeightMeta]:
    """The weights ``encode_held`` wrote; ``MessageError`` for anything else."""
    return [
        WeightMeta(name=n, dtype=d, shape=s)
        for n, d, s in zip(*decode_held_columns(blob, what), strict=True)
    ]


def decode_held_columns(
    blob: bytes, what: str
) -> tuple[list[str], list[str], list[tuple[int, ...]]]:
    """``decode_held`` as (names, dtypes, shapes) columns, without a ``WeightMeta`` each."""
    try:
        inflate = zlib.decompressobj()
        raw = inflate.decompress(blob, MAX_HELD_BYTES)
        if inflate.unconsumed_tail or not inflate.eof:
            raise MessageError(
                f"{what}: malformed held names (cut short, or over {MAX_HELD_BYTES} bytes)"
            )
        count, nnames, ndtypes, ndims_total = _HELD.unpack_from(raw)
        pos = _HELD.size
        names = raw[pos : pos + nnames].decode().split("\0") if count else []
        pos += nnames
        dtypes = raw[pos : pos + ndtypes].decode().split("\0")
        pos += ndtypes
        dtype_ids, ndims = raw[pos : pos + count], raw[pos + count : pos + 2 * count]
        pos += 2 * count
        dims = np.frombuffer(raw, dtype="<i8", count=ndims_total, offset=pos).tolist()
        pos += 8 * ndims_total
    except (zlib.error, struct.error, UnicodeDecodeError, ValueError) as exc:
        raise MessageError(f"{what}: malformed held names ({exc})") from None
    if (
        pos != len(raw)
        or len(names) != count
        or len(ndims) != count
        or sum(ndims) != ndims_total
        or any(i >= len(dtypes) for i in dtype_ids)
        or any(d < 0 for d in dims)
    ):
        raise MessageError(f"{what}: malformed held names (counts and lengths disagree)")
    shapes, start = [], 0
    for nd in ndims:
        shapes.append(tuple(dims[start : start + nd]))
        start += nd
    return names, [dtypes[k] for k in dtype_ids], shapes


@dataclass(frozen=True, slots=True)
class PlanMessage:
    """Consumer -> producer at set-up (coordinator): the requests routed to that producer.

    ``requests`` is ``encode_requests``'s payload, or a string when the consumer failed or
    deferred its set-up; ``path`` the consumer's data path; ``strided`` / ``maps`` whether it
    reads strided views, and on a mapping of the producer's memory."""

    consumer_id: int
    requests: Any
    path: str
    strided: bool
    maps: bool


@dataclass(frozen=True, slots=True)
class ReserveMessage:
    """Consumer -> producer at set-up (coordinator): ring bytes reserved and the plan digest."""

    consumer_id: int
    nbytes: int
    digest: str | None


@dataclass(frozen=True, slots=True)
class AdmitMessage:
    """Producer -> joining consumer (coordinator): the sync count and, from producer 0, the
    producers' facts."""

    producer_id: int
    syncs: int
    facts: list[ProducerFacts] | None


def _header(kind: int) -> bytes:
    return _HEADER.pack(_MAGIC, VERSION, kind)


def _kind(msg: bytes, what: str) -> int:
    """The kind of ``msg`` after checking its header."""
    if len(msg) < _HEADER.size:
        raise MessageError(f"{what}: a message of {len(msg)} bytes is shorter than its header")
    magic, version, kind = _HEADER.unpack_from(msg)
    if magic != _MAGIC:
        raise MessageError(f"{what}: not a weight-transfer message (starts {msg[:8]!r})")
    if version != VERSION:
        raise MessageError(
            f"{what}: message version {version}, this side speaks {VERSION}: deploy both sides "
            "from the same vllm_dist version"
        )
    if kind not in _KIND_NAMES:
        raise MessageError(f"{what}: unknown message kind {kind}")
    return int(kind)


def _fixed(msg: bytes, body: struct.Struct, kind: int, what: str) -> tuple[Any, ...]:
    if len(msg) != _HEADER.size + body.size:
        raise MessageError(
            f"{what}: a {_KIND_NAMES[kind]!r} message of {len(msg)} bytes, expected "
            f"{_HEADER.size + body.size}"
        )
    return body.unpack_from(msg, _HEADER.size)


def encode_done(sync: int, seq: int) -> bytes:
    return _header(_DONE) + _SYNC_SEQ.pack(sync, seq)


def encode_alive(sync: int) -> bytes:
    return _header(_ALIVE) + _SYNC.pack(sync)


def encode_replay(sync: int) -> bytes:
    return _header(_REPLAY) + _SYNC.pack(sync)


def decode_consumer_message(msg: bytes, what: str) -> Done | Alive:
    """A message a consumer sends its producer during a sync."""
    kind = _kind(msg, what)
    if kind == _DONE:
        sync, seq = _fixed(msg, _SYNC_SEQ, kind, what)
        return Done(sync, seq)
    if kind == _ALIVE:
        return Alive(_fixed(msg, _SYNC, kind, what)[0])
    raise MessageError(f"{what}: expected 'done' or 'alive', got a {_KIND_NAMES[kind]!r} message")


class ReadyCodec:
    """Encodes and decodes ``Ready`` messages; one per engine.

    The per-item strides of a ``SPREAD`` chunk are the bulk of a message and the same every
    sync: the producer encodes each strides object once (by identity) and the consumer decodes
    each distinct encoding once, so a steady sync costs a dictionary hit per chunk.
    """

    def __init__(self) -> None:
        self._encoded: dict[int, tuple[Any, bytes]] = {}
        self._decoded: dict[bytes, Any] = {}
        # names and flat strides repeat every sync: each is encoded / decoded once
        self._names: dict[str, bytes] = {}
        self._flat: dict[tuple[int, ...], bytes] = {}
        self._source_of: dict[bytes, str] = {}
        self._strides_of: dict[bytes, tuple[int, ...]] = {}

    def encode(self, announcements: list[Announcement]) -> bytes:
        parts = [_header(_READY), _COUNT.pack(len(announcements))]
        append, entry, names = parts.append, _ENTRY.pack, self._names
        for a in announcements:
            src, desc, strides = a.source, a.descriptor, a.strides
            source, flags = b"", 0
            if src is not None:
                known = names.get(src)
                if known is None and len(names) >= _MEMO:
                    names.clear()
                source = names[src] = src.encode() if known is None else known
                flags = _HAS_SOURCE
            if strides is None:
                kind, tail = _NO_STRIDES, b""
            elif a.offset == SPREAD:
                kind, tail = _PER_ITEM, self._per_item(strides)
            else:
                kind, tail = _FLAT, self._flat_bytes(strides)
            if desc is not None:
                flags |= _NEW_SOURCE
            append(entry(a.sync, a.seq, a.offset, a.nbytes, flags, kind, len(source)))
            append(source)
            if desc is not None:  # first sight of ``source`` only: steady messages stay as they are
                if src is None or not 0 < len(desc) <= MAX_DESCRIPTOR:
                    raise ValueError(
                        f"a descriptor of {len(desc)} bytes for source {src!r}: one of 1 to "
                        f"{MAX_DESCRIPTOR} bytes, for a named source, may be announced"
                    )
                append(_DESCRIPTOR.pack(len(desc)))
                append(desc)
            append(tail)
        return b"".join(parts)

    def _flat_bytes(self, strides: tuple[int, ...]) -> bytes:
        tail = self._flat.get(strides)
        if tail is None:
            if len(self._flat) >= _MEMO:
                self._flat.clear()
            tail = bytes((len(strides),)) + struct.pack(f"<{len(strides)}q", *strides)
            self._flat[tuple(strides)] = tail
        return tail

    def _per_item(self, strides: Any) -> bytes:
        hit = self._encoded.get(id(strides))
        if hit is not None and hit[0] is strides:
            return hit[1]
        body = b"".join(
            _SPREAD_ITEM.pack(off, len(st)) + struct.pack(f"<{len(st)}q", *st)
            for off, st in strides
        )
        blob = _BLOB.pack(len(body)) + body
        if len(self._encoded) >= _MEMO:
            self._encoded.clear()  # sources moved many times: start over
        self._encoded[id(strides)] = (strides, blob)  # keeps ``strides`` alive: ids stay unique
        return blob

    def decode(self, msg: bytes, what: str) -> Ready | Replay:
        """A message a producer sends its consumer during a sync."""
        kind = _kind(msg, what)
        if kind == _REPLAY:
            return Replay(_fixed(msg, _SYNC, kind, what)[0])
        if kind != _READY:
            raise MessageError(
                f"{what}: expected 'ready' or 'replay', got a {_KIND_NAMES[kind]!r} message"
            )
        try:
            return Ready(self._announcements(msg, what))
        except (struct.error, UnicodeDecodeError, IndexError) as exc:
            raise MessageError(f"{what}: a malformed 'ready' message ({exc})") from None

    def _announcements(self, msg: bytes, what: str) -> list[Announcement]:
        pos = _HEADER.size
        (count,) = _COUNT.unpack_from(msg, pos)
        pos += _COUNT.size
        out: list[Announcement] = []
        unpack, size = _ENTRY.unpack_from, _ENTRY.size
        for _ in range(count):
            sync, seq, offset, nbytes, flags, kind, n = unpack(msg, pos)
            pos += size
            source = self._source(msg[pos : pos + n]) if flags & _HAS_SOURCE else None
            pos += n
            desc = self._descriptor(msg, pos, flags, what) if flags & _NEW_SOURCE else None
            if desc is not None:
                pos += _DESCRIPTOR.size + len(desc)
            strides: Any = None
            if kind == _FLAT:
                end = pos + 1 + 8 * msg[pos]
                strides = self._flat_strides(msg[pos:end])
                pos = end
            elif kind == _PER_ITEM:
                (nblob,) = _BLOB.unpack_from(msg, pos)
                blob = msg[pos + _BLOB.size : pos + _BLOB.size + nblob]
                if len(blob) != nblob:
                    raise MessageError(f"{what}: a 'ready' message cut short")
                strides = self._items(blob)
                pos += _BLOB.size + nblob
            elif kind != _NO_STRIDES:
                raise MessageError(f"{what}: unknown strides kind {kind}")
            out.append(Announcement(sync, seq, offset, nbytes, source, strides, desc))
        if pos != len(msg):
            raise MessageError(f"{what}: {len(msg) - pos} stray bytes after a 'ready' message")
        return out

    def _source(self, raw: bytes) -> str:
        source = self._source_of.get(raw)
        if source is None:
            if len(self._source_of) >= _MEMO:
                self._source_of.clear()
            source = self._source_of[raw] = raw.decode()
        return source

    def _flat_strides(self, raw: bytes) -> tuple[int, ...]:
        strides = self._strides_of.get(raw)
        if strides is None:
            ndim = raw[0]
            strides = struct.unpack_from(f"<{ndim}q", raw, 1)  # struct.error when cut short
            if len(self._strides_of) >= _MEMO:
                self._strides_of.clear()
            self._strides_of[raw] = strides
        return strides

    @staticmethod
    def _descriptor(msg: bytes, pos: int, flags: int, what: str) -> bytes:
        """The length-prefixed descriptor bytes at ``pos``, their length checked."""
        if not flags & _HAS_SOURCE:
            raise MessageError(f"{what}: a descriptor announced without a source name")
        (size,) = _DESCRIPTOR.unpack_from(msg, pos)
        if not 0 < size <= MAX_DESCRIPTOR:
            raise MessageError(
                f"{what}: a descriptor of {size} bytes, expected 1 to {MAX_DESCRIPTOR}"
            )
        start = pos + _DESCRIPTOR.size
        desc = msg[start : start + size]
        if len(desc) != size:
            raise MessageError(f"{what}: a 'ready' message cut short in a descriptor")
        return desc

    def _items(self, blob: bytes) -> Any:
        hit = self._decoded.get(blob)
        if hit is None:
            items, pos = [], 0
            while pos < len(blob):
                off, ndim = _SPREAD_ITEM.unpack_from(blob, pos)
                pos += _SPREAD_ITEM.size
                items.append((off, struct.unpack_from(f"<{ndim}q", blob, pos)))
                pos += 8 * ndim
            if len(self._decoded) >= _MEMO:
                self._decoded.clear()
            hit = self._decoded[blob] = tuple(items)
        return hit
