"""Read a worker's place in a launch from the variables torchrun, SLURM or Open MPI set.

``WorkerInfo.from_env`` calls ``worker_fields``; this module only parses strings, so it stays
free of torch and of every launcher. The scheme is chosen by the variables present, torchrun's
first: a vllm_dist launcher and torchrun set ``RANK``, and torchrun started by ``srun`` or
``mpirun`` sees both sets, where the inner launcher's ``RANK`` is the one that describes the
worker. Calling ``scontrol show hostnames`` was rejected: it needs SLURM's tools on the worker
and a subprocess per start, for a grammar of a few lines.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from typing import Any

from vllm_dist.interfaces.launcher import LAUNCH_ID_ENV, SECRET_ENV

_TORCHRUN = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_SLURM = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NODEID")
_OMPI = (
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
)


def worker_fields(env: Mapping[str, str]) -> dict[str, Any]:
    """``WorkerInfo`` fields from a launcher's environment (the secret from ``VLLM_DIST_SECRET``).

    Raises:
        ValueError: no known launcher's variables are present, or some are missing; the
            message names the missing variables and how to provide them.
    """
    if "RANK" in env or "WORLD_SIZE" in env:
        return {**_torchrun(env), "secret": _secret(env)}
    if "SLURM_PROCID" in env:
        return {**_slurm(env), "secret": _secret(env)}
    if "OMPI_COMM_WORLD_RANK" in env:
        return {**_ompi(env), "secret": _secret(env)}
    raise ValueError(
        f"missing environment variables {list(_TORCHRUN)}: start the worker with a vllm_dist "
        "launcher, torchrun, srun or mpirun, or set them yourself"
    )


def _require(env: Mapping[str, str], names: tuple[str, ...], scheme: str, fix: str) -> None:
    missing = [k for k in names if k not in env]
    if missing:
        raise ValueError(f"{scheme}: missing environment variables {missing}; {fix}")


def _int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"environment variable {name}={env[name]!r} is not an integer") from None


def _torchrun(env: Mapping[str, str]) -> dict[str, Any]:
    _require(
        env,
        _TORCHRUN,
        "torchrun variables",
        "start the worker with a vllm_dist launcher or torchrun, or set them yourself",
    )
    world_size = _int(env, "WORLD_SIZE")
    return {
        "rank": _int(env, "RANK"),
        "world_size": world_size,
        "local_rank": _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else _int(env, "RANK"),
        "local_world_size": _int(env, "LOCAL_WORLD_SIZE")
        if "LOCAL_WORLD_SIZE" in env
        else world_size,
        "master_addr": env["MASTER_ADDR"],
        "master_port": _int(env, "MASTER_PORT"),
        "node_rank": _int(env, "GROUP_RANK") if "GROUP_RANK" in env else 0,
        "launch_id": env.get(LAUNCH_ID_ENV, ""),
        "restart_count": _restarts(env, "TORCHELASTIC_RESTART_COUNT"),
    }


def _slurm(env: Mapping[str, str]) -> dict[str, Any]:
    _require(env, _SLURM, "SLURM", "start the worker with srun (one task per rank)")
    node_id = _int(env, "SLURM_NODEID")
    nodelist = (
        env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or env.get("SLURM_JOB_NODELIST")
    )
    if "MASTER_ADDR" in env:
        master = env["MASTER_ADDR"]
    elif nodelist:
        master = expand_hostlist(nodelist)[0]
    else:
        raise ValueError("SLURM: set MASTER_ADDR or SLURM_NODELIST (rank 0's host)")
    _require(
        env,
        ("MASTER_PORT",),
        "SLURM",
        "SLURM names no port: export MASTER_PORT (a free port on the first node) before srun",
    )
    return {
        "rank": _int(env, "SLURM_PROCID"),
        "world_size": _int(env, "SLURM_NTASKS"),
        "local_rank": _int(env, "SLURM_LOCALID"),
        "local_world_size": _slurm_tasks_on_node(env, node_id),
        "master_addr": master,
        "master_port": _int(env, "MASTER_PORT"),
        "node_rank": node_id,
        "launch_id": env.get(LAUNCH_ID_ENV, ""),
        "restart_count": _restarts(env, "SLURM_RESTART_COUNT"),
    }


def _slurm_tasks_on_node(env: Mapping[str, str], node_id: int) -> int:
    """Tasks on this node: ``SLURM_NTASKS_PER_NODE``, else this node's entry of
    ``SLURM_TASKS_PER_NODE`` (``2(x3),1`` is 2, 2, 2, 1)."""
    if "SLURM_NTASKS_PER_NODE" in env:
        return _int(env, "SLURM_NTASKS_PER_NODE")
    if "SLURM_TASKS_PER_NODE" not in env:
        raise ValueError(
            "SLURM: missing environment variables ['SLURM_NTASKS_PER_NODE', "
            "'SLURM_TASKS_PER_NODE']; start the worker with srun"
        )
    counts = expand_tasks_per_node(env["SLURM_TASKS_PER_NODE"])
    if not 0 <= node_id < len(counts):
        raise ValueError(
            f"SLURM_NODEID={node_id} has no entry in SLURM_TASKS_PER_NODE="
            f"{env['SLURM_TASKS_PER_NODE']!r}"
        )
    return counts[node_id]


def _ompi(env: Mapping[str, str]) -> dict[str, Any]:
    _require(env, _OMPI, "Open MPI", "start the worker with mpirun")
    _require(
        env,
        ("MASTER_ADDR", "MASTER_PORT"),
        "Open MPI",
        "mpirun names no rendezvous: pass -x MASTER_ADDR=<rank 0's host> -x MASTER_PORT=<port>",
    )
    rank = _int(env, "OMPI_COMM_WORLD_RANK")
    local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
    return {
        "rank": rank,
        "world_size": _int(env, "OMPI_COMM_WORLD_SIZE"),
        "local_rank": _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
        "local_world_size": local_size,
        "master_addr": env["MASTER_ADDR"],
        "master_port": _int(env, "MASTER_PORT"),
        # Open MPI exports no node index; with ranks filled node by node (its default) it is:
        "node_rank": rank // max(1, local_size),
        "launch_id": env.get(LAUNCH_ID_ENV, ""),
        "restart_count": 0,
    }


def _secret(env: Mapping[str, str]) -> bytes:
    text = env.get(SECRET_ENV, "").strip()
    if not text:
        return b""
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise ValueError(
            f"{SECRET_ENV} must be hex (for example from `python -c 'import secrets; "
            f"print(secrets.token_hex(32))'`), got {len(text)} characters that are not"
        ) from None
    if len(secret) < 16:
        raise ValueError(
            f"{SECRET_ENV} holds {len(secret)} bytes; give at least 16 (32 hex digits)"
        )
    return secret


def _restarts(env: Mapping[str, str], name: str) -> int:
    return _int(env, name) if env.get(name) else 0


_TASKS_ENTRY = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def expand_tasks_per_node(spec: str) -> list[int]:
    """SLURM's compressed task counts, one per node: ``2(x3),1`` -> ``[2, 2, 2, 1]``."""
    out: list[int] = []
    for part in spec.split(","):
        m = _TASKS_ENTRY.match(part.strip())
        if m is None:
            raise ValueError(f"cannot parse SLURM_TASKS_PER_NODE entry {part!r} in {spec!r}")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def expand_hostlist(hostlist: str) -> list[str]:
    """Hosts of a SLURM host list, in the order ``scontrol show hostnames`` prints them.

    ``node[1-3,5]`` -> node1 node2 node3 node5; ``a[01-02],b7`` -> a01 a02 b7 (a range keeps
    its lower bound's zero padding); ``r[1-2]-n[1-2]`` -> r1-n1 r1-n2 r2-n1 r2-n2.

    Raises:
        ValueError: unbalanced brackets, a nested bracket or a descending range.
    """
    hosts: list[str] = []
    for item in _split_top_level(hostlist):
        hosts.extend(_expand_one(item, hostlist))
    return hosts


def _split_top_level(hostlist: str) -> list[str]:
    """Split on the commas outside brackets."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(hostlist):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"nested '[' in host list {hostlist!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in host list {hostlist!r}")
        elif ch == "," and depth == 0:
            items.append(hostlist[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced '[' in host list {hostlist!r}")
    items.append(hostlist[start:])
    return [s.strip() for s in items if s.strip()]


def _expand_one(item: str, hostlist: str) -> list[str]:
    """One host pattern: literal text and bracket groups, expanded as a product (left first)."""
    pieces: list[list[str]] = []
    for literal, group in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
        if literal:
            pieces.append([literal])
        if group:
            pieces.append(_expand_group(group, hostlist))
    return ["".join(p) for p in itertools.product(*pieces)]


def _expand_group(group: str, hostlist: str) -> list[str]:
    """``01-03,7`` -> 01 02 03 7."""
    out: list[str] = []
    for part in group.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not sep:
            out.append(part)
            continue
        if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
            raise ValueError(f"bad range [{part}] in host list {hostlist!r}")
        width = len(lo)
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out
