"""Recorded copy programs: a fixed list of copies planned once and run again and again, on
CUDA replayed from a CUDA graph whose launches run side by side on a few branch streams.

The streams a capture uses come from a ``StreamPool`` that the program's owner passes in,
not from a process-wide table, so each engine owns its streams and its capture lock.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import torch

from vllm_dist.memory.copyplan import plan_copies

GRAPH_BRANCHES = 8  # side-by-side branches of a CopyProgram's CUDA graph

_P = TypeVar("_P", bound="CopyProgram")


# One graph capture at a time in a process, whichever pool's streams it uses: a capture in
# torch's default (global) mode fails when another thread captures or allocates meanwhile.
# A rule of CUDA, not bookkeeping, so it is the one lock every pool shares.
_CAPTURE_LOCK = threading.Lock()


class StreamPool:
    """The streams CUDA graph captures run on, per device: one capture stream and ``branches``
    branch streams, made once (taking them from torch's process-wide pool at each capture
    would walk through it). Captures hold the process's capture lock."""

    def __init__(self, branches: int = GRAPH_BRANCHES) -> None:
        if branches < 1:
            raise ValueError(f"a StreamPool needs at least one branch, got {branches}")
        self.branches = branches
        self._streams: dict[torch.device, list[torch.cuda.Stream]] = {}
        self._lock = threading.Lock()  # guards ``_streams``

    @contextlib.contextmanager
    def capturing(self, device: torch.device) -> Iterator[list[torch.cuda.Stream]]:
        """Hold the pool for one capture on ``device``: yields its capture stream followed by
        its branch streams (made at the first capture on ``device``)."""
        with _CAPTURE_LOCK:
            with self._lock:
                streams = self._streams.get(device)
                if streams is None:
                    count = 1 + self.branches
                    made = [torch.cuda.Stream(device) for _ in range(count)]
                    streams = self._streams[device] = made
            yield streams

    def devices(self) -> list[torch.device]:
        """The devices the pool has made streams for."""
        with self._lock:
            return list(self._streams)


def balance(sizes: list[int], branches: int) -> list[int]:
    """The branch (``0 <= b < branches``) of each of ``sizes``: largest first, each on the
    branch with the fewest bytes so far (ties: the lowest branch), so branches end together."""
    load = [0] * max(1, min(branches, len(sizes)))
    where = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        b = load.index(min(load))
        load[b] += sizes[i]
        where[i] = b
    return where


