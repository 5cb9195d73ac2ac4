"""The authenticated rendezvous store: a small TCP key-value server and its ``dist.Store`` client.

Rank 0 of a launch (the producer launch's rank 0 for a ``JoinSpec`` fleet) serves the store from
a daemon thread, bound to exactly the address it was given. Every connection starts with a
mutual challenge before any command: the server sends a nonce, the client answers with its own
nonce and HMAC-SHA256(secret, label || nonces), and the server answers with its own HMAC, so a
stranger never reads or writes a key and a worker never sends a key to a process that bound the
port first and poses as rank 0. Frames are explicit (``struct`` lengths, bounded sizes, read
timeouts); nothing is pickled. Rejected alternative: torch's ``TCPStore``, which authenticates
nothing and listens on every interface whatever address it is given.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import hmac
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch.distributed as dist

from vllm_dist.interfaces import AuthenticationError

logger = logging.getLogger("vllm_dist")

MAGIC = b"VDSTORE1"
NONCE_BYTES = 32
MAC_BYTES = 32
HANDSHAKE_TIMEOUT_S = 10.0
_LOGGED_REFUSALS = 16  # then every 1000th
MAX_FRAME_BYTES = 256 << 20  # one command or reply; rendezvous values are far smaller
_CLIENT_LABEL = b"vllm_dist store client v1"
_SERVER_LABEL = b"vllm_dist store server v1"
_HEAD = struct.Struct("!BI")  # opcode or status, body length
_LEN = struct.Struct("!I")
_I64 = struct.Struct("!q")

# opcodes
SET, GET, ADD, COMPARE_SET, WAIT, CHECK, DELETE, NUM_KEYS, APPEND, MULTI_GET, MULTI_SET = range(11)
LIST_KEYS = 11
# reply statuses
OK, TIMED_OUT, FAILED = 0, 1, 2


def proof(secret: bytes, label: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    """HMAC-SHA256 of one side's label and both nonces under the launch secret."""
    return hmac.new(secret, label + server_nonce + client_nonce, hashlib.sha256).digest()


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes, or ``ConnectionError`` when the peer closed first."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError(f"the peer closed the connection after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def pack_fields(fields: Iterable[bytes]) -> bytes:
    """Length-prefixed byte strings, one after the other."""
    return b"".join(_LEN.pack(len(f)) + f for f in fields)


def unpack_fields(body: bytes) -> list[bytes]:
    """The inverse of ``pack_fields``; a malformed body raises ``ValueError``."""
    out, pos = [], 0
    while pos < len(body):
        if pos + _LEN.size > len(body):
            raise ValueError("truncated field length")
        (n,) = _LEN.unpack_from(body, pos)
        pos += _LEN.size
        if pos + n > len(body):
            raise ValueError("truncated field")
        out.append(body[pos : pos + n])
        pos += n
    return out


def _send_frame(sock: socket.socket, code: int, fields: Sequence[bytes]) -> None:
    body = pack_fields(fields)
    sock.sendall(_HEAD.pack(code, len(body)) + body)


def _recv_frame(sock: socket.socket) -> tuple[int, list[bytes]]:
    code, n = _HEAD.unpack(recv_exact(sock, _HEAD.size))
    if n > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {n} bytes exceeds the {MAX_FRAME_BYTES}-byte bound")
    return code, unpack_fields(recv_exact(sock, n))


def address_family(host: str) -> tuple[socket.AddressFamily, str]:
    """The family and literal address that ``host`` (a name, an IPv4 or an IPv6 literal,
    bracketed or not) resolves to first."""
    bare = host.strip("[]")
    infos = socket.getaddrinfo(bare, None, type=socket.SOCK_STREAM)
    family, _, _, _, addr = infos[0]
    return family, str(addr[0])


@dataclass
class _Table:
    """The store's keys under one condition variable, which blocking reads wait on."""

    data: dict[bytes, bytes] = field(default_factory=dict)
    cond: threading.Condition = field(default_factory=threading.Condition)


