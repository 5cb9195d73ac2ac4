"""Planning one-sided requests: checking them against the peer's exposed buffers and laying
them out as NIXL descriptors or as copies on a mapping of the peer's memory.

A strided remote view goes through NIXL as its contiguous runs (``strided_runs``), one
descriptor each; on a mapping it is one copy whatever its layout. Copy views of exposed local
memory are cached, since a weight sync repeats the same requests every step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from vllm_dist.implementations.communicators.common import check_tensor
from vllm_dist.implementations.communicators.nixl.agent import (
    Peers,
    ReadOnlyExposureError,
    RegistrationCache,
)
from vllm_dist.implementations.communicators.nixl.descriptors import ExposedBuffer
from vllm_dist.implementations.communicators.nixl.mapping import PeerMaps
from vllm_dist.implementations.communicators.nixl.transfers import Piece
from vllm_dist.memory import widest_views

MAX_PREPARED = 1 << 16  # copy views kept for reuse (a weight sync repeats its reads)
MAX_RUNS = 1 << 20  # descriptors one strided read may take through NIXL

Copy = tuple[torch.Tensor, torch.Tensor, int]  # (destination, source, nbytes)
ByteRequest = tuple[str, int, torch.Tensor, int]  # (remote name, remote offset, view, nbytes)
StridedRequest = tuple[str, int, Sequence[int], torch.Tensor]  # (name, offset, strides, local)


def strided_runs(
    size: Sequence[int], stride: Sequence[int], itemsize: int
) -> tuple[np.ndarray, int]:
    """(byte offset of each contiguous run, run bytes) of a strided view, in element order.

    The trailing dimensions whose strides make them contiguous merge into one run; every other
    index combination starts a run. ``(4, 6)`` at strides ``(12, 1)`` (a column slice of a
    4 x 12 matrix) is 4 runs of 6 elements at 0, 12, 24 and 36 elements.
    """
    if any(n == 0 for n in size):
        return np.zeros(0, dtype=np.int64), 0
    dims = [(n, s) for n, s in zip(size, stride, strict=True) if n != 1]
    run = 1
    while dims and dims[-1][1] == run:
        run *= dims.pop()[0]
    starts = np.zeros(1, dtype=np.int64)
    for n, s in dims:
        starts = (starts[:, None] + np.arange(n, dtype=np.int64)[None, :] * s).reshape(-1)
    return starts * itemsize, run * itemsize


def _typed(mapped: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``mapped`` (uint8) seen as ``dtype`` whole, or None where its size or offset forbid."""
    try:
        return mapped.view(dtype)
    except RuntimeError:
        return None


def _strided_extent(
    i: int, peer: int, remote_name: str, remote: ExposedBuffer, off: int, stride: Any, local: Any
) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """Check strided request ``i``; (size, strides, bytes its remote view spans)."""
    size, stride = tuple(local.shape), tuple(int(s) for s in stride)
    item = local.element_size()
    if len(stride) != len(size) or any(s < 0 for s in stride):
        raise ValueError(
            f"request {i}: strides {stride} do not fit a view of shape {size} (one "
            "non-negative stride per dimension)"
        )
    if off < 0 or off % item:
        raise ValueError(
            f"request {i}: remote offset {off} is not a multiple of the element size "
            f"{item} of {local.dtype}"
        )
    extent = (
        0
        if local.numel() == 0
        else item * (1 + sum((n - 1) * s for n, s in zip(size, stride, strict=True)))
    )
    if off + extent > remote.nbytes:
        raise ValueError(
            f"request {i}: the remote view [{off}, {off + extent}) reaches outside "
            f"{remote_name!r} ({remote.nbytes} bytes) on rank {peer}"
        )
    return size, stride, extent


def _runs_as_pieces(
    checked: list[tuple[ExposedBuffer, int, Any, torch.Tensor, int]],
) -> list[Piece]:
    """The NIXL pieces of checked strided requests: one per contiguous run of a remote view."""
    pieces: list[Piece] = []
    for i, (remote, off, stride, local, extent) in enumerate(checked):
        if not extent:
            continue
        if not local.is_contiguous():
            raise ValueError(
                f"request {i}: a strided read through NIXL needs a contiguous local tensor "
                f"(shape {tuple(local.shape)}, strides {local.stride()}); read into a "
                "contiguous buffer and copy from it"
            )
        starts, run = strided_runs(tuple(local.shape), stride, local.element_size())
        if len(starts) > MAX_RUNS:
            raise ValueError(
                f"request {i}: the remote view has {len(starts)} contiguous runs of {run} "
                f"bytes (at most {MAX_RUNS}); pack it on the owner's side instead"
            )
        flat = local.reshape(-1).view(torch.uint8)
        pieces.extend(
            (flat[k * run : (k + 1) * run], off + s, run, remote)
            for k, s in enumerate(starts.tolist())
        )
    return pieces


