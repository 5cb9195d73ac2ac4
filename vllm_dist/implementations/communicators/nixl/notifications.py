"""Notifications between agents: a typed, versioned byte codec and the mailbox that reads them.

Every notification is ``kind (1 byte) | version (1 byte) | body``. ``send``/``recv`` use three
kinds (``Ready``, ``Done``, ``Refusal``) with fixed ``struct`` layouts; ``notify`` and
``write(..., notify=...)`` carry the caller's bytes untouched. Decoding checks the kind, the
version and the exact length, and refuses anything else with ``NixlProtocolError``. Rejected
alternative: pickled payloads, which would run code a peer (or anyone who can reach the agent)
chose.
"""

from __future__ import annotations

import struct
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import ClassVar

from vllm_dist.implementations.communicators.nixl.agent import (
    AgentSlot,
    NixlProtocolError,
    NixlTimeoutError,
    Peers,
    nixl_errors,
)
from vllm_dist.implementations.communicators.nixl.transfers import Backoff

WIRE_VERSION = 1
_HEADER = struct.Struct("<cB")  # kind, version
_MEM_TYPES = ("DRAM", "VRAM")


@dataclass(frozen=True, kw_only=True, slots=True)
class Ready:
    """The receiver of send ``seq`` registered ``nbytes`` at ``addr``: write there.

    ``metadata`` is what the sender must load first to address it (empty when it has it
    already); ``full`` says it replaces the receiver's metadata of an older ``epoch``.
    """

    KIND: ClassVar[bytes] = b"R"
    _BODY: ClassVar[struct.Struct] = struct.Struct("<qQqiBq?")

    seq: int
    addr: int
    nbytes: int
    device_id: int
    mem_type: str
    epoch: int
    full: bool
    metadata: bytes

    def body(self) -> bytes:
        mem = _MEM_TYPES.index(self.mem_type)
        head = self._BODY.pack(
            self.seq, self.addr, self.nbytes, self.device_id, mem, self.epoch, self.full
        )
        return head + self.metadata

    @classmethod
    def parse(cls, body: bytes) -> Ready:
        if len(body) < cls._BODY.size:
            raise ValueError(f"{len(body)} bytes, at least {cls._BODY.size} expected")
        seq, addr, nbytes, dev, mem, epoch, full = cls._BODY.unpack_from(body)
        if mem >= len(_MEM_TYPES) or seq < 0 or nbytes < 0 or dev < 0 or epoch < 0:
            raise ValueError(f"fields out of range (seq {seq}, nbytes {nbytes}, mem {mem})")
        return cls(
            seq=seq, addr=addr, nbytes=nbytes, device_id=dev, mem_type=_MEM_TYPES[mem],
            epoch=epoch, full=full, metadata=bytes(body[cls._BODY.size :]),
        )  # fmt: skip


@dataclass(frozen=True, kw_only=True, slots=True)
class Done:
    """Send ``seq``'s bytes have landed (attached to the WRITE: delivered after the data)."""

    KIND: ClassVar[bytes] = b"D"
    _BODY: ClassVar[struct.Struct] = struct.Struct("<q")

    seq: int

    def body(self) -> bytes:
        return self._BODY.pack(self.seq)

    @classmethod
    def parse(cls, body: bytes) -> Done:
        if len(body) != cls._BODY.size:
            raise ValueError(f"{len(body)} bytes, {cls._BODY.size} expected")
        (seq,) = cls._BODY.unpack(body)
        if seq < 0:
            raise ValueError(f"negative sequence number {seq}")
        return cls(seq=seq)


@dataclass(frozen=True, kw_only=True, slots=True)
class Refusal:
    """The sender refused recv ``seq`` (sizes differ); ``reason`` says why."""

    KIND: ClassVar[bytes] = b"E"
    _BODY: ClassVar[struct.Struct] = struct.Struct("<q")

    seq: int
    reason: str

    def body(self) -> bytes:
        return self._BODY.pack(self.seq) + self.reason.encode()

    @classmethod
    def parse(cls, body: bytes) -> Refusal:
        if len(body) < cls._BODY.size:
            raise ValueError(f"{len(body)} bytes, at least {cls._BODY.size} expected")
        (seq,) = cls._BODY.unpack_from(body)
        return cls(seq=seq, reason=bytes(body[cls._BODY.size :]).decode())


@dataclass(frozen=True, kw_only=True, slots=True)
class UserMessage:
    """The caller's bytes (``notify``, ``write(..., notify=...)``), delivered as they are."""

    KIND: ClassVar[bytes] = b"U"

    data: bytes

    def body(self) -> bytes:
        return self.data

    @classmethod
    def parse(cls, body: bytes) -> UserMessage:
        return cls(data=bytes(body))


