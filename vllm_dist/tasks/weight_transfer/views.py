"""Op chains replayed by geometry: one ``as_strided`` per view instead of one call per op.

A chain of pure views maps a tensor of a given (shape, stride, dtype) to a view whose size,
stride and storage offset do not depend on the data. ``ViewCache`` replays each distinct
(chain, shape, stride, dtype) once on a meta tensor, records that geometry, and from then on
builds the view with a single ``as_strided`` — the per-sync and per-name cost of set-up and
packing. A chain that copies (``contiguous`` / ``reshape`` of a non-contiguous view) has no
geometry; it is replayed op by op, as before.

Chains are keyed by identity (they hold slices, unhashable before Python 3.12; hashing their
repr would cost more than the replay it saves). Callers share one chain object among the many
names that baked the same way, so the memo stays small; the memo keeps each chain alive, so an
id is never reused while it is a key.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from vllm_dist.tasks.weight_transfer.ops import OpChain, replay

Geometry = tuple[tuple[int, ...], tuple[int, ...], int] | None


class ViewCache:
    """``cache(tensor, chain)`` == ``replay(tensor, chain)``, by geometry where it is a view."""

    def __init__(self) -> None:
        self._memo: dict[tuple[Any, ...], tuple[OpChain, Geometry]] = {}

    def __call__(self, tensor: torch.Tensor, chain: OpChain) -> torch.Tensor:
        if not chain:
            return tensor
        geo = self.geometry(tuple(tensor.shape), tensor.stride(), tensor.dtype, chain)
        if geo is None:
            return replay(tensor, chain)
        size, stride, delta = geo
        return tensor.as_strided(size, stride, tensor.storage_offset() + delta)

    def geometry(
        self, shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, chain: OpChain
    ) -> Geometry:
        """(size, stride, storage-offset delta) of ``chain`` on such a tensor; None if it copies.

        Raises:
            UnsafeOpError: the chain has an op outside ``ALLOWED_OPS`` (checked on first use).
        """
        key = (id(chain), shape, stride, dtype)
        hit = self._memo.get(key)
        if hit is not None and hit[0] is chain:
            return hit[1]
        probe = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        out = replay(probe, chain)
        geo: Geometry = None
        if out is probe or out._base is probe:
            geo = (
                tuple(out.shape),
                out.stride(),
                int(out.storage_offset()) - int(probe.storage_offset()),
            )
        self._memo[key] = (chain, geo)
        return geo


def slot_views(
    slot: torch.Tensor, specs: Sequence[tuple[torch.dtype, Any, int]], offsets: Sequence[int]
) -> list[torch.Tensor]:
    """``slot[off : off + nbytes].view(dtype).view(shape)`` for every ``(dtype, shape,
    nbytes)`` of ``specs`` at its byte offset in ``offsets`` (``slot``: uint8). Each run of
    items of one spec at one spacing (a chunk of 1,500 expert shards) is one ``as_strided``
    view split by ``unbind``: three tensor calls per item cost about a second per 100,000."""
    out: list[torch.Tensor] = []
    n, i = len(specs), 0
    while i < n:
        spec = specs[i]
        dtype, shape, nbytes = spec
        j = i + 1
        step = offsets[j] - offsets[i] if j < n else 0
        while j < n and specs[j] == spec and offsets[j] - offsets[j - 1] == step:
            j += 1
        size = dtype.itemsize
        if j - i >= _RUN_VIEWS and step % size == 0 and offsets[i] % size == 0:
            span = slot[offsets[i] : offsets[j - 1] + nbytes].view(dtype)
            strides, acc = [], 1  # contiguous
            for dim in reversed(tuple(shape)):
                strides.append(acc)
                acc *= dim
            strides.reverse()
            run = span.as_strided((j - i, *shape), (step // size, *strides), span.storage_offset())
            out.extend(run.unbind(0))
        else:
            out.extend(
                slot[offsets[m] : offsets[m] + specs[m][2]].view(specs[m][0]).view(specs[m][1])
                for m in range(i, j)
            )
        i = j
    return out


_RUN_VIEWS = 4  # items of one spec at one spacing made as one view, then split


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The element strides of a contiguous tensor of ``shape``."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (what travels on the wire)."""
    return t.reshape(-1).view(torch.uint8)
