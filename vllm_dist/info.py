"""What this machine can run, for ``vllm-dist info`` and the CLI's checks: versions, devices,
NCCL_/UCX_/NIXL_ variables, every registered backend with whether it works here (and why not),
and what a launch listens on. Probes create no CUDA context and import no optional backend
that is missing.
"""

from __future__ import annotations

import contextlib
import os
import re
from typing import Any

from vllm_dist import __version__, registry


def communicator_unavailable(cls: type, device: str) -> str | None:
    """Why ``cls`` cannot move ``device`` memory on this machine; None if it can.

    A backend's probe that itself imports what is missing counts as its answer.
    """
    try:
        reason = cls.unavailable_reason(device)  # type: ignore[attr-defined]
    except ImportError as exc:  # a probe that imports what is missing
        reason = str(exc)
    return reason  # type: ignore[no-any-return]


def cuda_unavailable() -> str | None:
    """Why this process cannot use CUDA (torch build or no device); None if it can."""
    import torch

    if torch.version.cuda is None:
        return f"this torch build ({torch.__version__}) has no CUDA"
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return "no CUDA device is visible (check CUDA_VISIBLE_DEVICES and the driver)"
    return None


_ENV_PREFIXES = ("NCCL_", "UCX_", "NIXL_")


def collect_info(master_addr: str = "127.0.0.1") -> dict[str, Any]:
    """Versions, devices, environment, backends and what a launch at ``master_addr`` listens
    on, as plain data (the ``--json`` report)."""
    import platform

    import torch

    cuda = cuda_unavailable()
    devices = ["cpu"]
    if cuda is None:
        devices += [
            f"cuda:{i} {torch.cuda.get_device_name(i)}" for i in range(torch.cuda.device_count())
        ]
    return {
        "versions": {
            "python": platform.python_version(),
            "vllm_dist": __version__,
            "torch": torch.__version__,
            "torch CUDA": torch.version.cuda or "none (CPU build)",
            "CUDA driver": _cuda_driver_version(),
            "torch NCCL": ".".join(map(str, torch.cuda.nccl.version())) if cuda is None else "-",
            "libnccl": _libnccl_version(),
            "ray": _version("ray"),
            "nixl": _version("nixl"),
            "UCX": _ucx_version(),
            "cloudpickle": _version("cloudpickle"),
        },
        "devices": devices,
        "cuda": "usable" if cuda is None else f"no ({cuda})",
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith(_ENV_PREFIXES)},
        "backends": _backends(),
        "listens": _listens(master_addr),
    }


def _listens(master_addr: str) -> dict[str, Any]:
    """Every socket a launch with its rendezvous at ``master_addr`` opens, and who may use it."""
    from vllm_dist.implementations.communicators.nixl.network import nixl_listens_on
    from vllm_dist.implementations.coordinators.binding import listening_summary

    rows = [
        {"component": c, "address": a, "note": n}
        for c, a, n in listening_summary(master_addr, authenticated=True)
    ]
    rows.append(
        {
            "component": "NIXL agent (nixl_rdt)",
            "address": nixl_listens_on({**os.environ, "MASTER_ADDR": master_addr}),
            "note": "one-sided reads of exposed buffers; same-host peers map them read-only",
        }
    )
    rows.append(
        {
            "component": "Ray (RayLauncher)",
            "address": "a private local cluster unless address= is given",
            "note": "Ray's own ports and authentication",
        }
    )
    return {"master_addr": master_addr, "rows": rows}


def render_info(facts: dict[str, Any]) -> str:
    """The text form of ``collect_info()``."""
    lines = ["versions"]
    lines += [f"  {k:<12} {v}" for k, v in facts["versions"].items()]
    lines.append("devices")
    lines += [f"  {d}" for d in facts["devices"]]
    if len(facts["devices"]) == 1:
        lines.append(f"  (CUDA: {facts['cuda']})")
    lines.append("environment (NCCL_*, UCX_*, NIXL_*)")
    env = facts["environment"]
    lines += [f"  {k}={v}" for k, v in env.items()] or ["  (none set)"]
    lines.append("backends")
    for b in facts["backends"]:
        where = "; ".join(r if d == "any" else f"{d}: {r}" for d, r in b["devices"].items())
        lines.append(f"  {b['axis']:<12} {b['name']:<18} {where}")
    listens = facts["listens"]
    lines.append(
        f"listening (a launch with --master-addr {listens['master_addr']}; see docs/trust.md)"
    )
    for row in listens["rows"]:
        lines.append(f"  {row['component']:<32} {row['address']}")
        lines.append(f"  {'':<32} {row['note']}")
    return "\n".join(lines)


def _backends() -> list[dict[str, Any]]:
    out = []
    for axis in ("launcher", "coordinator", "communicator"):
        reg = getattr(registry, f"{axis}s")
        for name in reg.names():
            out.append({"axis": axis, "name": name, "devices": _usability(axis, reg, name)})
    return out


def _usability(axis: str, reg: Any, name: str) -> dict[str, str]:
    """``{"any": "usable"}`` for launchers and coordinators, per device for communicators."""
    try:
        cls = reg.get(name)
        reason = cls.unavailable_reason() if axis == "launcher" else None
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        reason = str(exc)
    if reason:
        return {"any": f"unusable ({reason.splitlines()[0][:160]})"}
    if axis != "communicator":
        return {"any": "usable"}
    out = {}
    for device in ("cpu", "cuda"):
        reason = communicator_unavailable(cls, device)
        out[device] = "usable" if reason is None else f"no ({reason})"
    return out


def _version(package: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _libnccl_version() -> str:
    try:
        from vllm_dist.implementations.communicators.pynccl.library import load_nccl

        lib = load_nccl()
        return f"{lib.version_string} ({lib.path})"
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return f"not found ({str(exc).splitlines()[0][:80]})"


def _cuda_driver_version() -> str:
    """The kernel driver's version and the CUDA version it supports, without a CUDA context."""
    import ctypes

    found = []
    with contextlib.suppress(OSError, IndexError), open("/proc/driver/nvidia/version") as f:
        found.append(re.findall(r"\d+\.\d+(?:\.\d+)?", f.readline())[0])
    with contextlib.suppress(OSError, AttributeError):
        version = ctypes.c_int()
        if ctypes.CDLL("libcuda.so.1").cuDriverGetVersion(ctypes.byref(version)) == 0:
            found.append(f"CUDA {version.value // 1000}.{version.value % 1000 // 10}")
    return " ".join(found) or "none (no NVIDIA driver)"


def _ucx_version() -> str:
    """UCX's version from the libucp that NIXL bundles, else the system's; never imports NIXL."""
    import ctypes
    import ctypes.util
    import glob
    import importlib.util

    candidates = []
    for pkg in ("nixl_cu13", "nixl_cu12", "nixl"):
        with contextlib.suppress(ImportError, ValueError):
            spec = importlib.util.find_spec(pkg)
            if spec is not None and spec.origin:
                libs = os.path.dirname(os.path.dirname(spec.origin))
                candidates += sorted(glob.glob(os.path.join(libs, f"{pkg}.libs", "libucp*.so*")))
    candidates.append(ctypes.util.find_library("ucp") or "")
    for path in filter(None, candidates):
        with contextlib.suppress(OSError, AttributeError):
            get = ctypes.CDLL(path).ucp_get_version_string
            get.restype = ctypes.c_char_p
            where = "bundled with NIXL" if ".libs" in path else path
            return f"{get().decode()} ({where})"
    return "not found"