Message = Ready | Done | Refusal | UserMessage
_TYPES: dict[bytes, type[Ready] | type[Done] | type[Refusal] | type[UserMessage]] = {
    t.KIND: t for t in (Ready, Done, Refusal, UserMessage)
}


def encode(msg: Message) -> bytes:
    """The wire bytes of ``msg``."""
    return _HEADER.pack(msg.KIND, WIRE_VERSION) + msg.body()


def decode(data: bytes) -> Message:
    """The message in ``data``; ``NixlProtocolError`` for anything malformed or unknown."""
    if len(data) < _HEADER.size:
        raise NixlProtocolError(f"a notification of {len(data)} bytes has no header")
    kind, version = _HEADER.unpack_from(data)
    if version != WIRE_VERSION:
        raise NixlProtocolError(
            f"notification of wire version {version}, this worker speaks {WIRE_VERSION}: "
            "run the same vllm_dist version on every worker"
        )
    typ = _TYPES.get(kind)
    if typ is None:
        raise NixlProtocolError(f"unknown notification kind {kind!r}")
    try:
        return typ.parse(data[_HEADER.size :])
    except (ValueError, struct.error) as exc:  # UnicodeDecodeError is a ValueError
        raise NixlProtocolError(f"malformed {typ.__name__} notification: {exc}") from exc


class Mailbox:
    """Notifications from the peers: send/recv's by (peer, kind, seq), the callers' in order."""

    def __init__(self, agent: AgentSlot, peers: Peers, spin_s: float) -> None:
        self._agent = agent
        self._peers = peers
        self._spin_s = spin_s
        self._inbox: dict[tuple[int, bytes, int], Ready | Done | Refusal] = {}
        self._user: defaultdict[int, deque[bytes]] = defaultdict(deque)

    def send(self, peer: int, msg: Message) -> None:
        """Send ``msg`` to ``peer`` (ordered after every transfer this rank completed)."""
        with nixl_errors(f"notifying rank {peer}"):
            self._agent.get().send_notif(self._peers.agent_of[peer], encode(msg))

    def poll(self) -> None:
        """File every new notification; refuses (raises) malformed ones after filing the rest."""
        with nixl_errors("polling notifications"):
            news = self._agent.get().get_new_notifs()
        refused: NixlProtocolError | None = None
        for agent_name, messages in news.items():
            rank = self._peers.rank_of.get(agent_name)
            if rank is None:
                continue
            for raw in messages:
                try:
                    msg = decode(raw)
                except NixlProtocolError as exc:
                    refused = refused or NixlProtocolError(f"rank {rank} sent {exc}")
                    continue
                if isinstance(msg, UserMessage):
                    self._user[rank].append(msg.data)
                else:
                    self._inbox[(rank, msg.KIND, msg.seq)] = msg
        if refused is not None:
            raise refused

    def forget(self, peer: int) -> None:
        """Drop what ``peer`` sent that nobody took (it is gone; a new process may take its rank)."""
        self.poll()
        self._user.pop(peer, None)
        for key in [k for k in self._inbox if k[0] == peer]:
            del self._inbox[key]

    def wait(
        self,
        peer: int,
        kind: type[Ready] | type[Done],
        seq: int,
        deadline: float,
        what: str,
        *,
        refusable: bool = False,
    ) -> Ready | Done:
        """The ``kind`` message of ``seq`` from ``peer``; with ``refusable``, a ``Refusal`` of
        ``seq`` raises ValueError."""
        poll = Backoff(self._spin_s)
        while True:
            self.poll()
            msg = self._inbox.pop((peer, kind.KIND, seq), None)
            if msg is not None:
                return msg  # type: ignore[return-value]
            refusal = self._inbox.pop((peer, Refusal.KIND, seq), None) if refusable else None
            if isinstance(refusal, Refusal):
                raise ValueError(f"rank {peer} refused {what}: {refusal.reason}")
            if time.monotonic() > deadline:
                raise NixlTimeoutError(
                    f"rank {self._peers.rank}: {what} did not arrive in time; rank {peer} may be "
                    "dead, stuck, or not calling the matching send/recv (raise 'timeout' if it "
                    "is slow)"
                )
            poll.sleep()

    def wait_user(self, peer: int, seconds: float) -> bytes:
        """The next caller's message from ``peer``, within ``seconds``."""
        poll = Backoff(self._spin_s)
        deadline = time.monotonic() + seconds
        queue = self._user[peer]
        while not queue:
            self.poll()
            if queue:
                break
            if time.monotonic() > deadline:
                raise NixlTimeoutError(f"no notification from rank {peer} within {seconds} s")
            poll.sleep()
        return queue.popleft()