class Planner:
    """Checks one-sided requests and lays them out (NIXL pieces, or copies on mappings)."""

    def __init__(
        self, device: torch.device, peers: Peers, maps: PeerMaps, cache: RegistrationCache
    ) -> None:
        self._device = device
        self._peers = peers
        self._maps = maps
        self._cache = cache
        # (peer, op, remote name, addr, offset, nbytes, local ptr) -> copy views of exposed local
        # memory (never of a caller's temporary tensors: that would keep them alive)
        self._prepared: dict[tuple[Any, ...], Any] = {}

    def clear(self) -> None:
        """Forget cached copy views (they may hold memory being released)."""
        self._prepared.clear()

    def _keep(self, key: tuple[Any, ...], value: Any) -> None:
        if len(self._prepared) >= MAX_PREPARED:
            self._prepared.clear()
        self._prepared[key] = value

    def gather(
        self, op: str, peer: int, requests: Sequence[ByteRequest], *, maps: bool
    ) -> tuple[list[Piece], list[Copy] | None]:
        """Check byte requests; (NIXL pieces, copies on mappings or None)."""
        pieces: list[Piece] = []
        copies: list[Copy] | None = [] if maps else None
        for i, (remote_name, off, view, n) in enumerate(requests):
            remote = self._peers.buffer(peer, remote_name)
            if op == "WRITE" and not remote.writable:
                raise ReadOnlyExposureError(
                    f"rank {peer} exposed {remote_name!r} read-only: it cannot be written; the "
                    "owner must expose it with writable=True to make it a WRITE target"
                )
            check_tensor(view, self._device, f"local[{i}]")
            key = (peer, op, remote_name, remote.addr, off, n, view.data_ptr())
            hit = self._prepared.get(key)
            if hit is not None and copies is not None:
                pieces.append((view, off, n, remote))
                copies.append(hit)  # checked and sliced by an earlier request
                continue
            have = view.numel() * view.element_size()
            if not 0 <= n <= have:
                raise ValueError(f"request {i}: nbytes={n} but the local view holds {have} bytes")
            if off < 0 or off + n > remote.nbytes:
                raise ValueError(
                    f"request {i}: remote range [{off}, {off + n}) is outside {remote_name!r} "
                    f"({remote.nbytes} bytes) on rank {peer}"
                )
            pieces.append((view, off, n, remote))
            mapped = None if copies is None else self._maps.open(peer, remote)
            if mapped is None:
                copies = None
            elif copies is not None:
                mine = view.reshape(-1).view(torch.uint8)[:n]
                theirs = mapped[off : off + n]
                prepared = (mine, theirs, n) if op == "READ" else (theirs, mine, n)
                if self._cache.is_exposed(view):  # kept alive by its exposure: cache the views
                    self._keep(key, prepared)
                copies.append(prepared)
        return pieces, copies

    def strided(
        self, peer: int, requests: Sequence[StridedRequest], *, maps: bool
    ) -> tuple[list[Piece], list[Copy] | None]:
        """Check strided read requests; (NIXL pieces, None) or, where every remote buffer is
        mapped here and ``maps``, ([], copies)."""
        copies: list[Copy] | None = [] if maps else None
        checked = []
        typed_maps: dict[tuple[int, torch.dtype], torch.Tensor | None] = {}
        for i, (remote_name, off, stride, local) in enumerate(requests):
            remote = self._peers.buffer(peer, remote_name)
            key = None
            if copies is not None:
                key = (peer, "S", remote_name, remote.addr, off, tuple(stride), local.data_ptr())
                hit = self._prepared.get(key)
                if hit is not None and hit[3] is local:  # the same request as an earlier one
                    copies.append(hit[:3])
                    checked.append((remote, off, tuple(stride), local, hit[2]))  # for NIXL
                    continue
            check_tensor(local, self._device, f"local[{i}]", contiguous=False)
            size, stride, extent = _strided_extent(i, peer, remote_name, remote, off, stride, local)
            checked.append((remote, off, stride, local, extent))
            mapped = None if copies is None else self._maps.open(peer, remote)
            if mapped is None:
                copies = None
            elif copies is not None and extent:
                item = local.element_size()
                typed = typed_maps.get((id(mapped), local.dtype))
                if typed is None:  # the whole mapping as this dtype, once per call
                    typed = typed_maps[(id(mapped), local.dtype)] = _typed(mapped, local.dtype)
                if typed is not None:  # one view op, not three: many items per sync
                    theirs = typed.as_strided(size, stride, typed.storage_offset() + off // item)
                else:
                    theirs = mapped[off : off + extent].view(local.dtype).as_strided(size, stride)
                mine, theirs = widest_views(local, theirs)
                copies.append((mine, theirs, extent))
                if key is not None and self._cache.is_exposed(local):  # kept alive by exposure
                    self._keep(key, (mine, theirs, extent, local))
        if copies is not None:
            return [], copies
        return _runs_as_pieces(checked), None
