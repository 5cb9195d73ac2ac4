"""Fleet membership over the authenticated store: join, heartbeats, leases, fencing, messages.

A ``Fleet`` is a connection to an ``AuthStoreServer`` (the store's challenge proves the fleet's
secret, so a stranger cannot join or read); ``Fleet.join(role, slot)`` makes a ``Member``. The
roster (every live member, an ``epoch`` that grows on each join, leave or death, and a
``version`` that also counts ready flags) is one JSON key changed only by ``compare_set``, so
every change is atomic and exactly one process wins a race (for example, declaring a member
dead). A slot's incarnation comes from an atomic counter: a new process in the same slot gets a
higher one and every write of the old one (roster changes, heartbeats, messages, published
values) is refused. Leases are judged on the observer's monotonic clock (a heartbeat value that
has not changed for ``lease_s``), so host clocks never need to agree.

Messages between members and published values are stored as ``pickle || HMAC`` (the format of
``signed_objects``, under a key of their own) over a header binding the fleet, the sender's and
receiver's incarnations and a per-pair counter; the tag is checked before anything is unpickled.
Rejected alternative: a gloo group per membership epoch, which one dead member breaks and which
cannot take a new process without every member rebuilding it.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import logging
import os
import pickle
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch.distributed as dist

from vllm_dist.implementations.coordinators.auth_store import (
    AuthStoreClient,
    pack_fields,
    unpack_fields,
)
from vllm_dist.implementations.coordinators.signed_objects import TAG_BYTES
from vllm_dist.interfaces import AuthenticationError, CoordinatorTimeoutError

logger = logging.getLogger("vllm_dist")

_KEY_LABEL = b"vllm_dist fleet messages v1"
_ABSENT = b"\x00vllm_dist:absent\x00"  # a value no key ever holds: compare_set reads with it
POLL_S = 0.25  # the longest one blocking store wait lasts before liveness is checked again
_MAX_ROSTER_BYTES = 16 << 20
_MEMBER_ID = re.compile(r"[^/#]+/[0-9]+#[0-9]+")


class FencedError(RuntimeError):
    """This member's incarnation was superseded (a newer process took its slot) or it was
    declared dead: it may no longer write as its slot. Join again for a new incarnation."""


class PeerGoneError(RuntimeError):
    """The peer a message was for (or from) is not a live member: it left, died or was replaced."""


class MembershipTimeoutError(CoordinatorTimeoutError):
    """A bounded membership wait (a change, a message, a published value) did not complete."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MembershipConfig:
    """How a fleet's members prove they are alive and how long anything may wait.

    ``heartbeat_interval_s``: how often a member writes its heartbeat (and, with ``watch``,
    checks the others'). ``lease_s``: a heartbeat unchanged this long marks a member dead; at
    least twice the interval. ``timeout_s``: the default bound of every wait.
    ``max_message_bytes``: the largest pickled message or published value.
    """

    fleet: str = "default"
    heartbeat_interval_s: float = 1.0
    lease_s: float = 5.0
    timeout_s: float = 60.0
    max_message_bytes: int = 64 << 20
    watch: bool = True

    def __post_init__(self) -> None:
        if not 0.02 <= self.heartbeat_interval_s <= 60:
            raise ValueError(f"heartbeat_interval_s={self.heartbeat_interval_s}: use 0.02 .. 60")
        if not 2 * self.heartbeat_interval_s <= self.lease_s <= 3600:
            raise ValueError(f"lease_s={self.lease_s}: use 2 x heartbeat_interval_s .. 3600")
        if not 0 < self.timeout_s <= 86400:
            raise ValueError(f"timeout_s={self.timeout_s}: use a positive bound")
        if not 0 < self.max_message_bytes <= 200 << 20:
            raise ValueError(f"max_message_bytes={self.max_message_bytes}: use 1 .. 200 MiB")
        if not self.fleet or "/" in self.fleet:
            raise ValueError(f"fleet={self.fleet!r}: a non-empty name without '/'")


