"""Where the control plane listens: gloo bound to the rendezvous address's interface, and a
description of what listens where for ``vllm_dist info`` and for tests.

torch 2.13 builds every gloo group in ``init_process_group`` / ``new_group`` with its default
device, which binds the address the host name resolves to (the external interface) and ignores
``pg_options`` for gloo. ``bound_gloo(host)`` builds those groups with
``ProcessGroupGloo.create_device(hostname=host)`` instead, for the duration of the call only.
Rejected alternative: ``GLOO_SOCKET_IFNAME``, a process-wide variable that names an interface
(not an address) and would stay behind for every later group; a user who set it keeps it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

_PATCH_LOCK = threading.Lock()  # one patched construction at a time in this process
GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"


def local_address_toward(host: str) -> str | None:
    """This machine's address on the route to ``host`` (loopback for a loopback host), or None
    when there is no route. A UDP ``connect`` only asks the routing table; nothing is sent."""
    bare = host.strip("[]")
    try:
        infos = socket.getaddrinfo(bare, 9, type=socket.SOCK_DGRAM)
        family, _, _, _, addr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(addr)
            return str(probe.getsockname()[0])
    except OSError:
        return None


def gloo_bind_host(master_addr: str) -> str | None:
    """The address gloo should listen on for a launch whose rendezvous is ``master_addr``; None
    when the user chose an interface (``GLOO_SOCKET_IFNAME``) or no route is known."""
    if os.environ.get(GLOO_IFNAME_ENV):
        return None
    return local_address_toward(master_addr)


@contextlib.contextmanager
def bound_gloo(host: str | None) -> Iterator[None]:
    """Gloo groups built inside this block listen on ``host`` only (no-op for None)."""
    if host is None:
        yield
        return
    base = dist.ProcessGroupGloo

    class _BoundGloo(base):  # type: ignore[misc, valid-type]
        """torch's gloo group with one device bound to ``host`` (two threads, as torch's own)."""

        def __init__(
            self, store: Any, rank: int, size: int, timeout: datetime.timedelta | None = None
        ) -> None:
            options = base._Options()  # type: ignore[attr-defined]
            options._devices = [base.create_device(hostname=host)]
            options._threads = 2
            if timeout is not None:
                options._timeout = timeout
            super().__init__(store, rank, size, options)

    with _PATCH_LOCK:
        c10d.ProcessGroupGloo = _BoundGloo  # type: ignore[misc]
        try:
            yield
        finally:
            c10d.ProcessGroupGloo = base  # type: ignore[misc]


@dataclass(frozen=True, slots=True)
class Listener:
    """One TCP socket in LISTEN state: its family, local address, port and socket inode."""

    family: str  # "tcp" or "tcp6"
    address: str
    port: int
    inode: int


def listening_sockets(pid: int | None = None) -> list[Listener]:
    """The TCP listeners that process ``pid`` (default: this one) holds, read from ``/proc``
    (Linux); empty where ``/proc`` cannot be read."""
    base = f"/proc/{pid or os.getpid()}"
    inodes: set[int] = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"{base}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"{base}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(int(link[8:-1]))
    out = []
    for family in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"{base}/net/{family}") as table:
            for line in list(table)[1:]:
                cols = line.split()
                if len(cols) < 10 or cols[3] != "0A" or int(cols[9]) not in inodes:
                    continue  # 0A: LISTEN
                addr_hex, port_hex = cols[1].split(":")
                out.append(
                    Listener(family, _proc_address(addr_hex), int(port_hex, 16), int(cols[9]))
                )
    return out


def _proc_address(hex_text: str) -> str:
    """An address as /proc/net/tcp{,6} prints it (32-bit words in host byte order)."""
    raw = bytes.fromhex(hex_text)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, words)


def listening_summary(master_addr: str, *, authenticated: bool) -> list[tuple[str, str, str]]:
    """What a launch whose rendezvous is ``master_addr`` listens on, as rows of
    (component, address, note), for ``vllm_dist info`` and the README."""
    store_addr, _ = _store_address(master_addr)
    gloo = gloo_bind_host(master_addr)
    gloo_note = "ephemeral ports; data connections after the rendezvous are not authenticated"
    store_note = (
        "HMAC challenge with the launch secret before any key is read or written"
        if authenticated
        else "torch TCPStore, unauthenticated (no launch secret: set VLLM_DIST_SECRET)"
    )
    return [
        ("rendezvous store (rank 0)", store_addr, store_note),
        (
            "gloo control plane (every rank)",
            gloo or f"interface {os.environ.get(GLOO_IFNAME_ENV) or 'chosen by gloo'}",
            gloo_note,
        ),
    ]


def _store_address(master_addr: str) -> tuple[str, int]:
    bare = master_addr.strip("[]")
    try:
        info = socket.getaddrinfo(bare, None, type=socket.SOCK_STREAM)[0]
        return str(info[4][0]), int(info[0])
    except OSError:
        return bare, 0
