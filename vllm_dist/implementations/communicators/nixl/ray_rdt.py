"""Ray Direct Transport (``tensor_transport="nixl"``) helpers, guarded by ``check_ray_rdt_version()``.

Ray's NIXL transport is pull-based (the receiver READs), and UCX carries a READ of VRAM between
processes on one GPU over TCP unless ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY`` is on when the agent is
created; these helpers set it in the actor before Ray creates its agent, and bound every fetch.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from vllm_dist.implementations.communicators.nixl.agent import (
    CUDA_IPC_GET_ZCOPY,
    NixlTimeoutError,
    NixlTransferError,
)
from vllm_dist.versions import RayRdtUnavailableError, check_ray_rdt_version


def ray_rdt_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """Environment variables for a Ray actor's ``runtime_env`` so RDT READs of VRAM stay on CUDA IPC.

    Ray's NIXL transport pulls (READ); without this, UCX reads VRAM between processes on one GPU
    over TCP. A value the user already set (in ``environ``, default ``os.environ``) is kept.
    """
    env = os.environ if environ is None else environ
    return {CUDA_IPC_GET_ZCOPY: env.get(CUDA_IPC_GET_ZCOPY, "y")}


def prepare_ray_rdt_actor(device: torch.device | str | None = None) -> None:
    """Call first thing in an actor that uses RDT (in ``__init__``): checks Ray, sets the UCX variable.

    UCX reads its variables when Ray creates the actor's NIXL agent: in a producer that is the
    first call of a ``tensor_transport="nixl"`` method (Ray probes the actor for the transport
    before submitting it), in a consumer its first fetch. Calling this from a method of a producer
    is too late; ``runtime_env={"env_vars": ray_rdt_env()}`` on both actors always works.

    Args:
        device: the CUDA device this actor moves VRAM on: it is made current and its context
            created now, before Ray's agent (UCX looks for a CUDA context when it starts). None or
            a CPU device: nothing touches CUDA.
    """
    check_ray_rdt_version()
    late = CUDA_IPC_GET_ZCOPY not in os.environ and _ray_nixl_agent_started()
    os.environ.setdefault(CUDA_IPC_GET_ZCOPY, "y")
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda":
        if dev.index is None:  # "cuda": the first device Ray made visible to this actor
            dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)
        torch.zeros(1, device=dev)  # the context exists from here on
    if late and (dev.type == "cuda" if dev is not None else torch.cuda.is_available()):
        import warnings

        warnings.warn(
            f"prepare_ray_rdt_actor(): Ray's NIXL agent in this process already exists, so "
            f"{CUDA_IPC_GET_ZCOPY}=y reaches UCX too late here; VRAM READs between processes on "
            "one GPU may go over TCP. Call it in the actor's __init__, or pass "
            "runtime_env={'env_vars': ray_rdt_env()} to the actor",
            RuntimeWarning,
            stacklevel=2,
        )


def _ray_nixl_agent_started() -> bool:
    """Whether Ray already built this process's NIXL agent (private Ray state; False if unknown)."""
    with contextlib.suppress(Exception):
        from ray.experimental.rdt.util import get_tensor_transport_manager

        return getattr(get_tensor_transport_manager("NIXL"), "_nixl_agent", None) is not None
    return False


def ray_rdt_register(tensor: torch.Tensor) -> None:
    """Register ``tensor`` with Ray's NIXL agent for the life of the process (producer side).

    Optional: Ray registers a returned tensor by itself and deregisters it when the last ref to
    it goes; registering a buffer that is returned again and again (weights) saves that each time.
    """
    if not tensor.is_contiguous():
        raise ValueError(
            "Ray Direct Transport sends contiguous tensors only; register a contiguous one"
        )
    prepare_ray_rdt_actor()
    from ray.experimental import register_nixl_memory

    register_nixl_memory(tensor)