@dataclass(frozen=True, kw_only=True, slots=True)
class MemberInfo:
    """One live member as the roster records it."""

    role: str
    slot: int
    incarnation: int
    pid: int
    host: str
    joined_at: float  # time.time() of the member's host when it joined
    ready: bool = False

    @property
    def id(self) -> str:
        """``role/slot#incarnation``: names one process, never reused."""
        return f"{self.role}/{self.slot}#{self.incarnation}"

    @property
    def slot_key(self) -> str:
        return f"{self.role}/{self.slot}"


@dataclass(frozen=True, kw_only=True, slots=True)
class FleetView:
    """The roster at one moment: live members sorted by (role, slot)."""

    epoch: int
    version: int
    members: tuple[MemberInfo, ...] = ()

    def find(self, member: MemberInfo | str) -> MemberInfo | None:
        """The live member with this id (or the same incarnation as ``member``), else None."""
        wanted = member.id if isinstance(member, MemberInfo) else member
        return next((m for m in self.members if m.id == wanted), None)

    def role(self, role: str) -> list[MemberInfo]:
        return [m for m in self.members if m.role == role]

    def ids(self) -> list[str]:
        return [m.id for m in self.members]

    def without(self, member: MemberInfo) -> FleetView | None:
        """The next epoch's view without ``member``; None when it is not (or no longer) here."""
        if self.find(member) is None:
            return None
        kept = tuple(m for m in self.members if m.id != member.id)
        return FleetView(epoch=self.epoch + 1, version=self.version + 1, members=kept)


def message_key(secret: bytes) -> bytes:
    """The key that tags fleet messages, derived from (never equal to) the fleet secret."""
    return hmac.new(secret, _KEY_LABEL, hashlib.sha256).digest()


def seal(key: bytes, header: list[bytes], obj: Any, limit: int) -> bytes:
    """``pickle(obj) || HMAC(key, header || pickle)``; refuses payloads above ``limit``."""
    payload = pickle.dumps(obj)
    if len(payload) + TAG_BYTES > limit:
        raise ValueError(f"a message of {len(payload)} bytes exceeds the {limit}-byte bound")
    return payload + hmac.new(key, pack_fields(header) + payload, hashlib.sha256).digest()


def unseal(key: bytes, header: list[bytes], data: bytes, limit: int, what: str) -> Any:
    """The object in ``data`` once its tag checks; ``AuthenticationError`` before unpickling."""
    payload, tag = data[:-TAG_BYTES], data[-TAG_BYTES:]
    good = TAG_BYTES <= len(data) <= limit and hmac.compare_digest(
        tag, hmac.new(key, pack_fields(header) + payload, hashlib.sha256).digest()
    )
    if not good:
        raise AuthenticationError(
            f"{what} failed its HMAC check (forged, replayed, out of order, too large, or "
            "written by a process without the fleet's secret); it was not unpickled"
        )
    return pickle.loads(payload)  # noqa: S301 - authenticated above


