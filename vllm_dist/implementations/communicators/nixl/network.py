"""Where a worker's NIXL agent listens: UCX kept on loopback for a loopback launch, and the
listening sockets of a process read back from ``/proc``.

UCX opens a TCP listener on every network device it finds. When the launch's rendezvous address
(``MASTER_ADDR``) is loopback and the user did not choose devices (``UCX_NET_DEVICES``), the
agent is created with UCX limited to the loopback device, which limits network devices only:
shared memory, CMA and CUDA IPC transports stay. NIXL's own listener thread stays off (agents
meet through the coordinator). Rejected alternative: setting the variable for the whole worker
process, which would also bind every later UCX user of that process without it asking.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import sys
from collections.abc import Iterator, Mapping

NET_DEVICES = "UCX_NET_DEVICES"
_ARPHRD_LOOPBACK = "772"  # /sys/class/net/<dev>/type of a loopback device
_TCP_LISTEN = "0A"


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback: 127.0.0.0/8, ::1 or "localhost"."""
    host = host.strip().strip("[]")
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def loopback_device() -> str:
    """The name of the loopback network interface ("lo" where none is found)."""
    import socket

    for _, name in socket.if_nameindex():
        try:
            with open(f"/sys/class/net/{name}/type") as f:
                if f.read().strip() == _ARPHRD_LOOPBACK:
                    return name
        except OSError:
            continue
    return "lo"


def ucx_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The UCX variables an agent is created with: the loopback device for a launch whose
    ``MASTER_ADDR`` is loopback, unless the user set ``UCX_NET_DEVICES``; else nothing."""
    env = os.environ if env is None else env
    if NET_DEVICES in env or not is_loopback(env.get("MASTER_ADDR", "")):
        return {}
    return {NET_DEVICES: loopback_device()}


QUIET_LEVELS = {"NIXL_LOG_LEVEL": "ERROR", "UCX_LOG_LEVEL": "error"}  # names both sides accept


def quiet_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """NIXL's and UCX's own log levels while they load and make an agent: errors only, unless
    the user set them or asked for ``VLLM_DIST_LOG_LEVEL=DEBUG`` (then their defaults)."""
    env = os.environ if env is None else env
    if env.get("VLLM_DIST_LOG_LEVEL", "").strip().upper() == "DEBUG":
        return {}
    return {k: v for k, v in QUIET_LEVELS.items() if k not in env}


@contextlib.contextmanager
def scoped_env(updates: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` with ``updates`` for the length of the block, then as it was (UCX reads
    its variables once, when the agent's context is created)."""
    old = {k: os.environ.get(k) for k in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def nixl_listens_on(env: Mapping[str, str] | None = None) -> str:
    """What a NIXL agent that this worker creates under ``env`` listens on, in words."""
    env = os.environ if env is None else env
    forced = ucx_env(env)
    if forced:
        where = f"loopback only ({NET_DEVICES}={forced[NET_DEVICES]}: the launch is on loopback)"
    elif NET_DEVICES in env:
        where = f"the devices the user chose ({NET_DEVICES}={env[NET_DEVICES]})"
    else:
        where = f"every network device UCX finds (set {NET_DEVICES} to limit it)"
    return f"UCX: {where}; no NIXL listener thread (agents meet through the coordinator)"


def listening_sockets(pid: int | None = None) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process ``pid`` (default: this one) listens on."""
    pid = os.getpid() if pid is None else pid
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] == _TCP_LISTEN and cols[9] in inodes:
                found.append(_address(cols[1]))
    return found


def _address(hex_pair: str) -> tuple[str, int]:
    """``/proc/net/tcp``'s ``ADDR:PORT`` (hex, the address in host byte order per 32-bit word)."""
    addr_hex, port_hex = hex_pair.split(":")
    raw = bytes.fromhex(addr_hex)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(raw)), int(port_hex, 16)