def ray_rdt_fetch_into(ref: Any, targets: Sequence[torch.Tensor], *, timeout: float) -> Any:
    """Fetch an RDT ``ref`` (made with ``tensor_transport="nixl"``) into preallocated ``targets``.

    ``targets`` are the tensors of the object in the order the producer returned them (shape and
    dtype as sent, contiguous, all on one device type; CPU <-> GPU is allowed). Returns the value
    the producer returned, its tensors being ``targets``: the bytes are in ``targets`` when this
    returns, also when Ray served the object from this process without a transfer. Call it in an
    actor or driver that owns ``ref`` or borrowed it inside a container (a top-level actor-call
    argument is resolved by Ray before the call starts; the owner lends it once
    ``ray_rdt_wait_lendable`` returned).

    Every wait is bounded by ``timeout`` seconds in all: the producer's call finishing, then the
    NIXL READ (Ray's own limit, ``RAY_rdt_fetch_fail_timeout_milliseconds``, applies too).

    Raises:
        RayRdtUnavailableError: Ray too old, or VRAM with ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY`` off.
        NixlTimeoutError: the producer did not return, or the bytes did not arrive, in time.
        NixlTransferError: the producer actor died (before or after returning) or the READ failed.
        ValueError: ``targets`` empty, not contiguous, or not matching the object's tensors.
    """
    targets = _checked_targets(targets, timeout)
    prepare_ray_rdt_actor(targets[0].device)
    import ray
    from ray import exceptions as rex
    from ray.experimental import set_target_for_ref

    vram = targets[0].is_cuda
    if vram and os.environ.get(CUDA_IPC_GET_ZCOPY, "").lower() in ("n", "no", "off", "0"):
        raise RayRdtUnavailableError(
            f"{CUDA_IPC_GET_ZCOPY} is off in this actor: Ray's NIXL transport READs, which UCX then "
            "carries over TCP between processes on one GPU (and may time out); unset it or "
            f"set it to 'y' in both actors' runtime_env (see ray_rdt_env())"
        )
    deadline = time.monotonic() + timeout
    hint = (
        f" (VRAM: both actors need {CUDA_IPC_GET_ZCOPY}=y before Ray creates their NIXL agents, "
        "see ray_rdt_env(); else UCX READs over TCP)"
        if vram
        else ""
    )
    ready, _ = ray.wait([ref], num_returns=1, timeout=timeout)
    if not ready:
        raise NixlTimeoutError(
            f"Ray Direct Transport: the producer of {ref} did not return within {timeout} s "
            "(it is busy, stuck, or dead)"
        )
    set_target_for_ref(ref, targets)
    left = max(deadline - time.monotonic(), 1e-3)
    try:
        value = ray.get(ref, timeout=left)
    except (rex.GetTimeoutError, rex.ObjectFetchTimedOutError, TimeoutError) as exc:
        raise NixlTimeoutError(
            f"Ray Direct Transport fetch of {ref} did not finish within {timeout} s: the producer "
            f"actor may be dead or its NIXL agent unreachable{hint}"
        ) from exc
    except rex.RayDirectTransportError as exc:
        raise NixlTransferError(
            f"Ray Direct Transport fetch of {ref} failed (the producer actor may have died): "
            f"{_first_line(exc)}"
        ) from exc
    except (rex.RayActorError, rex.ObjectLostError) as exc:
        raise NixlTransferError(
            f"Ray Direct Transport: the producer of {ref} died or lost the object before it could "
            f"be fetched: {_first_line(exc)}"
        ) from exc
    _land_in_targets(value, targets)
    return value


def _checked_targets(targets: Sequence[torch.Tensor], timeout: float) -> list[torch.Tensor]:
    """``ray_rdt_fetch_into``'s arguments checked; ValueError naming what is wrong."""
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    targets = list(targets)
    if not targets or not all(isinstance(t, torch.Tensor) for t in targets):
        raise ValueError(
            "targets must be a non-empty list of tensors, one per tensor of the object"
        )
    if not all(t.is_contiguous() for t in targets):
        raise ValueError("Ray Direct Transport fetches into contiguous targets only")
    if len({t.device.type for t in targets}) > 1:
        raise ValueError("all targets of one RDT object must be on one device type")
    return targets


def ray_rdt_wait_lendable(refs: Sequence[Any], *, timeout: float) -> None:
    """Wait until RDT ``refs`` this process owns can be lent to another actor inside a container.

    Ray refuses to pass an RDT ref on (``NotImplementedError``: "Tensor transport metadata is not
    available ... at the time of borrowing") until the owner has the producer's transport
    metadata, which can arrive after ``ray.wait`` already reported the ref ready. Refs that are
    not RDT refs of this process pass through.

    Raises:
        NixlTimeoutError: a producer did not return, or its metadata did not arrive, in time (a
            producer that died never sends it).
    """
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
    check_ray_rdt_version()
    import ray

    refs = list(refs)
    if not refs:
        return
    deadline = time.monotonic() + timeout
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    if len(ready) < len(refs):
        raise NixlTimeoutError(
            f"Ray Direct Transport: {len(refs) - len(ready)} of {len(refs)} producers did not "
            f"return within {timeout} s"
        )
    manager = ray._private.worker.global_worker.rdt_manager
    for ref in refs:
        meta = manager.get_rdt_metadata(ref.hex())
        if meta is None or meta.tensor_transport_meta is not None:
            continue
        left = max(deadline - time.monotonic(), 0.0)
        if manager.wait_for_tensor_transport_metadata(ref.hex(), left) is None:
            raise NixlTimeoutError(
                f"Ray Direct Transport: the transport metadata of {ref} did not reach its owner "
                f"within {timeout} s (did its producer fail or die?)"
            )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


def _land_in_targets(value: Any, targets: list[torch.Tensor]) -> None:
    """Make sure the bytes sit in ``targets`` (Ray returns its own copy when the object is local)."""
    if isinstance(value, torch.Tensor):
        got = [value]
    elif isinstance(value, (list, tuple)):
        got = [v for v in value if isinstance(v, torch.Tensor)]
    elif isinstance(value, dict):
        got = [v for v in value.values() if isinstance(v, torch.Tensor)]
    else:
        return  # an object Ray alone knows how to take apart; its tensors are the targets
    if len(got) != len(targets):
        return
    for src, dst in zip(got, targets, strict=True):
        if src.data_ptr() != dst.data_ptr():
            dst.copy_(src.reshape(dst.shape))