class Fleet:
    """A connection to a fleet's store: read the roster, wait for changes, read published values,
    remove members whose lease expired, and ``join``.

    Raises (from the constructor):
        AuthenticationError: this process does not hold the fleet's secret (or the port is not
            the fleet's store).
        ConnectionError: no store answered at ``host:port`` within ``config.timeout_s``.
    """

    def __init__(
        self, host: str, port: int, secret: bytes, config: MembershipConfig | None = None
    ) -> None:
        config = config or MembershipConfig()
        timeout = datetime.timedelta(seconds=config.timeout_s)
        self._setup(AuthStoreClient(host, port, secret, timeout=timeout), secret, config)

    @classmethod
    def on_store(cls, store: AuthStoreClient, secret: bytes, config: MembershipConfig) -> Fleet:
        """A ``Fleet`` over a connection that is already open (one per thread that blocks)."""
        fleet = cls.__new__(cls)
        fleet._setup(store, secret, config)
        return fleet

    def _setup(self, store: AuthStoreClient, secret: bytes, config: MembershipConfig) -> None:
        self.config = config
        self.store = store
        self._secret = secret
        self.tag_key = message_key(secret)
        self._prefix = f"vllm_dist/fleet/{self.config.fleet}/"
        self._seen: dict[str, tuple[bytes | None, float]] = {}  # id -> (heartbeat, since)

    def k(self, name: str) -> str:
        """The store key of ``name`` inside this fleet."""
        return self._prefix + name

    def peek(self, name: str) -> bytes | None:
        """The value of ``name`` now, None when absent (never blocks: a compare_set that can only
        match a value no key holds)."""
        got = self.store.compare_set(self.k(name), _ABSENT, _ABSENT)
        return None if got == _ABSENT else bytes(got)

    def close(self) -> None:
        self.store.close()

    # -- roster ----------------------------------------------------------------------------------
    def view(self) -> FleetView:
        """The live members now."""
        return _parse_roster(self.peek("roster"))

    def update_roster(self, change: Callable[[FleetView], FleetView | None]) -> FleetView | None:
        """Apply ``change`` atomically (compare_set, retried on a lost race until the bound);
        ``change`` returns the new view, or None to leave the roster as it is."""
        deadline = time.monotonic() + self.config.timeout_s
        while True:
            raw = self.peek("roster")
            new = change(_parse_roster(raw))
            if new is None:
                return None
            data = _dump_roster(new)
            if self.store.compare_set(self.k("roster"), raw or b"", data) == data:
                self.store.set(self.k(f"change/{new.version}"), b"1")
                if new.version > 2:
                    self.store.delete_key(self.k(f"change/{new.version - 2}"))
                return new
            if time.monotonic() > deadline:
                raise MembershipTimeoutError("the roster kept changing; no update landed in time")

    def wait_for(
        self, predicate: Callable[[FleetView], bool], timeout: float | None = None
    ) -> FleetView:
        """The first view that satisfies ``predicate``; bounded by ``timeout`` (the config's)."""
        seconds = self.config.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + seconds
        while True:
            view = self.view()
            if predicate(view):
                return view
            left = deadline - time.monotonic()
            if left <= 0:
                raise MembershipTimeoutError(
                    f"the fleet did not reach the awaited state within {seconds} s; "
                    f"epoch {view.epoch}, live members {view.ids()}"
                )
            self.wait_key(f"change/{view.version + 1}", min(left, POLL_S))

    def wait_for_change(self, epoch: int, timeout: float | None = None) -> FleetView:
        """The first view whose epoch differs from ``epoch`` (a member joined, left or died)."""
        return self.wait_for(lambda v: v.epoch != epoch, timeout)

    def wait_key(self, name: str, seconds: float) -> bool:
        """Block until ``name`` exists or ``seconds`` passed; True when it exists."""
        try:
            self.store.wait([self.k(name)], datetime.timedelta(seconds=max(seconds, 0.001)))
        except dist.DistStoreError:
            return False
        return True

    # -- leases ----------------------------------------------------------------------------------
    def reap(self, skip: str = "") -> list[MemberInfo]:
        """Remove every member (other than ``skip``) whose heartbeat has not changed for the
        lease on this process's clock; returns those this call removed (a race has one winner)."""
        now, lease = time.monotonic(), self.config.lease_s
        removed = []
        view = self.view()
        for m in view.members:
            if m.id == skip:
                continue
            beat = self.peek(f"hb/{m.slot_key}")
            last, since = self._seen.get(m.id, (None, now))
            if beat != last or m.id not in self._seen:
                self._seen[m.id] = (beat, now)
            elif now - since > lease and self.remove(m, reason=f"no heartbeat for {lease} s"):
                removed.append(m)
        live = set(view.ids())
        self._seen = {i: s for i, s in self._seen.items() if i in live}
        return removed

    def remove(self, member: MemberInfo, *, reason: str) -> bool:
        """Take ``member`` (this incarnation) off the roster and release its messages; True for
        the one caller whose compare_set removed it."""
        new = self.update_roster(lambda view: view.without(member))
        if new is None:
            return False
        where = f"{member.id} (pid {member.pid} on {member.host})"
        logger.warning("vllm_dist: fleet member %s removed: %s; epoch %d", where, reason, new.epoch)
        self.release(member.id)
        return True

    def release(self, member_id: str) -> None:
        """Delete the messages to and from ``member_id`` and the collective keys of every group
        it was in (``coll/g/<id>,<id>,...``): nobody will read them."""
        one, me = _MEMBER_ID.pattern, re.escape(member_id)
        msg = re.compile(rf"msg/({one}/)?{me}/")  # msg/<src>/<dst>/...
        coll = re.compile(rf"coll/g/({one},)*{me}[,/]")
        for key in self.store.list_keys():
            rest = key[len(self._prefix) :] if key.startswith(self._prefix) else ""
            if msg.match(rest) or coll.match(rest):
                self.store.delete_key(key)

    # -- published values ------------------------------------------------------------------------
    def read(self, name: str, timeout: float | None = None) -> Any:
        """The value last published under ``name``, waiting for one up to ``timeout``.

        Raises:
            AuthenticationError: the value's tag does not check (it is not unpickled).
            FencedError: its publisher's slot has a newer incarnation (a stale writer).
            MembershipTimeoutError: nothing was published under ``name`` in time.
        """
        seconds = self.config.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + seconds
        while (data := self.peek(f"pub/{name}")) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise MembershipTimeoutError(f"nothing was published under {name!r} in {seconds} s")
            self.wait_key(f"pub/{name}", min(left, POLL_S))
        return self._open_published(name, data)

    def _open_published(self, name: str, data: bytes) -> Any:
        limit = self.config.max_message_bytes
        try:
            publisher, version, body = unpack_fields(data)
        except ValueError:
            raise AuthenticationError(f"the value under {name!r} is malformed") from None
        header = [self.config.fleet.encode(), b"pub", name.encode(), publisher, version]
        self.check_incarnation(publisher.decode(), f"the value under {name!r}")
        return unseal(self.tag_key, header, body, limit, f"the value published under {name!r}")

    def check_incarnation(self, member_id: str, what: str) -> None:
        """``FencedError`` when ``member_id``'s slot has a newer incarnation than it."""
        if not _MEMBER_ID.fullmatch(member_id):
            raise AuthenticationError(f"{what} names a malformed member id {member_id!r}")
        slot_key, _, inc = member_id.rpartition("#")
        current = self.store.add(self.k(f"inc/{slot_key}"), 0)
        if int(inc) < current:
            raise FencedError(
                f"{what} was written by {member_id}, an old incarnation (slot {slot_key} is at "
                f"incarnation {current}); refused"
            )

    # -- joining ---------------------------------------------------------------------------------
    def join(self, role: str, slot: int, *, start_heartbeat: bool = True) -> Member:
        """Join as ``role``/``slot`` with a fresh incarnation (evicting an older one there)."""
        if not role or "/" in role or "#" in role or slot < 0:
            raise ValueError(f"role={role!r}, slot={slot}: a name without '/' or '#', slot >= 0")
        slot_key = f"{role}/{slot}"
        inc = self.store.add(self.k(f"inc/{slot_key}"), 1)
        me = MemberInfo(
            role=role,
            slot=slot,
            incarnation=inc,
            pid=os.getpid(),
            host=socket.gethostname(),
            joined_at=time.time(),
        )
        self.store.set(self.k(f"hb/{slot_key}"), f"{inc}:0")

        replaced: list[MemberInfo] = []

        def add(view: FleetView) -> FleetView:
            replaced[:] = [m for m in view.members if m.slot_key == slot_key]
            if replaced and replaced[0].incarnation > inc:
                raise FencedError(f"{me.id}: slot {slot_key} already has {replaced[0].id}")
            kept = [m for m in view.members if m.slot_key != slot_key] + [me]
            kept.sort(key=lambda m: (m.role, m.slot))
            return FleetView(epoch=view.epoch + 1, version=view.version + 1, members=tuple(kept))

        self.update_roster(add)
        for old in replaced:
            logger.warning("vllm_dist: fleet member %s replaced by %s", old.id, me.id)
            self.release(old.id)
        member = Member(self, me)
        if start_heartbeat:
            member.start_heartbeat()
        return member