class AuthStoreServer:
    """The store, served from a daemon thread on exactly ``host:port``.

    Connections that fail the challenge are closed, logged on logger ``vllm_dist`` with the
    peer's address and counted (``refusals``); the members' connections keep being served.

    Raises (from the constructor):
        OSError: the address cannot be bound (``errno.EADDRINUSE`` when the port is taken).
    """

    def __init__(self, host: str, port: int, secret: bytes) -> None:
        if not secret:
            raise ValueError("the authenticated store needs a non-empty secret")
        self._secret = secret
        family, self.host = address_family(host)
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                self._sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            self._sock.bind((self.host, port))
            self._sock.listen(128)
        except OSError:
            self._sock.close()
            raise
        self.port = int(self._sock.getsockname()[1])
        self._table = _Table()
        self._lock = threading.Lock()
        self.refusals: list[str] = []  # peer addresses of the connections refused
        self._conns: set[socket.socket] = set()
        self._closed = False
        self._thread = threading.Thread(
            target=self._accept_loop, name="vllm_dist-store", daemon=True
        )
        self._thread.start()

    def refusal_summary(self) -> str:
        """One line on the connections refused so far ('' when none)."""
        with self._lock:
            peers = list(self.refusals)
        if not peers:
            return ""
        shown = ", ".join(sorted(set(peers))[:8])
        return (
            f"{len(peers)} connection(s) to the rendezvous store were refused for a wrong "
            f"secret (from {shown}): a launch with another secret (another JoinSpec token) or "
            f"a process outside the launch reached {self.host}:{self.port}"
        )

    def close(self) -> None:
        """Stop serving and close every connection; idempotent."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        with self._table.cond:
            self._table.cond.notify_all()

    # -- serving ---------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn, _peer_text(peer)), daemon=True).start()

    def _serve(self, conn: socket.socket, peer: str) -> None:
        with self._lock:
            self._conns.add(conn)
        try:
            if self._admit(conn, peer):
                conn.settimeout(None)  # a member may stay idle for as long as its launch runs
                while not self._closed:
                    code, fields = _recv_frame(conn)
                    self._reply(conn, code, fields)
        except (OSError, ConnectionError, ValueError, struct.error):
            pass  # the peer went away or broke the framing: drop its connection only
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _admit(self, conn: socket.socket, peer: str) -> bool:
        """Run the challenge; True when the peer proved it holds the secret."""
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        server_nonce = os.urandom(NONCE_BYTES)
        try:
            conn.sendall(MAGIC + server_nonce)
            answer = recv_exact(conn, NONCE_BYTES + MAC_BYTES)
        except (OSError, ConnectionError):
            answer = b""
        client_nonce, mac = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
        good = len(answer) == NONCE_BYTES + MAC_BYTES and hmac.compare_digest(
            mac, proof(self._secret, _CLIENT_LABEL, server_nonce, client_nonce)
        )
        if not good:
            with self._lock:
                self.refusals.append(peer)
                count = len(self.refusals)
            if count <= _LOGGED_REFUSALS or count % 1000 == 0:  # a flood must not flood the log
                logger.warning(
                    "vllm_dist: refused connection #%d to the rendezvous store at %s:%s from "
                    "%s: it did not prove it holds the launch's secret (another launch's "
                    "JoinSpec token, or a process outside the launch)",
                    count,
                    self.host,
                    self.port,
                    peer,
                )
            with contextlib.suppress(OSError):
                conn.sendall(b"\x00")
            return False
        conn.sendall(b"\x01" + proof(self._secret, _SERVER_LABEL, server_nonce, client_nonce))
        return True

    def _reply(self, conn: socket.socket, code: int, f: list[bytes]) -> None:
        try:
            status, out = self._execute(code, f)
        except (ValueError, IndexError, KeyError, struct.error) as exc:
            status, out = FAILED, [f"bad request (opcode {code}): {exc}".encode()]
        _send_frame(conn, status, out)

    def _execute(self, code: int, f: list[bytes]) -> tuple[int, list[bytes]]:
        table, data = self._table, self._table.data
        if code in (GET, WAIT, MULTI_GET):
            (timeout_ms,) = _I64.unpack(f[0])
            keys = f[1:]
            with table.cond:  # one hold: a key deleted meanwhile cannot slip in between
                ready = lambda: self._closed or all(k in data for k in keys)  # noqa: E731
                if not table.cond.wait_for(ready, max(timeout_ms, 0) / 1000.0) or self._closed:
                    return TIMED_OUT, [k for k in keys if k not in data]
                return OK, ([data[k] for k in keys] if code != WAIT else [])
        with table.cond:
            if code == SET:
                data[f[0]] = f[1]
            elif code == MULTI_SET:
                data.update(zip(f[0::2], f[1::2], strict=True))
            elif code == APPEND:
                data[f[0]] = data.get(f[0], b"") + f[1]
            elif code == ADD:
                value = int(data.get(f[0], b"0")) + _I64.unpack(f[1])[0]
                data[f[0]] = str(value).encode()
                return OK, [_I64.pack(value)]
            elif code == COMPARE_SET:
                return OK, [_compare_set(data, f[0], f[1], f[2])]
            elif code == CHECK:
                return OK, [b"\x01" if all(k in data for k in f) else b"\x00"]
            elif code == DELETE:
                return OK, [b"\x01" if data.pop(f[0], None) is not None else b"\x00"]
            elif code == NUM_KEYS:
                return OK, [_I64.pack(len(data))]
            elif code == LIST_KEYS:
                return OK, list(data)
            else:
                raise ValueError("unknown opcode")
            table.cond.notify_all()
        return OK, []


def _compare_set(data: dict[bytes, bytes], key: bytes, expected: bytes, desired: bytes) -> bytes:
    """TCPStore's rule: set ``desired`` when the current value (absent reads as b'') is
    ``expected``; return the value the key holds afterwards (``expected`` when absent)."""
    current = data.get(key)
    if (current is None and expected == b"") or current == expected:
        data[key] = desired
        return desired
    return expected if current is None else current


def _peer_text(peer: object) -> str:
    if isinstance(peer, tuple) and len(peer) >= 2:
        host = str(peer[0])
        return f"[{host}]:{peer[1]}" if ":" in host else f"{host}:{peer[1]}"
    return str(peer)


def _as_bytes(value: str | bytes | bytearray | Sequence[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


class AuthStoreClient(dist.Store):
    """A ``torch.distributed.Store`` on one authenticated connection to an ``AuthStoreServer``.

    Usable as ``init_process_group(store=...)`` for gloo. ``server`` (rank 0's own) lets a
    timed-out wait say how many connections were refused for a wrong secret and from where.

    Raises (from the constructor):
        AuthenticationError: the server refused this worker's secret, or the process at
            ``host:port`` could not prove it holds the secret (it is not this launch's store).
        ConnectionError / OSError: nothing answered at ``host:port`` within ``timeout``.
    """

    def __init__(
        self,
        host: str,
        port: int,
        secret: bytes,
        *,
        timeout: datetime.timedelta,
        server: AuthStoreServer | None = None,
    ) -> None:
        super().__init__()
        self._timeout = timeout
        self.set_timeout(timeout)
        family, self.host = address_family(host)
        self.port = port
        self._server = server
        self._secret = secret  # for clone()
        self._lock = threading.Lock()
        self._sock = self._connect(family, secret, timeout.total_seconds())

    # -- connection ------------------------------------------------------------------------------
    def _connect(self, family: int, secret: bytes, timeout_s: float) -> socket.socket:
        deadline = time.monotonic() + timeout_s
        where = (
            f"{self.host}:{self.port}" if family == socket.AF_INET else f"[{self.host}]:{self.port}"
        )
        while True:
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.settimeout(min(HANDSHAKE_TIMEOUT_S, max(deadline - time.monotonic(), 0.1)))
                sock.connect((self.host, self.port))
                break
            except (ConnectionRefusedError, TimeoutError) as exc:
                sock.close()
                if time.monotonic() >= deadline:
                    raise ConnectionError(
                        f"no rendezvous store answered at {where} within {timeout_s} s: {exc}"
                    ) from exc
                time.sleep(0.05)
        try:
            self._handshake(sock, secret, where)
        except BaseException:
            sock.close()
            raise
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    @staticmethod
    def _handshake(sock: socket.socket, secret: bytes, where: str) -> None:
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        impostor = (
            f"the process listening at {where} is not this launch's rendezvous store (it did "
            "not prove it holds the launch's secret): the port belongs to another launch or "
            "another program; nothing was sent to it. Pick another port, or check that both "
            "launches use the same JoinSpec(token=...)"
        )
        try:
            hello = recv_exact(sock, len(MAGIC) + NONCE_BYTES)
        except (OSError, ConnectionError) as exc:
            raise AuthenticationError(f"{impostor} ({exc})") from None
        if hello[: len(MAGIC)] != MAGIC:
            raise AuthenticationError(impostor)
        server_nonce, client_nonce = hello[len(MAGIC) :], os.urandom(NONCE_BYTES)
        sock.sendall(client_nonce + proof(secret, _CLIENT_LABEL, server_nonce, client_nonce))
        try:
            status = recv_exact(sock, 1)
        except (OSError, ConnectionError):
            status = b""
        if status != b"\x01":
            raise AuthenticationError(
                f"the rendezvous store at {where} refused this worker's secret: the two "
                "launches hold different secrets; give both launches the same "
                "JoinSpec(token=...) (or the same VLLM_DIST_FLEET_TOKEN / token_file), or the "
                "port belongs to another launch"
            )
        try:
            mac = recv_exact(sock, MAC_BYTES)
        except (OSError, ConnectionError):
            mac = b""
        if not hmac.compare_digest(mac, proof(secret, _SERVER_LABEL, server_nonce, client_nonce)):
            raise AuthenticationError(impostor)

    def _request(
        self, code: int, fields: Sequence[bytes], wait_s: float | None = None
    ) -> list[bytes]:
        limit = self._timeout.total_seconds() if wait_s is None else wait_s
        with self._lock:
            self._sock.settimeout(limit + HANDSHAKE_TIMEOUT_S)
            _send_frame(self._sock, code, fields)
            status, out = _recv_frame(self._sock)
        if status == TIMED_OUT:
            missing = [k.decode(errors="replace") for k in out]
            extra = self._server.refusal_summary() if self._server is not None else ""
            raise dist.DistStoreError(
                f"timed out after {limit} s waiting for key(s) {missing} in the rendezvous "
                f"store at {self.host}:{self.port}" + (f"; {extra}" if extra else "")
            )
        if status != OK:
            raise RuntimeError(b"".join(out).decode(errors="replace"))
        return out

    def _timed(
        self, code: int, keys: Sequence[bytes], timeout: datetime.timedelta | None
    ) -> list[bytes]:
        seconds = (timeout or self._timeout).total_seconds()
        return self._request(code, [_I64.pack(int(seconds * 1000)), *keys], wait_s=seconds)

    def close(self) -> None:
        """Close the connection (the server, if any, is closed by its owner)."""
        with contextlib.suppress(OSError):
            self._sock.close()

    # -- dist.Store ------------------------------------------------------------------------------
    def set_timeout(self, timeout: datetime.timedelta) -> None:
        super().set_timeout(timeout)
        self._timeout = timeout

    def set(self, key: str, value: str | bytes) -> None:  # type: ignore[override]
        self._request(SET, [key.encode(), _as_bytes(value)])

    def get(self, key: str) -> bytes:  # type: ignore[override]
        return self._timed(GET, [key.encode()], None)[0]

    def add(self, key: str, value: int) -> int:  # type: ignore[override]
        return int(_I64.unpack(self._request(ADD, [key.encode(), _I64.pack(value)])[0])[0])

    def compare_set(  # type: ignore[override]
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        fields = [key.encode(), _as_bytes(expected_value), _as_bytes(desired_value)]
        return self._request(COMPARE_SET, fields)[0]

    def wait(  # type: ignore[override]
        self, keys: list[str], timeout: datetime.timedelta | None = None
    ) -> None:
        self._timed(WAIT, [k.encode() for k in keys], timeout)

    def check(self, keys: list[str]) -> bool:  # type: ignore[override]
        return self._request(CHECK, [k.encode() for k in keys])[0] == b"\x01"

    def delete_key(self, key: str) -> bool:  # type: ignore[override]
        return self._request(DELETE, [key.encode()])[0] == b"\x01"

    def num_keys(self) -> int:  # type: ignore[override]
        return int(_I64.unpack(self._request(NUM_KEYS, [])[0])[0])

    def append(self, key: str, value: str | bytes) -> None:  # type: ignore[override]
        self._request(APPEND, [key.encode(), _as_bytes(value)])

    def multi_get(self, keys: list[str]) -> list[bytes]:  # type: ignore[override]
        return self._timed(MULTI_GET, [k.encode() for k in keys], None)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:  # type: ignore[override]
        fields: list[bytes] = []
        for k, v in zip(keys, values, strict=True):
            fields += [k.encode(), _as_bytes(v)]
        self._request(MULTI_SET, fields)

    def list_keys(self) -> list[str]:  # type: ignore[override]
        return [k.decode() for k in self._request(LIST_KEYS, [])]

    def has_extended_api(self) -> bool:  # type: ignore[override]
        return True

    def clone(self) -> AuthStoreClient:  # type: ignore[override]
        """A second connection to the same store (torch clones stores for background threads)."""
        return AuthStoreClient(
            self.host, self.port, self._secret, timeout=self._timeout, server=self._server
        )
