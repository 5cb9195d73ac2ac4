"""Object collectives whose every payload carries an HMAC tag that is checked before unpickling.

The wire shape is torch's own (sizes first, then one padded uint8 payload per rank, over gloo
tensor collectives), so nothing costs an extra round trip. Each payload ends with
HMAC-SHA256(key, header || pickle) where the key derives from the launch secret and the header
binds the group, the operation, the sender's launch rank, the receiver (point-to-point) and a
per-operation counter: a forged, replayed or reordered message fails its check and is never
unpickled. Rejected alternative: authenticating gloo's connections themselves, which torch
offers no hook for.
"""

from __future__ import annotations

import hashlib
import hmac
import pickle
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from vllm_dist.interfaces import AuthenticationError

TAG_BYTES = 32
_KEY_LABEL = b"vllm_dist object collectives v1"


def object_key(secret: bytes) -> bytes:
    """The key that tags object payloads, derived from (never equal to) the launch secret."""
    return hmac.new(secret, _KEY_LABEL, hashlib.sha256).digest()


class SignedObjects:
    """The object collectives of one gloo group, tagged under ``key``.

    Args:
        key: ``object_key(secret)``.
        group: the gloo group.
        global_ranks: the launch ranks of the group's members, by group rank.
        rank: this worker's group rank.
    """

    def __init__(
        self, key: bytes, group: dist.ProcessGroup, global_ranks: Sequence[int], rank: int
    ) -> None:
        self._key = key
        self._group = group
        self._ranks = list(global_ranks)
        self._rank = rank
        self._scope = f"{group.group_name}|{','.join(map(str, self._ranks))}".encode()
        self._collectives = 0  # every member calls the collectives in the same order
        self._sent: dict[int, int] = {}  # per peer group rank
        self._received: dict[int, int] = {}

    # -- tags ------------------------------------------------------------------------------------
    def _tag(self, op: str, sender: int, receiver: int, count: int, payload: memoryview) -> bytes:
        head = b"|".join(
            [self._scope, op.encode(), str(self._ranks[sender]).encode(), str(receiver).encode()]
        )
        head += b"|" + str(count).encode() + b"|"
        mac = hmac.new(self._key, head, hashlib.sha256)
        mac.update(payload)  # no copy of the payload
        return mac.digest()

    def _seal(self, obj: Any, op: str, receiver: int, count: int) -> bytearray:
        """``obj`` pickled, its tag appended: the one buffer that goes on the wire."""
        data = bytearray(pickle.dumps(obj))
        data += self._tag(op, self._rank, receiver, count, memoryview(data))
        return data

    def _open(self, data: memoryview, op: str, sender: int, receiver: int, count: int) -> Any:
        payload, tag = data[:-TAG_BYTES], data[-TAG_BYTES:]
        good = len(data) >= TAG_BYTES and hmac.compare_digest(
            tag, self._tag(op, sender, receiver, count, payload)
        )
        if not good:
            raise AuthenticationError(
                f"launch rank {self._ranks[self._rank]}: the object that group rank {sender} "
                f"(launch rank {self._ranks[sender]}) sent in {op} #{count} failed its HMAC "
                "check (forged, replayed or out of order, or sent by a process without the "
                "launch's secret); it was not unpickled"
            )
        return pickle.loads(payload)  # noqa: S301 - authenticated above

    # -- collectives -----------------------------------------------------------------------------
    def broadcast(self, obj: Any, src: int) -> Any:
        """``obj`` from group rank ``src`` on every member."""
        count = self._collectives = self._collectives + 1
        data = self._seal(obj, "broadcast", -1, count) if self._rank == src else bytearray()
        size = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(size, group_src=src, group=self._group)
        buf = _as_tensor(data) if data else torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(buf, group_src=src, group=self._group)
        if self._rank == src:
            return obj  # as torch's broadcast_object_list: the source keeps its own object
        return self._open(_as_bytes(buf), "broadcast", src, -1, count)

    def all_gather(self, obj: Any) -> list[Any]:
        """Every member's ``obj``, by group rank."""
        count = self._collectives = self._collectives + 1
        data = self._seal(obj, "all_gather", -1, count)
        world = len(self._ranks)
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(sizes, size, group=self._group)
        longest = max(int(s.item()) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[: len(data)] = _as_tensor(data)
        bufs = [torch.empty(longest, dtype=torch.uint8) for _ in range(world)]
        dist.all_gather(bufs, mine, group=self._group)
        out = []
        for r in range(world):
            got = _as_bytes(bufs[r][: int(sizes[r].item())])
            if r == self._rank:
                out.append(pickle.loads(memoryview(data)[:-TAG_BYTES]))  # noqa: S301 - our own
            else:
                out.append(self._open(got, "all_gather", r, -1, count))
        return out

    def send(self, obj: Any, dst: int) -> None:
        """Send ``obj`` to group rank ``dst``."""
        count = self._sent[dst] = self._sent.get(dst, 0) + 1
        data = self._seal(obj, "p2p", self._ranks[dst], count)
        dist.send(torch.tensor([len(data)], dtype=torch.int64), group_dst=dst, group=self._group)
        dist.send(_as_tensor(data), group_dst=dst, group=self._group)

    def recv(self, src: int) -> Any:
        """The next object group rank ``src`` sent to this worker."""
        count = self._received.get(src, 0) + 1
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, group_src=src, group=self._group)
        buf = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(buf, group_src=src, group=self._group)
        obj = self._open(_as_bytes(buf), "p2p", src, self._ranks[self._rank], count)
        self._received[src] = count  # a refused message takes no place in the sequence
        return obj


def _as_tensor(data: bytearray) -> torch.Tensor:
    return torch.frombuffer(data, dtype=torch.uint8)  # shares the buffer


def _as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy().data)  # shares the tensor's memory