class Member:
    """One process's place in the fleet: heartbeats, the ready flag, messages, ``leave``.

    Made by ``Fleet.join``. Every write first checks that this incarnation is still the slot's
    (``FencedError`` when not).
    """

    def __init__(self, fleet: Fleet, info: MemberInfo) -> None:
        self.fleet = fleet
        self.info = info
        self._sent: dict[tuple[str, str], int] = {}  # per (peer id, channel)
        self._received: dict[tuple[str, str], int] = {}
        self._fenced = ""  # why, once fenced
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def id(self) -> str:
        return self.info.id

    @property
    def fenced(self) -> str:
        """Why this incarnation may no longer write ('' while it may)."""
        return self._fenced

    # -- heartbeats ------------------------------------------------------------------------------
    def start_heartbeat(self) -> None:
        """Beat (and, with ``config.watch``, reap dead peers) from a daemon thread."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._beat_loop, name=f"vllm_dist-hb-{self.id}", daemon=True
            )
            self._thread.start()

    def _beat_loop(self) -> None:
        """Beat every interval on a connection of its own (a blocking wait on the main one must
        not stall it); reconnect after a store error, and give up once the lease has passed."""
        cfg, watcher, last_ok = self.fleet.config, None, time.monotonic()
        last = f"{self.info.incarnation}:0".encode()
        while not self._stop.wait(cfg.heartbeat_interval_s):
            try:
                if watcher is None:
                    watcher = Fleet.on_store(self.fleet.store.clone(), self.fleet._secret, cfg)
                beat = self._beat(watcher, last)
                if beat is None:
                    break
                last, last_ok = beat, time.monotonic()
                if cfg.watch:
                    watcher.reap(skip=self.id)
                if watcher.view().find(self.info) is None and not self._stop.is_set():
                    self._fence("it is no longer on the roster (declared dead or replaced)")
                    break
            except (OSError, ConnectionError, RuntimeError) as exc:
                if watcher is not None:
                    watcher.close()
                    watcher = None
                if time.monotonic() - last_ok > cfg.lease_s:
                    self._fence(f"no heartbeat reached the store for the lease: {exc}")
                    break
                logger.warning("vllm_dist: %s: heartbeat failed, retrying: %s", self.id, exc)
        if watcher is not None:
            watcher.close()

    def _beat(self, watcher: Fleet, last: bytes) -> bytes | None:
        """Advance this slot's heartbeat past ``last``; None (fenced) when the key is gone or
        belongs to a newer incarnation."""
        mine = f"{self.info.incarnation}:".encode()
        new = mine + str(int(last[len(mine) :]) + 1).encode()
        got = bytes(watcher.store.compare_set(watcher.k(f"hb/{self.info.slot_key}"), last, new))
        if got == new:
            return new
        if got != last and got.startswith(mine):  # our previous beat landed before an error
            return got
        self._fence("its heartbeat key belongs to a newer incarnation or was released")
        return None

    def _fence(self, why: str) -> None:
        self._fenced = why
        logger.warning("vllm_dist: fleet member %s is fenced: %s", self.id, why)

    def check_current(self, view: FleetView | None = None) -> FleetView:
        """The roster, once it shows this incarnation live; else ``FencedError``."""
        view = view or self.fleet.view()
        if not self._fenced and view.find(self.info) is None:
            self._fence("it is no longer on the roster (declared dead or replaced)")
        if self._fenced:
            raise FencedError(f"{self.id} may no longer write as its slot: {self._fenced}")
        return view

    # -- roster writes ---------------------------------------------------------------------------
    def set_ready(self, ready: bool = True) -> None:
        """Mark this member ready (after its first complete sync) or not; version only."""

        def mark(view: FleetView) -> FleetView | None:
            self.check_current(view)
            members = tuple(replace(m, ready=ready) if m.id == self.id else m for m in view.members)
            return replace(view, version=view.version + 1, members=members)

        self.fleet.update_roster(mark)
        self.info = replace(self.info, ready=ready)

    def leave(self) -> None:
        """Leave cleanly: off the roster (epoch + 1), heartbeats stopped, messages released."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.fleet.config.heartbeat_interval_s + 15)
        try:
            if not self._fenced:
                self.fleet.update_roster(lambda view: view.without(self.info))
                self.fleet.release(self.id)
        except (
            OSError,
            ConnectionError,
            RuntimeError,
        ) as exc:  # the others reap it after its lease
            logger.warning("vllm_dist: %s could not leave cleanly: %s", self.id, exc)
        finally:
            self._fenced = self._fenced or "it left"
            self.fleet.close()

    # -- messages --------------------------------------------------------------------------------
    def send(self, dst: MemberInfo | str, obj: Any, *, channel: str = "") -> None:
        """Send ``obj`` to the live member ``dst``; ``PeerGoneError`` at once when it is not."""
        view = self.check_current()
        peer = view.find(dst)
        if peer is None:
            raise PeerGoneError(
                f"{self.id}: {_name(dst)} is not a live member (epoch {view.epoch})"
            )
        n = self._sent[peer.id, channel] = self._sent.get((peer.id, channel), 0) + 1
        header = self._p2p_header(self.id, peer.id, channel, n)
        data = seal(self.fleet.tag_key, header, obj, self.fleet.config.max_message_bytes)
        self.fleet.store.set(self.fleet.k(f"msg/{self.id}/{peer.id}/{channel}/{n}"), data)

    def recv(
        self, src: MemberInfo | str, timeout: float | None = None, *, channel: str = ""
    ) -> Any:
        """The next object ``src`` sent to this member, waiting up to ``timeout``.

        Raises:
            PeerGoneError: ``src`` is not live and left no message (it died, left or was
                replaced); the message names it.
            AuthenticationError: the message failed its check (it was not unpickled).
            MembershipTimeoutError: nothing arrived in time.
        """
        src_id = _name(src)
        n = self._received.get((src_id, channel), 0) + 1
        name = f"msg/{src_id}/{self.id}/{channel}/{n}"
        data = self._await_message(src_id, name, timeout)
        header = self._p2p_header(src_id, self.id, channel, n)
        limit = self.fleet.config.max_message_bytes
        try:
            self.fleet.check_incarnation(src_id, f"message #{n} from {src_id}")
            obj = unseal(self.fleet.tag_key, header, data, limit, f"message #{n} from {src_id}")
        finally:  # a refused message is dropped; it takes no place in the sequence
            self.fleet.store.delete_key(self.fleet.k(name))
        self._received[src_id, channel] = n
        return obj

    def _await_message(self, src_id: str, name: str, timeout: float | None) -> bytes:
        seconds = self.fleet.config.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + seconds
        while True:
            data = self.fleet.peek(name)
            if data is not None:
                return data
            view = self.fleet.view()
            if view.find(src_id) is None:
                if (data := self.fleet.peek(name)) is not None:
                    return data
                raise PeerGoneError(
                    f"{self.id}: waiting for a message from {src_id}, which is not a live member "
                    f"(it died, left or was replaced; epoch {view.epoch})"
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise MembershipTimeoutError(
                    f"{self.id}: no message from {src_id} within {seconds} s ({src_id} is live)"
                )
            self.fleet.wait_key(name, min(left, POLL_S))

    def _p2p_header(self, src: str, dst: str, channel: str, n: int) -> list[bytes]:
        fields = [self.fleet.config.fleet, "p2p", src, dst, channel, str(n)]
        return [f.encode() for f in fields]

    def publish(self, name: str, obj: Any) -> None:
        """Publish ``obj`` under ``name`` for any member to ``Fleet.read``."""
        self.check_current()
        version = str(self.fleet.store.add(self.fleet.k(f"pubver/{name}"), 1)).encode()
        header = [self.fleet.config.fleet.encode(), b"pub", name.encode(), self.id.encode()]
        body = seal(
            self.fleet.tag_key, [*header, version], obj, self.fleet.config.max_message_bytes
        )
        value = pack_fields([self.id.encode(), version, body])
        self.fleet.store.set(self.fleet.k(f"pub/{name}"), value)

    def read(self, name: str, timeout: float | None = None) -> Any:
        """``Fleet.read`` on this member's connection."""
        return self.fleet.read(name, timeout)

    def view(self) -> FleetView:
        return self.fleet.view()


def _name(member: MemberInfo | str) -> str:
    return member.id if isinstance(member, MemberInfo) else member


def _parse_roster(raw: bytes | None) -> FleetView:
    if not raw:
        return FleetView(epoch=0, version=0)
    if len(raw) > _MAX_ROSTER_BYTES:
        raise ValueError(f"the roster is {len(raw)} bytes, above {_MAX_ROSTER_BYTES}")
    doc = json.loads(raw)
    members = tuple(MemberInfo(**m) for m in doc["members"])
    return FleetView(epoch=int(doc["epoch"]), version=int(doc["version"]), members=members)


def _dump_roster(view: FleetView) -> bytes:
    members = [asdict(m) for m in view.members]
    return json.dumps({"epoch": view.epoch, "version": view.version, "members": members}).encode()
