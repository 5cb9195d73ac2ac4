"""WeightSource: what a producer can serve — the model's metadata and the tensors it holds.

A source reports metadata for the whole model it knows about, the names it holds (``None`` =
everything) and hands out full-size tensors one gather group at a time, so a sharded trainer
can materialise a layer (e.g. an FSDP all-gather) when the engine reaches it and free it once
every consumer has its bytes (``release_group``, called after the per-group free barrier).
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from vllm_dist.tasks.weight_transfer.groups import layerwise_groups


@dataclass(frozen=True, kw_only=True, slots=True)
class WeightMeta:
    """One weight of the model: its name, dtype (``str(torch.dtype)``) and full shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_str(self.dtype)


def dtype_from_str(name: str) -> torch.dtype:
    """``"torch.bfloat16"`` -> ``torch.bfloat16``; ``ValueError`` for anything else."""
    attr = name.removeprefix("torch.")
    dtype = getattr(torch, attr, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


class WeightSource(ABC):
    """The weights one producer serves."""

    @abstractmethod
    def metadata(self) -> list[WeightMeta]:
        """Name, dtype and full shape of every weight this producer knows of, in model order."""

    def held_names(self) -> frozenset[str] | None:
        """The names this producer holds and may serve; ``None`` means every name."""
        return None

    @abstractmethod
    def open_group(self, names: Sequence[str]) -> Mapping[str, torch.Tensor]:
        """The full-size tensors of one gather group's held ``names``, ready to read.

        Called once per group per sync, in group order; the tensors must stay valid until
        ``release_group`` is called with the same names. Returning the very mapping object of
        the last call for these ``names`` vouches that it holds the same tensor objects at the
        same addresses (the trainer wrote in place): the engine then looks at none of them.
        """

    def release_group(self, names: Sequence[str]) -> None:  # noqa: B027 - optional hook
        """Every consumer has the group's bytes: memory gathered for it may be freed."""

    def begin_sync(self) -> None:  # noqa: B027 - optional hook
        """A sync starts: the moment to look again at tensors the trainer may have replaced."""

    @property
    def resident(self) -> bool:
        """Whether ``open_group`` hands out tensors that live anyway (no gather, no copy), so
        that opening every group at once costs no memory. A resident source lets the READ path
        check at the start of a sync that every tensor is the one of the last sync, at the same
        address, and then run the whole sync as the last one (one message per consumer)."""
        return False

    @property
    def in_place(self) -> bool:
        """Whether the trainer writes these tensors only in place (``StateDictSource(in_place=
        True)``): their storages are then exposed for in-place reads the first time a sync
        meets them rather than the second, so the first sync is already one to replay."""
        return False

    def current(self, names: Sequence[str]) -> list[torch.Tensor] | None:
        """The tensors behind ``names`` as the source holds them now, without opening anything
        (no gather, no detach), or None when it cannot say that cheaply.

        Only asked of a ``resident`` source, once per sync and once for every name it serves.
        When it answers, the engine's steady-state check (every tensor the same object at the
        same address as at the recorded sync) costs a few C-speed passes over one list instead
        of opening every group. Returning the very list object of the recorded sync vouches
        that nothing moved: the engine then compares nothing, and per-sync work grows with
        the number of chunks only (``StateDictSource(in_place=True)``).
        """
        return None

    def iter_groups(self) -> Iterable[Mapping[str, torch.Tensor]]:
        """The held tensors, one gather group at a time (for callers outside the engine)."""
        held = self.held_names()
        names = [m.name for m in self.metadata() if held is None or m.name in held]
        for group in layerwise_groups(names):
            yield self.open_group(group)
            self.release_group(group)


_Paths = tuple[list[tuple[int, str]], list[tuple[str, int, str]]]


class StateDictSource(WeightSource):
    """A source over a ``torch.nn.Module`` (its state dict, re-read every sync) or a mapping.

    Args:
        state: the module or a name -> tensor mapping.
        held: the names this producer serves (a pipeline stage, some experts); None = all.
        metadata: the whole model's metadata when this producer holds only part of it; by
            default the metadata of ``state``.
        in_place: the trainer's promise that it writes these tensors only in place (optimizer
            steps; no ``p.data = ...``, no new tensors) until it calls ``changed()``. The
            steady-state check then looks at no tensor: with 100,000 names it costs nothing
            instead of tens of milliseconds. Broken, the promise costs correctness: consumers
            would read the old storage.
    """

    def __init__(
        self,
        state: torch.nn.Module | Mapping[str, torch.Tensor],
        held: Iterable[str] | None = None,
        metadata: Sequence[WeightMeta] | None = None,
        *,
        in_place: bool = False,
    ) -> None:
        self._state = state
        self._in_place = in_place
        self._current: tuple[Sequence[str], list[torch.Tensor]] | None = None
        self._held = None if held is None else frozenset(held)
        self._tensors: Mapping[str, torch.Tensor] = {}
        self._detached: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        # (len, first name) of a group -> its names, raw tensors, their addresses and shapes,
        # and what open_group handed out
        self._opened: dict[tuple[int, str], _Opened] = {}
        self._generation = 0  # calls of changed()
        self._meta = list(metadata) if metadata is not None else None
        # a module's (parent index, child name) edges and (name, module index, attribute)
        # leaves: re-reading the tensors through them each sync skips ``state_dict()``
        self._paths: _Paths | None = None
        self._paths_ok = isinstance(state, torch.nn.Module)
        if self._held is not None:
            missing = sorted(self._held - set(self._read()))
            if missing:
                raise ValueError(f"held names {missing[:5]} are not in the given state")

    def _read(self) -> Mapping[str, torch.Tensor]:
        if isinstance(self._state, torch.nn.Module):
            return self._state.state_dict(keep_vars=True)
        return self._state

    def _refresh(self) -> Mapping[str, torch.Tensor]:
        """The tensors as the state holds them now. For a module whose state dict was seen to
        be plain (every entry the parameter or buffer at its path: no hooks or wrappers in
        between), they are read along the module tree instead of through ``state_dict()``
        (about 160 ms of Python for 100,000 parameters; the walk costs a fraction of that). A
        path that no longer resolves falls back to ``state_dict()``."""
        if self._paths_ok and self._paths is not None:
            fast = self._walk(self._paths)
            if fast is not None:
                return fast
        full = self._read()
        if self._paths_ok and self._paths is None:
            self._paths = self._plan_paths(full)
            self._paths_ok = self._paths is not None
        return full

    def _plan_paths(self, full: Mapping[str, torch.Tensor]) -> _Paths | None:
        """Edges and leaves for ``_walk``, or None when walking would not give ``full``."""
        index: dict[str, int] = {"": 0}
        edges: list[tuple[int, str]] = []
        leaves: list[tuple[str, int, str]] = []
        for name in full:
            path, _, attr = name.rpartition(".")
            if path not in index:
                parent = ""
                for part in path.split("."):
                    here = f"{parent}.{part}" if parent else part
                    if here not in index:
                        index[here] = len(edges) + 1
                        edges.append((index[parent], part))
                    parent = here
            leaves.append((name, index[path], attr))
        plan = (edges, leaves)
        walked = self._walk(plan)
        if walked is None or len(walked) != len(full):
            return None
        if not all(walked[n] is t for n, t in full.items()):
            return None
        return plan

    def _walk(self, plan: _Paths) -> dict[str, torch.Tensor] | None:
        edges, leaves = plan
        assert isinstance(self._state, torch.nn.Module)
        modules: list[torch.nn.Module] = [self._state]
        for parent, child in edges:
            module = modules[parent]._modules.get(child)
            if module is None:
                return None
            modules.append(module)
        out: dict[str, torch.Tensor] = {}
        for name, i, attr in leaves:
            found: torch.Tensor | None = modules[i]._parameters.get(attr)
            if found is None:
                found = modules[i]._buffers.get(attr)
                if found is None:
                    return None
            out[name] = found
        return out

    def metadata(self) -> list[WeightMeta]:
        if self._meta is not None:
            return list(self._meta)
        names: dict[torch.dtype, str] = {}  # str(dtype) once per dtype, not per weight
        return [
            WeightMeta(
                name=n,
                dtype=names.get(t.dtype) or names.setdefault(t.dtype, str(t.dtype)),
                shape=tuple(t.shape),
            )
            for n, t in self._read().items()
        ]

    def held_names(self) -> frozenset[str] | None:
        return self._held

    def open_group(self, names: Sequence[str]) -> Mapping[str, torch.Tensor]:
        """The named tensors, detached; the same objects as last sync for unchanged parameters
        (so the engine's cached views of them stay valid). A group whose tensors are all the
        objects of last time, at the same addresses and shapes, gets last time's mapping back
        after a few C-speed passes over the group, with no work per name; with ``in_place``,
        until ``changed()``, at once."""
        key = (len(names), names[0] if names else "")  # one entry per group, however asked
        seen = self._opened.get(key)
        if seen is not None and seen.names is not names and seen.names != names:
            seen = None
        if self._in_place and seen is not None and seen.generation == self._generation:
            return seen.out  # the trainer's promise: nothing moved since changed()
        if not self._tensors:
            self._tensors = self._refresh()
        raws = list(map(self._tensors.__getitem__, names))
        ptrs = list(map(torch.Tensor.data_ptr, raws))
        shapes = list(map(_shape, raws))
        if (
            seen is not None
            and seen.ptrs == ptrs
            and seen.shapes == shapes
            and all(map(operator.is_, raws, seen.raws))
        ):
            if seen.generation != self._generation:  # checked after changed(): trust it again
                self._opened[key] = replace(seen, generation=self._generation)
            return seen.out
        out = {}
        for n, raw in zip(names, raws, strict=True):
            hit = self._detached.get(n)
            if (  # ``param.data = t`` keeps the object but moves its storage
                hit is None
                or hit[0] is not raw
                or hit[1].data_ptr() != raw.data_ptr()
                or hit[1].shape != raw.shape
            ):
                hit = self._detached[n] = (raw, raw.detach())
            out[n] = hit[1]
        self._opened[key] = _Opened(names, raws, ptrs, shapes, out, self._generation)
        return out

    def current(self, names: Sequence[str]) -> list[torch.Tensor] | None:
        """The tensors behind ``names``; with ``in_place``, the very list of the last call for
        the same ``names`` until ``changed()`` (the engine then compares nothing)."""
        if self._current is not None and self._current[0] is names:
            return self._current[1]
        if not self._tensors:
            self._tensors = self._refresh()
        tensors = list(map(self._tensors.__getitem__, names))
        if self._in_place:
            self._current = (names, tensors)
        return tensors

    def changed(self) -> None:
        """The trainer replaced tensors or their storage: look at every one again next sync
        (needed only with ``in_place``; harmless otherwise)."""
        self._current = None
        self._tensors = {}
        self._generation += 1

    def begin_sync(self) -> None:
        """Re-read the module's state dict (a trainer may have replaced parameters), unless
        the trainer vouched for ``in_place`` updates and has not called ``changed()``."""
        if self._current is None:
            self._tensors = {}

    @property
    def resident(self) -> bool:
        return True

    @property
    def in_place(self) -> bool:
        return self._in_place


def stage_names(names: Sequence[str], num_stages: int, stage: int) -> list[str]:
    """The names of pipeline stage ``stage`` of ``num_stages``: a contiguous run of groups."""
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is outside 0..{num_stages - 1}")
    groups = layerwise_groups(names)
    lo, hi = stage * len(groups) // num_stages, (stage + 1) * len(groups) // num_stages
    return [n for g in groups[lo:hi] for n in g]


@dataclass(frozen=True, slots=True)
class _Opened:
    """One group as ``StateDictSource.open_group`` last handed it out."""

    names: Sequence[str]
    raws: list[torch.Tensor]
    ptrs: list[int]
    shapes: list[torch.Size]
    out: Mapping[str, torch.Tensor]
    generation: int  # ``StateDictSource.changed()`` calls before it


_shape = torch.Tensor.size  # ten times cheaper than the ``shape`` property through attrgetter