class CopyProgram:
    """A fixed list of copies (``dst.copy_(src)`` per pair), planned once (``plan_copies``)
    and run again and again.

    With ``streams`` on CUDA, the launches are recorded into a CUDA graph at the first ``run``
    on the pool's streams, spread over its branches balanced by bytes, so each later run
    costs one launch however many pairs it copies; without, they are launched one by one.
    The tensors must stay where they are while the program is used, and no destination may
    overlap another pair's destination or source (the pairs run in no given order).
    ``staging(nbytes)`` hands out the gathers' staging buffer (uint8, at least ``nbytes``) so
    that programs run one after another can share one; by default the program makes its own.
    """

    def __init__(
        self,
        dsts: list[torch.Tensor],
        srcs: list[torch.Tensor],
        *,
        streams: StreamPool | None = None,
        staging: Callable[[int], torch.Tensor] | None = None,
    ) -> None:
        # the storages the gathers see as raw address ranges: kept, so that a tensor re-pointed
        # by its owner (``t.data = ...``) leaves stale bytes behind, not freed memory
        self._owners: list[torch.UntypedStorage] = []
        self._solo, self._batches, self._gathers, device = plan_copies(dsts, srcs, self._owners)
        self._bind(staging, device)
        self._start(device, streams)

    @classmethod
    def merged(
        cls: type[_P], programs: Sequence[CopyProgram], *, streams: StreamPool | None = None
    ) -> _P:
        """One program that does what ``programs`` do, planned by none: their copies, batches
        and gathers (still bound to their staging buffers) put together, batches of one dtype
        joined. They must not be used at the same time as the merged one."""
        self = cls.__new__(cls)
        self._owners = [o for p in programs for o in p._owners]
        self._solo = [pair for p in programs for pair in p._solo]
        self._gathers = [g for p in programs for g in p._gathers]
        batches: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for p in programs:
            for dsts, srcs in p._batches:
                lists = batches.setdefault(dsts[0].dtype, ([], []))
                lists[0].extend(dsts)
                lists[1].extend(srcs)
        self._batches = list(batches.values())
        devices = [p._device for p in programs if p._device is not None]
        self._start(devices[0] if devices else None, streams)
        return self

    def _start(self, device: torch.device | None, streams: StreamPool | None) -> None:
        self._units = self._plan_units()
        self._device = device
        self._streams = streams if device is not None and device.type == "cuda" else None
        self._graph: torch.cuda.CUDAGraph | None = None
        self.graph_error: str | None = None  # why recording a graph failed, if it did

    def _bind(
        self, staging: Callable[[int], torch.Tensor] | None, device: torch.device | None
    ) -> None:
        """Give the gathers that stage a buffer per device (``staging``'s on ``device``)."""
        need: dict[torch.device, int] = {}
        for g in self._gathers:
            need[g.device] = max(need.get(g.device, 0), g.staging_bytes)
        for where, nbytes in need.items():
            if not nbytes:
                continue
            # the gathers of a device run one after another: one staging buffer serves them
            if staging is None or where != device:
                buffer = torch.empty(nbytes, dtype=torch.uint8, device=where)
            else:
                buffer = staging(nbytes)
            for gather in self._gathers:
                if gather.device == where:
                    gather.bind(buffer)

    @property
    def graphed(self) -> bool:
        """Whether ``run`` replays a CUDA graph."""
        return self._graph is not None

    def run(self) -> None:
        """Queue the copies on the current stream of their device (on the CPU: do them)."""
        if self._device is None or self._device.type != "cuda":
            self._launch()
            return
        with torch.cuda.device(self._device):  # a graph replays on the current device's stream
            if self._graph is None and self._streams is not None:
                self._record(self._streams)
            if self._graph is not None:
                self._graph.replay()
            else:
                self._launch()

    def _plan_units(self) -> list[tuple[int, Callable[[], object]]]:
        """(bytes, launch) of every unit of work; the gathers that stage, which share one
        staging buffer, are one unit."""
        units: list[tuple[int, Callable[[], object]]] = [
            (d.numel() * d.element_size(), functools.partial(d.copy_, s, non_blocking=True))
            for d, s in self._solo
        ]
        units += [(g.nbytes, g.run) for g in self._gathers if not g.staging_bytes]
        if any(g.staging_bytes for g in self._gathers):
            units.append((sum(g.nbytes for g in self._gathers if g.staging_bytes), self._staged))
        units += [
            (
                sum(d.numel() * d.element_size() for d in dsts),
                functools.partial(torch._foreach_copy_, dsts, srcs, non_blocking=True),
            )
            for dsts, srcs in self._batches
        ]
        return units

    def _staged(self) -> None:
        for gather in self._gathers:
            if gather.staging_bytes:
                gather.run()

    def _launch(self) -> None:
        for _, launch in self._units:
            launch()

    def _launch_branched(self, main: torch.cuda.Stream, spare: list[torch.cuda.Stream]) -> None:
        """Every unit on its branch of ``spare`` (``balance``); each branch forks from ``main``
        and joins it again, also when a launch fails (inside a graph capture, an unjoined fork
        would replace the launch's error with its own)."""
        where = balance([n for n, _ in self._units], len(spare))
        branches = spare[: 1 + max(where, default=-1)]
        for branch in branches:
            branch.wait_stream(main)
        try:
            for b, (_, launch) in zip(where, self._units, strict=True):
                with torch.cuda.stream(branches[b]):
                    launch()
        finally:
            for branch in branches:
                main.wait_stream(branch)

    def _record(self, pool: StreamPool) -> None:
        """Capture the launches into a CUDA graph on ``pool``'s streams; where that fails,
        warn once and launch them one by one from then on."""
        if self._device is None:
            return
        with pool.capturing(self._device) as streams:
            graph = torch.cuda.CUDAGraph()
            stream = streams[0]
            current = torch.cuda.current_stream(self._device)
            stream.wait_stream(current)
            try:
                with torch.cuda.stream(stream):
                    graph.capture_begin(capture_error_mode="thread_local")
                    try:
                        self._launch_branched(stream, streams[1:])
                    finally:
                        graph.capture_end()
            except Exception as exc:  # noqa: BLE001 - the copies still run, launched one by one
                self._streams = None
                self.graph_error = f"{type(exc).__name__}: {exc}"
                launches = (
                    len(self._solo) + len(self._batches) + sum(g.kernels for g in self._gathers)
                )
                warnings.warn(
                    f"recording {launches} copy launches into a CUDA "
                    f"graph failed ({self.graph_error}); they are launched one by one instead",
                    RuntimeWarning,
                    stacklevel=3,
                )
                return
            finally:
                current.wait_stream(stream)
            self._graph = graph

    def close(self) -> None:
        self._graph = None
        self._solo, self._batches, self._gathers, self._units = [], [], [], []
        self._owners = []
