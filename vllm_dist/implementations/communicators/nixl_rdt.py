"""NixlRdtCommunicator: point-to-point and one-sided transfers between workers over NIXL agents.

One NIXL agent per worker. Agents meet through the coordinator (``all_gather_object`` of their
metadata at construction), so there is no extra port and no etcd. Memory is registered once per
tensor storage and cached (the cache holds the storage, so its address cannot be reused while the
registration lives); registrations, transfer handles and remote agents are released on ``close()``.

Two-sided ``send`` / ``recv`` are receiver-announced WRITEs: the receiver registers its buffer and
sends the sender a "ready" notification (address, size and, the first time, the registration's
metadata); the sender WRITEs into it with a "done" notification attached, which NIXL delivers
after the bytes. Rejected alternative: sender-exposed READ. It needs the same two messages, and
UCX's ``cuda_ipc`` transport disables GET (READ) when it sees no NVLink, silently falling back to
TCP (about 0.55 GB/s on one H200 against about 2 TB/s), while PUT (WRITE) stays on CUDA IPC.

One-sided ``read`` / ``write`` use buffers a peer ``expose``-d under a name; the peer's code does
not take part. Descriptors reach peers through ``exchange_exposed()`` (a collective) or out of band
(``ExposedBuffer`` is picklable: hand it over a Ray call and ``import_exposed`` it). Every request
may carry many descriptors; ``read_async`` / ``write_async`` return a ``NixlTransfer`` to ``wait``.

For VRAM between processes on one node, ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y`` is set before the agent
is created unless the user set it, so READ also stays on CUDA IPC. UCX's cuda_ipc moves the bytes
with the copy engine, about half of what an SM copy reaches on one H200, so one-sided transfers to
an exposed buffer on the same node go further: the exposer ships a CUDA IPC handle with its
descriptor, and the peer copies with a kernel on the mapping (``cuda_ipc`` option; on by default,
``describe()["last_xfer_backend"]`` says which path carried the last request). DRAM buffers do the
same through shared memory (``shared_memory`` option): a peer on the node maps an exposed tensor
whose storage is in shared memory (``share_memory_()``, ``shared_empty``) through the owner's file
descriptor (``/proc/<pid>/fd``) and copies with ``memcpy``: a strided view of a peer's weights, or
a thousand small ones, then cost their bytes instead of a NIXL descriptor each. ``expose`` never
moves a storage (that would free memory that copies planned earlier still address). Every wait is bounded by the
``timeout`` option: a dead peer gives ``NixlTimeoutError`` (or ``NixlTransferError`` when UCX sees
the endpoint fail), never a hang.

Ray Direct Transport (``tensor_transport="nixl"``) helpers are at the bottom, guarded by
``check_ray_rdt_version()``. Ray's NIXL transport is pull-based (the receiver READs), which is why
two actors sharing one GPU hit the TCP fallback above and ran into Ray's fetch timeout; the
helpers set the same UCX variable in the actor before Ray creates its agent, and bound every fetch.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import threading
import time
import uuid
from collections import OrderedDict, defaultdict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from vllm_dist.implementations.communicators.common import (
    CopyProgram,
    check_tensor,
    default_device,
    widest_views,
)
from vllm_dist.interfaces import CommOp, DeviceCommunicator, ReduceOp, WorkerCoordinator
from vllm_dist.versions import (  # noqa: F401 - re-exported for the RDT helpers' callers
    RDT_MIN_RAY_VERSION,
    RayRdtUnavailableError,
    check_ray_rdt_version,
)

if TYPE_CHECKING:
    from nixl._api import nixl_agent, nixl_xfer_handle

INSTALL_HINT = "pip install 'vllm_dist[nixl]'"
CUDA_IPC_GET_ZCOPY = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"

# notification kinds (first byte); the rest is a pickled payload
_READY, _DONE, _ERROR, _USER = b"R", b"D", b"E", b"U"
_BATCH_COPY_BYTES = 1 << 20  # CUDA IPC pieces below this share one batched copy launch
_MAX_PREPARED = 1 << 16  # CUDA IPC copy views kept for reuse (a weight sync repeats its reads)
_MAX_RUNS = 1 << 20  # descriptors one strided read may take through NIXL


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


class NixlTransferError(RuntimeError):
    """A NIXL transfer failed (the peer died, the endpoint broke, or the request was invalid)."""


class NixlTimeoutError(NixlTransferError, TimeoutError):
    """A transfer or a peer's message did not complete within the timeout (peer slow or dead)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class NixlOptions:
    """Options of ``NixlRdtCommunicator`` (pass them as keywords to the constructor).

    Args:
        timeout: seconds any single wait may take (peer message or transfer); a bound, not a
            target. Per-call ``timeout=`` arguments override it.
        backends: NIXL backends to create.
        max_cached_registrations: registrations of non-exposed tensors kept for reuse; the least
            recently used unpinned one is released beyond this.
        num_threads: worker threads of the UCX backend (0 = NIXL's default).
        progress_delay_us: the poll delay of NIXL's progress thread. None (auto): 1 on DRAM,
            0 on VRAM. 0 makes the thread busy-poll a whole core (what ``nixl_agent`` always
            does); any positive value lets it sleep in ``poll()`` until UCX has work (NIXL
            rounds it up to 1 ms as a fallback wake-up). On the 2-core CPU machine the spinning
            threads took the core the copy needs: 1 GiB one-sided DRAM moved at about 4 GB/s
            with 0 and about 5.9 GB/s with 1, and 4 KiB latency did not get worse.
        cuda_ipc: one-sided READ/WRITE of an exposed VRAM buffer on the same node run as copy
            kernels on a CUDA IPC mapping (measured on one H200 at 1 GiB: about 0.92x of an
            in-process copy, against about 0.5x through UCX's cuda_ipc). NIXL still carries every
            notification and every other transfer; send/recv stay on NIXL because mapping a fresh
            receive buffer per message costs more (about 0.4 ms) than it saves.
        cuda_graphs: ``prepare_reads`` on CUDA IPC mappings records its copies into a CUDA
            graph at the first post and replays it: one launch for hundreds of weights instead
            of a few µs of launch per copy kernel.
        shared_memory: one-sided READ/WRITE of an exposed DRAM buffer of a process on the same
            node run as ``memcpy`` on a mapping of it, where the buffer's storage is in shared
            memory (``tensor.share_memory_()``, ``model.share_memory()``, ``shared_empty``);
            any other buffer goes through NIXL.
    """

    timeout: float = 120.0
    backends: tuple[str, ...] = ("UCX",)
    max_cached_registrations: int = 64
    num_threads: int = 0
    progress_delay_us: int | None = None
    cuda_ipc: bool = True
    cuda_graphs: bool = True
    shared_memory: bool = True

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ValueError(f"timeout must be positive seconds, got {self.timeout!r}")
        if not self.backends:
            raise ValueError("backends must name at least one NIXL backend, e.g. ('UCX',)")
        if self.progress_delay_us is not None and self.progress_delay_us < 0:
            raise ValueError(f"progress_delay_us must be >= 0, got {self.progress_delay_us}")
        if self.max_cached_registrations < 1:
            raise ValueError(
                f"max_cached_registrations must be >= 1, got {self.max_cached_registrations}"
            )


@dataclass(frozen=True, kw_only=True, slots=True)
class ExposedBuffer:
    """A registered buffer that peers may read and write: picklable, safe to send anywhere.

    ``metadata`` is the owner's full agent metadata at ``epoch`` (its registration generation);
    importing it lets the importer address ``[addr, addr + nbytes)`` on the owner.
    """

    rank: int
    name: str
    agent: str
    addr: int
    nbytes: int
    device_id: int
    mem_type: str
    epoch: int
    metadata: bytes = field(repr=False)
    mapping: Any = field(default=None, repr=False)  # CudaIpcHandle / SharedMemoryHandle: same node


@dataclass(frozen=True, kw_only=True, slots=True)
class CudaIpcHandle:
    """What a process on the same node needs to map a VRAM buffer (torch's CUDA IPC reduction)."""

    node: str  # boot id + host name: IPC handles mean nothing on another node
    device_uuid: str
    rebuild: Any  # torch.multiprocessing.reductions.reduce_tensor(...) of the flat byte view

    @staticmethod
    def of(tensor: torch.Tensor) -> CudaIpcHandle:
        from torch.multiprocessing.reductions import reduce_tensor

        flat = tensor.detach().reshape(-1).view(torch.uint8)
        return CudaIpcHandle(
            node=_node_id(),
            device_uuid=str(torch.cuda.get_device_properties(tensor.device).uuid),
            rebuild=reduce_tensor(flat),
        )

    def open(self) -> torch.Tensor | None:
        """The peer's buffer as a flat uint8 tensor here, or None when it cannot be mapped."""
        if self.node != _node_id():
            return None
        local = _local_device_index(self.device_uuid)
        if local is None:
            return None
        fn, args = self.rebuild
        args = list(args)
        args[6] = local  # the exporter's device index, renumbered for this process's visibility
        return fn(*args)  # type: ignore[no-any-return]


@dataclass(frozen=True, kw_only=True, slots=True)
class SharedMemoryHandle:
    """What a process on the same node needs to map a DRAM buffer whose storage is in shared
    memory: the owner's file descriptor of the shared-memory object, opened through ``/proc``
    (the object is unlinked, so it lives exactly as long as its owner's storage and mappings)."""

    node: str
    pid: int
    fd: int
    inode: tuple[int, int]  # (st_dev, st_ino): a reused fd number is not mistaken for it
    size: int  # the storage's bytes
    offset: int  # the buffer's byte offset in the storage
    nbytes: int

    @staticmethod
    def of(tensor: torch.Tensor) -> SharedMemoryHandle | None:
        """The handle of ``tensor``'s storage; None when it is not in shared memory."""
        storage = tensor.untyped_storage()
        if not (storage.nbytes() and storage.is_shared()):
            return None
        try:
            fd, size = storage._share_fd_cpu_()
            st = os.fstat(fd)
        except (RuntimeError, OSError, AttributeError):  # e.g. shared by file name
            return None
        return SharedMemoryHandle(
            node=_node_id(),
            pid=os.getpid(),
            fd=fd,
            inode=(st.st_dev, st.st_ino),
            size=size,
            offset=tensor.data_ptr() - storage.data_ptr(),
            nbytes=tensor.numel() * tensor.element_size(),
        )

    def open(self) -> torch.Tensor | None:
        """The buffer as a flat uint8 tensor mapped here, or None when it cannot be mapped."""
        if self.node != _node_id():
            return None
        try:
            fd = os.open(f"/proc/{self.pid}/fd/{self.fd}", os.O_RDWR)
        except OSError:  # gone, or another PID namespace: NIXL still works
            return None
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != self.inode or st.st_size < self.size:
                return None
            storage = torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", True, self.size)
        except (OSError, RuntimeError):
            return None
        finally:
            os.close(fd)  # the mapping keeps the object
        whole = torch.empty(0, dtype=torch.uint8)
        whole.set_(storage, 0, (self.size,), (1,))  # type: ignore[arg-type]
        return whole[self.offset : self.offset + self.nbytes]


def _node_id() -> str:
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _local_device_index(uuid_text: str) -> int | None:
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid_text:
            return i
    return None


@dataclass(eq=False)
class _Registration:
    storage: Any  # the tensor storage: keeps the registered memory alive
    descs: Any  # nixlRegDList
    base: int
    nbytes: int
    device_id: int
    mem_type: str
    pinned: int = 0  # exposures of this storage
    inflight: int = 0  # transfers using it now
    shared_with: set[int] = field(default_factory=set)  # ranks that loaded its metadata


_AGENT_LOCK = threading.Lock()


def _new_agent(api: Any, name: str, config: Any, delay_us: int) -> Any:
    """``api.nixl_agent(name, config)`` with the progress thread's poll delay set.

    ``nixl_agent.__init__`` builds its ``nixlAgentConfig`` itself and hard-codes
    ``pthrDelay = 0``; for the length of the call the binding's config class is swapped for a
    subclass that turns that 0 into ``delay_us`` (under a lock: one agent is built at a time).
    """
    bind = api.nixlBind
    base = bind.nixlAgentConfig
    if delay_us == 0:
        return api.nixl_agent(name, config)
    field_ = base.pthrDelay

    class _Config(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:  # noqa: N802 - the binding's name
            return int(field_.__get__(self))

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:  # noqa: N802
            field_.__set__(self, delay_us if value == 0 else value)

    with _AGENT_LOCK:
        bind.nixlAgentConfig = _Config
        try:
            return api.nixl_agent(name, config)
        finally:
            bind.nixlAgentConfig = base


def _load_nixl() -> Any:
    try:
        from nixl import _api
    except ImportError as exc:
        raise ImportError(
            f"the NIXL_RDT communicator needs the nixl package ({exc}); install it with: "
            f"{INSTALL_HINT}"
        ) from exc
    return _api


@contextlib.contextmanager
def _nixl_errors(what: str) -> Iterator[None]:
    """Turn the binding's own exceptions (``nixlRemoteDisconnectError``, ...) into ours."""
    try:
        yield
    except Exception as exc:
        if type(exc).__module__.split(".")[0] not in ("nixl", "nixl_cu12", "nixl_cu13"):
            raise
        raise NixlTransferError(f"{what}: {type(exc).__name__}: {exc}") from exc


def _mem_type(device: torch.device) -> str:
    return "VRAM" if device.type == "cuda" else "DRAM"


def _device_id(t: torch.Tensor) -> int:
    return max(t.get_device(), 0)


class NixlTransfer:
    """An issued NIXL request. ``wait(timeout)`` blocks (bounded); ``done()`` polls.

    Errors surface from ``wait``/``done`` as ``NixlTransferError`` / ``NixlTimeoutError``. The
    handle is released as soon as the request finishes or fails.
    """

    def __init__(
        self,
        comm: NixlRdtCommunicator,
        handle: nixl_xfer_handle | None,
        regs: list[_Registration],
        what: str,
    ) -> None:
        self._comm = comm
        self._handle: nixl_xfer_handle | None = handle
        self._regs = regs
        self._what = what
        self._error: BaseException | None = None

    def done(self) -> bool:
        """True once the bytes have landed; raises if the transfer failed."""
        if self._error is not None:
            raise self._error
        if self._handle is None:
            return True
        try:
            with _nixl_errors(self._what):
                state = self._comm._agent_ref().check_xfer_state(self._handle)
        except NixlTransferError as exc:
            self._fail(exc)
            raise
        if state == "PROC":
            return False
        if state == "DONE":
            self._finish()
            return True
        self._fail(NixlTransferError(f"{self._what} failed (NIXL state {state})"))
        raise self._error  # type: ignore[misc]

    def wait(self, timeout: float | None = None) -> None:
        """Block until done, at most ``timeout`` s (default: the communicator's timeout)."""
        deadline = time.monotonic() + self._comm._timeout(timeout)
        poll = _Backoff(self._comm._spin_s)
        while not self.done():
            if time.monotonic() > deadline:
                self._fail(
                    NixlTimeoutError(
                        f"{self._what} did not complete within {self._comm._timeout(timeout)} s; "
                        "the peer may be dead or overloaded (raise the 'timeout' option if not)"
                    )
                )
                raise self._error  # type: ignore[misc]
            poll.sleep()

    def _finish(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            self._comm._release_xfer(handle, self._regs)

    def _fail(self, error: BaseException) -> None:
        self._error = error
        handle, self._handle = self._handle, None
        if handle is not None:
            self._comm._release_xfer(handle, self._regs, failed=True)


class _CopyTransfer(NixlTransfer):
    """A same-node transfer done by copies on a mapping: CUDA IPC (done when ``event`` is) or
    shared memory (``event`` None: the copies ran before it was made)."""

    def __init__(
        self, comm: NixlRdtCommunicator, event: torch.cuda.Event | None, what: str
    ) -> None:
        super().__init__(comm, None, [], what)
        self._event: torch.cuda.Event | None = event
        self._what = what

    def done(self) -> bool:
        if self._event is None or self._event.query():
            self._event = None
            return True
        return False

    def wait(self, timeout: float | None = None) -> None:
        seconds = self._comm._timeout(timeout)
        deadline = time.monotonic() + seconds
        poll = _Backoff(self._comm._spin_s)
        while not self.done():
            if time.monotonic() > deadline:
                raise NixlTimeoutError(f"{self._what} did not complete within {seconds} s")
            poll.sleep()


class PreparedReads:
    """A set of READs from one peer laid out once (``prepare_reads``); ``post`` starts them.

    One post at a time: wait for a post's transfer before the next. ``close`` releases what the
    set holds (a NIXL request, a CUDA graph); it is idempotent.
    """

    def __init__(self, comm: NixlRdtCommunicator, peer: int, what: str) -> None:
        self._comm = comm
        self._peer = peer
        self._what = what
        self._last: NixlTransfer | None = None
        self.posts = 0

    def post(self) -> NixlTransfer:
        """Start the reads; returns a transfer to ``wait`` for."""
        if self._last is not None and not _settled(self._last):
            raise RuntimeError(f"{self._what}: posted again while the last post is in flight")
        self._last = self._post()
        self.posts += 1
        return self._last

    def _post(self) -> NixlTransfer:
        raise NotImplementedError

    @property
    def graphed(self) -> bool:
        """Whether posts replay a CUDA graph (see ``NixlOptions.cuda_graphs``)."""
        return False

    def close(self) -> None:  # noqa: B027 - nothing to release by default
        """Release what the set holds."""


def _settled(xfer: NixlTransfer) -> bool:
    """Whether ``xfer`` is over, landed or failed (its waiter saw the error)."""
    try:
        return xfer.done()
    except NixlTransferError:
        return True


def _typed(mapped: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """``mapped`` (uint8) seen as ``dtype`` whole, or None where its size or offset forbid."""
    try:
        return mapped.view(dtype)
    except RuntimeError:
        return None


class _PreparedCopies(PreparedReads):
    """Copies on mappings, one ``CopyProgram`` (on CUDA IPC a CUDA graph at the first post)."""

    def __init__(
        self,
        comm: NixlRdtCommunicator,
        peer: int,
        copies: list[tuple[torch.Tensor, torch.Tensor, int]],
        *,
        graphs: bool,
    ) -> None:
        super().__init__(comm, peer, f"prepared READ of rank {peer}'s buffers {comm._map_via}")
        pairs = [(d, s) for d, s, n in copies if n]  # byte views are sliced to n already
        self._program = CopyProgram([d for d, _ in pairs], [s for _, s in pairs], graph=graphs)

    @classmethod
    def merged(
        cls, comm: NixlRdtCommunicator, peer: int, sets: list[_PreparedCopies], *, graphs: bool
    ) -> _PreparedCopies:
        """One set of what ``sets`` copy, planned by none (``CopyProgram.merged``)."""
        self = cls.__new__(cls)
        PreparedReads.__init__(self, comm, peer, sets[0]._what)
        self._program = CopyProgram.merged([p._program for p in sets], graph=graphs)
        return self

    def _post(self) -> NixlTransfer:
        self._program.run()
        return self._comm._copied(self._what)

    @property
    def graphed(self) -> bool:
        return self._program.graphed

    @property
    def graph_error(self) -> str | None:
        return self._program.graph_error

    def close(self) -> None:
        self._program.close()


class _PreparedBoth(PreparedReads):
    """Reads of one peer's unmapped buffers (a NIXL request) and of its mapped ones (copies),
    posted together: the request first, so that the copies run while it is in flight."""

    def __init__(self, comm: NixlRdtCommunicator, peer: int, sets: list[PreparedReads]) -> None:
        super().__init__(comm, peer, " and ".join(p._what for p in sets))
        self._sets = sets

    def _post(self) -> NixlTransfer:
        started: list[NixlTransfer] = []
        try:
            for prepared in self._sets:
                started.append(prepared.post())
        except BaseException:
            for xfer in started:  # nothing may still write into the caller's tensors
                with contextlib.suppress(NixlTransferError):
                    xfer.wait()
            raise
        return _JoinedTransfer(self._comm, started, self._what)

    @property
    def graphed(self) -> bool:
        return any(p.graphed for p in self._sets)

    def close(self) -> None:
        for prepared in self._sets:
            prepared.close()


class _JoinedTransfer(NixlTransfer):
    """Several transfers that are done when all of them are."""

    def __init__(self, comm: NixlRdtCommunicator, parts: list[NixlTransfer], what: str) -> None:
        super().__init__(comm, None, [], what)
        self._parts = parts

    def done(self) -> bool:
        return all([part.done() for part in self._parts])  # each polled: errors surface

    def wait(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + self._comm._timeout(timeout)
        for part in self._parts:
            part.wait(max(deadline - time.monotonic(), 1e-3))


class _PreparedXfer(PreparedReads):
    """One NIXL request built once and reposted; rebuilt when the peer's metadata changed."""

    def __init__(
        self,
        comm: NixlRdtCommunicator,
        peer: int,
        pieces: list[tuple[torch.Tensor, int, int, ExposedBuffer]],
    ) -> None:
        names = sorted({p[3].name for p in pieces})
        more = " ..." if len(names) > 3 else ""
        super().__init__(
            comm, peer, f"prepared READ of {', '.join(map(repr, names[:3]))}{more} on rank {peer}"
        )
        self._pieces = [p for p in pieces if p[2] > 0]
        self._handle: nixl_xfer_handle | None = None
        self._regs: list[_Registration] = []
        self._epoch = -1

    def _build(self) -> None:
        comm = self._comm
        agent = comm._agent_ref()
        local = np.empty((len(self._pieces), 3), dtype=np.uint64)
        remote = np.empty((len(self._pieces), 3), dtype=np.uint64)
        regs = []
        for i, (view, off, n, r) in enumerate(self._pieces):
            reg = comm._register(view)
            reg.inflight += 1  # not evicted by the registrations that follow
            regs.append(reg)
            local[i] = (view.data_ptr(), n, _device_id(view))
            remote[i] = (r.addr + off, n, r.device_id)
        try:
            with _nixl_errors(f"{self._what}: creating the request"):
                self._handle = agent.initialize_xfer(
                    "READ",
                    agent.get_xfer_descs(local, _mem_type(comm._device)),
                    agent.get_xfer_descs(remote, self._pieces[0][3].mem_type),
                    comm._peer_agent[self._peer],
                    b"",
                )
        except BaseException:
            for reg in regs:
                reg.inflight -= 1
            raise
        comm._live_xfers += 1
        self._regs = regs
        self._epoch = comm._known_epoch[self._peer]

    def _post(self) -> NixlTransfer:
        comm = self._comm
        if not self._pieces:
            return NixlTransfer(comm, None, [], self._what)
        if self._handle is not None and self._epoch != comm._known_epoch[self._peer]:
            self.close()  # the peer's metadata was reloaded: descriptors must be resolved again
        if self._handle is None:
            self._build()
        if comm._device.type == "cuda":
            torch.cuda.current_stream(comm._device).synchronize()  # the bytes must exist first
        agent = comm._agent_ref()
        xfer = _RepostedTransfer(comm, self._handle, self._what, self)
        try:
            with _nixl_errors(f"{self._what}: posting"):
                state = agent.transfer(self._handle)
        except NixlTransferError as exc:
            xfer._fail(exc)
            raise
        if state == "ERR":
            xfer._fail(NixlTransferError(f"{self._what} could not be posted (NIXL state ERR)"))
        return xfer

    def close(self) -> None:
        last = self._last
        if isinstance(last, _RepostedTransfer) and last._handle is not None:
            # a post still in flight: it fails (its waiter is told) instead of polling a
            # released request; releasing an in-flight request keeps its memory registered
            last._error = NixlTransferError(f"{self._what}: closed while the reads were in flight")
            last._handle = None
        handle, self._handle = self._handle, None
        regs, self._regs = self._regs, []
        if handle is not None and self._comm._agent is not None:
            self._comm._release_xfer(handle, regs)


class _RepostedTransfer(NixlTransfer):
    """One post of a ``_PreparedXfer``: finishing keeps the request for the next post."""

    def __init__(
        self, comm: NixlRdtCommunicator, handle: Any, what: str, owner: _PreparedXfer
    ) -> None:
        super().__init__(comm, handle, [], what)
        self._owner = owner

    def _finish(self) -> None:
        self._handle = None

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._handle = None
        self._owner.close()  # a failed request is not posted again: the next post rebuilds it


class _Backoff:
    """Spin for the first few ms, then sleep in short pauses that grow only for long waits.

    A sleep that overshoots a transfer's end is pure loss on the bandwidth a caller sees (a 1 GiB
    VRAM copy takes about 0.5 ms), so pauses stay at 20 µs for the first 100 ms of a wait and
    reach 1 ms only for waits long enough that a dead peer is the likely reason.

    On DRAM (``spin_s`` 0) the waiter does not spin at all, and its pauses grow with the wait,
    a twentieth of it (20 µs to 1 ms): a poll costs CPU time of its own, and on a machine with
    few cores the waiters take it from the processes moving the bytes (measured on 2 cores: a
    producer waiting out its consumers' 70 ms reads in 20 µs pauses used a third of a core
    they needed). A pause then overshoots the end by at most 5% of the wait, or 20 µs.
    """

    def __init__(self, spin_s: float) -> None:
        self._start = time.monotonic()
        self._spin_s = spin_s

    def sleep(self) -> None:
        waited = time.monotonic() - self._start
        if waited < self._spin_s:
            return
        if not self._spin_s:
            time.sleep(min(1e-3, max(20e-6, waited / 20)))
            return
        time.sleep(20e-6 if waited < 0.1 else 1e-3)


class NixlRdtCommunicator(DeviceCommunicator):
    """Point-to-point and one-sided transfers over one NIXL agent per worker.

    Args:
        coordinator: an initialized coordinator of the group (any implementation).
        device: where tensors live; None = ``cuda:<local rank>`` with CUDA, else CPU.
        **options: fields of ``NixlOptions`` (``timeout``, ``backends``, ...).

    Not thread-safe: use one communicator from one thread.
    """

    supported_ops: ClassVar[frozenset[CommOp]] = frozenset(
        {CommOp.SEND, CommOp.RECV, CommOp.READ, CommOp.WRITE}
    )

    def __init__(
        self,
        coordinator: WorkerCoordinator,
        device: torch.device | str | None = None,
        **options: Any,
    ) -> None:
        self._opts = NixlOptions(**options)
        self._api = _load_nixl()
        self._coord = coordinator
        self._device = default_device(coordinator, device)
        self._rank = coordinator.get_rank()
        self._world = coordinator.get_world_size()
        self._set_ucx_env = False
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
            if CUDA_IPC_GET_ZCOPY not in os.environ:  # the user's own UCX settings win
                os.environ[CUDA_IPC_GET_ZCOPY] = "y"
                self._set_ucx_env = True
        name = f"vllm_dist-r{coordinator.get_global_ranks()[self._rank]}-{uuid.uuid4().hex[:12]}"
        config = self._api.nixl_agent_config(
            enable_prog_thread=True,  # a target makes progress without calling us (one-sided)
            backends=list(self._opts.backends),
            num_threads=self._opts.num_threads,
        )
        delay = self._opts.progress_delay_us
        self._progress_delay_us = (
            (0 if self._device.type == "cuda" else 1) if delay is None else delay
        )
        self._agent: nixl_agent | None = _new_agent(
            self._api, name, config, self._progress_delay_us
        )
        self._name = name
        self._regs: OrderedDict[tuple[str, int], _Registration] = OrderedDict()
        self._exposed: dict[str, tuple[ExposedBuffer, _Registration]] = {}
        self._remote_exposed: dict[int, dict[str, ExposedBuffer]] = defaultdict(dict)
        self._epoch = 0  # bumped whenever a registration is released
        self._known_epoch: dict[int, int] = {}  # peer rank -> epoch of its metadata we loaded
        self._shared_epoch: dict[int, int] = {}  # peer rank -> our epoch it has loaded
        self._send_seq: defaultdict[int, itertools.count[int]] = defaultdict(itertools.count)
        self._recv_seq: defaultdict[int, itertools.count[int]] = defaultdict(itertools.count)
        self._inbox: dict[tuple[int, bytes, int], Any] = {}
        self._user_msgs: defaultdict[int, deque[bytes]] = defaultdict(deque)
        self._live_xfers = 0
        self._graveyard: list[tuple[nixl_xfer_handle, list[_Registration]]] = []
        self._last_backend = ""
        self._maps: dict[tuple[int, str, int], torch.Tensor | None] = {}
        # (peer, op, remote name, addr, offset, nbytes, local ptr) -> prepared IPC copy views of
        # exposed local memory (never of a caller's temporary tensors: that would keep them)
        self._prepared: dict[tuple[Any, ...], Any] = {}
        cuda = self._device.type == "cuda"
        self._use_maps = self._opts.cuda_ipc if cuda else self._opts.shared_memory
        self._map_backend = "cuda_ipc" if cuda else "shared_memory"
        self._map_via = "through CUDA IPC" if cuda else "through shared memory"
        self._spin_s = 0.002 if self._device.type == "cuda" else 0.0  # see _Backoff
        self._connect()

    # -- set-up ------------------------------------------------------------------------------
    def _connect(self) -> None:
        agent = self._agent_ref()
        everyone = self._coord.all_gather_object((self._name, agent.get_agent_metadata()))
        self._peer_agent: dict[int, str] = {}
        self._agent_rank: dict[str, int] = {}
        for rank, (name, md) in enumerate(everyone):
            self._agent_rank[name] = rank
            if rank == self._rank:
                continue
            agent.add_remote_agent(md)
            self._peer_agent[rank] = name
            self._known_epoch[rank] = 0
            self._shared_epoch[rank] = 0

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def agent_name(self) -> str:
        return self._name

    # -- collectives: not this backend's job -------------------------------------------------
    def all_reduce(
        self,
        tensor_in: torch.Tensor,
        tensor_out: torch.Tensor | None = None,
        op: ReduceOp = ReduceOp.SUM,
    ) -> torch.Tensor:
        raise self._unsupported(CommOp.ALL_REDUCE)

    def all_gather(
        self, tensor_in: torch.Tensor, tensor_out: torch.Tensor | None = None
    ) -> torch.Tensor:
        raise self._unsupported(CommOp.ALL_GATHER)

    def reduce_scatter(
        self,
        tensor_in: torch.Tensor,
        tensor_out: torch.Tensor | None = None,
        op: ReduceOp = ReduceOp.SUM,
    ) -> torch.Tensor:
        raise self._unsupported(CommOp.REDUCE_SCATTER)

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        raise self._unsupported(CommOp.BROADCAST)

    def _unsupported(self, op: CommOp) -> Exception:
        from vllm_dist.registry import unsupported_operation  # lazy: implementations sit below it

        return unsupported_operation(type(self), op)

    # -- two-sided ---------------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int, *, timeout: float | None = None) -> None:
        """Send ``tensor`` to ``dst`` (matched by order with ``recv``): WRITE into its buffer."""
        check_tensor(tensor, self._device)
        self._check_peer(dst)
        seq = next(self._send_seq[dst])
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            return
        deadline = time.monotonic() + self._timeout(timeout)
        ready = self._wait_msg(dst, _READY, seq, deadline, f"recv #{seq} posted by rank {dst}")
        addr, remote_nbytes, dev_id, mem_type, epoch, md, full = ready
        if md:
            self._load_remote(dst, md, epoch, full=full)
        if remote_nbytes != nbytes:
            msg = f"send #{seq} to rank {dst} has {nbytes} bytes but the recv has {remote_nbytes}"
            self._notify(dst, _ERROR, (seq, msg))
            raise ValueError(msg + "; shapes and dtypes of a send/recv pair must match")
        xfer = self._post(
            "WRITE",
            dst,
            [(tensor, addr, nbytes, dev_id)],
            remote_mem=mem_type,
            notif=_DONE + pickle.dumps(seq),
            what=f"send #{seq} to rank {dst}",
        )
        xfer.wait(max(0.0, deadline - time.monotonic()))

    def recv(self, tensor: torch.Tensor, src: int, *, timeout: float | None = None) -> torch.Tensor:
        """Receive the next ``send`` from ``src`` into ``tensor``; returns it."""
        check_tensor(tensor, self._device)
        self._check_peer(src)
        seq = next(self._recv_seq[src])
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            return tensor
        deadline = time.monotonic() + self._timeout(timeout)
        reg = self._register(tensor)
        reg.inflight += 1
        try:
            md, full = self._metadata_for(src, reg)
            ready = (tensor.data_ptr(), nbytes, reg.device_id, reg.mem_type, self._epoch, md, full)
            self._notify(src, _READY, (seq, *ready))
            what = f"send #{seq} from rank {src}"
            self._wait_msg(src, _DONE, seq, deadline, what, error_kind=_ERROR)
        finally:
            reg.inflight -= 1
        return tensor

    # -- one-sided ---------------------------------------------------------------------------
    def expose(self, tensor: torch.Tensor, name: str) -> ExposedBuffer:
        """Register ``tensor`` under ``name`` so peers may ``read``/``write`` it; local only.

        Peers learn of it through ``exchange_exposed()`` or by ``import_exposed`` of the returned
        descriptor. The tensor stays registered (and alive) until ``unexpose(name)`` or ``close()``.

        Raises:
            ValueError: ``name`` is already exposed, or the tensor is on the wrong device.
        """
        check_tensor(tensor, self._device)
        if name in self._exposed:
            raise ValueError(f"a buffer is already exposed as {name!r}; unexpose it first")
        reg = self._register(tensor)
        reg.pinned += 1
        desc = ExposedBuffer(
            rank=self._rank,
            name=name,
            agent=self._name,
            addr=tensor.data_ptr(),
            nbytes=tensor.numel() * tensor.element_size(),
            device_id=reg.device_id,
            mem_type=reg.mem_type,
            epoch=self._epoch,
            metadata=self._agent_ref().get_agent_metadata(),
            mapping=self._map_handle(tensor),
        )
        self._exposed[name] = (desc, reg)
        return desc

    def _map_handle(self, tensor: torch.Tensor) -> CudaIpcHandle | SharedMemoryHandle | None:
        """What a same-node peer needs to map ``tensor`` (None: peers go through NIXL)."""
        if not self._use_maps:
            return None
        return CudaIpcHandle.of(tensor) if tensor.is_cuda else SharedMemoryHandle.of(tensor)

    def unexpose(self, name: str) -> None:
        """Stop exposing ``name``; its registration is released once nothing else uses it."""
        try:
            _, reg = self._exposed.pop(name)
        except KeyError:
            known = sorted(self._exposed)
            raise ValueError(f"nothing is exposed as {name!r}; exposed: {known}") from None
        reg.pinned -= 1
        self._prepared.clear()  # cached copy views may hold the released memory
        self._evict()

    def exchange_exposed(self) -> dict[int, dict[str, ExposedBuffer]]:
        """Collective: every member learns every other member's exposed buffers.

        Returns ``{rank: {name: ExposedBuffer}}`` of the peers (this rank excluded).
        """
        mine = [desc for desc, _ in self._exposed.values()]
        md = self._agent_ref().get_agent_metadata()
        gathered = self._coord.all_gather_object((self._epoch, md, mine))
        for rank, (epoch, peer_md, descs) in enumerate(gathered):
            if rank == self._rank:
                continue
            self._load_remote(rank, peer_md, epoch, full=True)
            self._remote_exposed[rank] = {d.name: d for d in descs}
            self._shared_epoch[rank] = self._epoch
        for reg in self._regs.values():
            reg.shared_with.update(self._peer_agent)
        return {r: dict(d) for r, d in self._remote_exposed.items()}

    def import_exposed(self, desc: ExposedBuffer) -> None:
        """Make a peer's ``ExposedBuffer`` (received out of band) addressable by ``read``/``write``.

        Raises:
            ValueError: the descriptor is from this worker, from an agent that is not a member of
                this group, or older than metadata already loaded from that peer.
        """
        rank = self._agent_rank.get(desc.agent)
        if rank is None or rank == self._rank:
            raise ValueError(
                f"{desc.name!r} belongs to agent {desc.agent!r}, which is not a peer of this "
                f"communicator (peers: {sorted(self._peer_agent.values())})"
            )
        self._load_remote(rank, desc.metadata, desc.epoch, full=True)
        self._remote_exposed[rank][desc.name] = desc

    def read(
        self,
        peer: int,
        remote_name: str,
        local: torch.Tensor,
        remote_offset: int = 0,
        *,
        timeout: float | None = None,
    ) -> torch.Tensor:
        """Copy ``local.nbytes`` bytes at ``remote_offset`` of the peer's buffer into ``local``."""
        self.read_async(peer, remote_name, local, remote_offset).wait(timeout)
        return local

    def write(
        self,
        peer: int,
        remote_name: str,
        local: torch.Tensor,
        remote_offset: int = 0,
        *,
        notify: bytes | None = None,
        timeout: float | None = None,
    ) -> None:
        """Copy ``local`` into the peer's buffer at ``remote_offset``.

        ``notify``: bytes delivered to the peer after the data (see ``wait_notification``).
        """
        self.write_async(peer, remote_name, local, remote_offset, notify=notify).wait(timeout)

    def read_async(
        self,
        peer: int,
        remote_name: str,
        local: torch.Tensor | Sequence[tuple[torch.Tensor, int, int]],
        remote_offset: int = 0,
    ) -> NixlTransfer:
        """Start a READ; ``local`` is one tensor or a list of ``(view, remote_offset, nbytes)``."""
        return self._one_sided("READ", peer, remote_name, local, remote_offset, None)

    def write_async(
        self,
        peer: int,
        remote_name: str,
        local: torch.Tensor | Sequence[tuple[torch.Tensor, int, int]],
        remote_offset: int = 0,
        *,
        notify: bytes | None = None,
    ) -> NixlTransfer:
        """Start a WRITE; ``local`` is one tensor or a list of ``(view, remote_offset, nbytes)``."""
        return self._one_sided("WRITE", peer, remote_name, local, remote_offset, notify)

    def read_batch_async(
        self, peer: int, requests: Sequence[tuple[str, int, torch.Tensor]]
    ) -> NixlTransfer:
        """Start one READ gathering from several of ``peer``'s exposed buffers.

        Each request is ``(remote name, remote byte offset, local tensor)`` and fills the whole
        local tensor. One NIXL request carries them all (on a CUDA IPC mapping: one copy kernel
        per large piece and one batched launch for the small ones), so a batch of many weights
        costs one completion to wait on, not one per weight.
        """
        return self._gather(
            "READ",
            peer,
            [(name, off, t, t.numel() * t.element_size()) for name, off, t in requests],
            None,
        )

    def read_strided_async(
        self, peer: int, requests: Sequence[tuple[str, int, Sequence[int], torch.Tensor]]
    ) -> NixlTransfer:
        """Start one READ of strided views of ``peer``'s exposed buffers into local tensors.

        Each request is ``(remote name, remote byte offset, remote strides, local tensor)``: the
        remote view has the local tensor's shape and dtype and those strides (in elements) from
        that offset, and lands in ``local`` element by element, whatever either layout. So a
        consumer reads a column slice of a peer's weight, or a transposed one, with nothing
        packed on the peer. On a CUDA IPC mapping (``maps_peer_memory``) each request is one copy
        kernel, any layout on either side. Through NIXL the remote view is cut into its
        contiguous runs, one descriptor each (``local`` must then be contiguous, and the runs
        should be long: a row of a weight, not an element).

        Raises:
            ValueError: unknown buffer, strides that do not match the shape, an offset that is
                not a multiple of the element size, a view reaching outside the buffer, or (NIXL
                path) a non-contiguous local tensor or more than ``_MAX_RUNS`` runs.
        """
        self._check_peer(peer)
        pieces, copies = self._plan_strided(peer, requests, maps=self._use_maps)
        if copies is not None:
            return self._mapped_copy("READ", peer, copies, None)
        return self._post_pieces("READ", peer, pieces, None)

    def prepare_reads(
        self,
        peer: int,
        requests: Sequence[tuple[str, int, torch.Tensor]] = (),
        strided: Sequence[tuple[str, int, Sequence[int], torch.Tensor]] = (),
    ) -> PreparedReads:
        """A fixed set of READs from ``peer``, checked and laid out once, to post again and again.

        ``requests`` are ``read_batch_async``'s, ``strided`` ``read_strided_async``'s. A weight
        sync repeats the same reads every step; posting a prepared set skips the per-request
        checks and bookkeeping. On CUDA IPC mappings the copies are recorded into a CUDA graph
        at the first ``post`` (``cuda_graphs`` option), so a post costs one launch however many
        weights it moves. Through NIXL the descriptor lists are built and the request
        created once, and every ``post`` reposts it. A set that reads mapped and unmapped
        buffers does both (a post starts the request, then the copies). The local tensors and
        the peer's exposed buffers must stay where they are for as long as the set is used;
        ``close()`` it then.
        """
        self._check_peer(peer)

        def mapped(name: str) -> bool:
            return self._mapping(peer, self._remote_buffer(peer, name)) is not None

        byte_reqs = [(name, off, t, t.numel() * t.element_size()) for name, off, t in requests]
        on_map = [mapped(r[0]) for r in byte_reqs]
        s_on_map = [mapped(r[0]) for r in strided]
        sets: list[PreparedReads] = []
        if any(on_map) or any(s_on_map):
            copies = self._plan_gather(
                "READ", peer, [r for r, m in zip(byte_reqs, on_map, strict=True) if m], maps=True
            )[1]
            s_copies = self._plan_strided(
                peer, [r for r, m in zip(strided, s_on_map, strict=True) if m], maps=True
            )[1]
            assert copies is not None and s_copies is not None  # every buffer is mapped
            sets.append(
                _PreparedCopies(self, peer, [*copies, *s_copies], graphs=self._opts.cuda_graphs)
            )
        if not (all(on_map) and all(s_on_map)) or not sets:
            pieces = self._plan_gather(
                "READ", peer, [r for r, m in zip(byte_reqs, on_map, strict=True) if not m],
                maps=False,
            )[0]  # fmt: skip
            s_pieces = self._plan_strided(
                peer, [r for r, m in zip(strided, s_on_map, strict=True) if not m], maps=False
            )[0]
            sets.insert(0, _PreparedXfer(self, peer, [*pieces, *s_pieces]))
        return sets[0] if len(sets) == 1 else _PreparedBoth(self, peer, sets)

    def merge_prepared(self, peer: int, sets: Sequence[PreparedReads]) -> PreparedReads | None:
        """One prepared set that does what ``sets`` (prepared here for ``peer``) do, planned
        by none, where every set is copies on a mapping: their ``CopyProgram``s merged, on
        CUDA IPC recorded as one CUDA graph at the first post (``cuda_graphs``), as a fresh
        ``prepare_reads`` of all their reads would be (measured on 2 cores: 100,000 expert
        reads from a shared-memory ring, about 3.5 s prepared afresh). None otherwise (a NIXL
        request): prepare afresh. The sets must not be posted while the merged one is in
        flight."""
        self._check_peer(peer)
        copies = [p for p in sets if isinstance(p, _PreparedCopies) and p._peer == peer]
        if not copies or len(copies) != len(sets):
            return None
        return _PreparedCopies.merged(self, peer, copies, graphs=self._opts.cuda_graphs)

    @property
    def maps_peer_memory(self) -> bool:
        """Whether one-sided transfers with same-node peers run as copies on a mapping of their
        memory (CUDA IPC for VRAM, shared memory for DRAM), where a strided view costs what its
        bytes cost (``read_strided_async``). ``maps_exposed`` says it of one buffer."""
        return self._use_maps

    def maps_exposed(self, peer: int, remote_name: str) -> bool:
        """Whether ``peer``'s exposed buffer ``remote_name`` is mapped here (see above)."""
        self._check_peer(peer)
        return self._mapping(peer, self._remote_buffer(peer, remote_name)) is not None

    def write_batch_async(
        self,
        peer: int,
        requests: Sequence[tuple[str, int, torch.Tensor]],
        *,
        notify: bytes | None = None,
    ) -> NixlTransfer:
        """Start one WRITE scattering local tensors into several of ``peer``'s exposed buffers
        (``(remote name, remote byte offset, local tensor)`` each); see ``read_batch_async``."""
        return self._gather(
            "WRITE",
            peer,
            [(name, off, t, t.numel() * t.element_size()) for name, off, t in requests],
            notify,
        )

    def read_many(
        self,
        peer: int,
        remote_name: str,
        requests: Sequence[tuple[torch.Tensor, int, int]],
        *,
        timeout: float | None = None,
    ) -> None:
        """One READ request of many descriptors: each ``(local view, remote offset, nbytes)``."""
        self.read_async(peer, remote_name, requests).wait(timeout)

    def write_many(
        self,
        peer: int,
        remote_name: str,
        requests: Sequence[tuple[torch.Tensor, int, int]],
        *,
        notify: bytes | None = None,
        timeout: float | None = None,
    ) -> None:
        """One WRITE request of many descriptors: each ``(local view, remote offset, nbytes)``."""
        self.write_async(peer, remote_name, requests, notify=notify).wait(timeout)

    def notify(self, peer: int, message: bytes) -> None:
        """Send ``message`` to ``peer`` (ordered after every transfer this rank completed)."""
        self._check_peer(peer)
        self._notify(peer, _USER, bytes(message))

    def wait_notification(self, peer: int, timeout: float | None = None) -> bytes:
        """The next message ``peer`` sent with ``notify`` or a ``write(..., notify=...)``."""
        self._check_peer(peer)
        deadline = time.monotonic() + self._timeout(timeout)
        poll = _Backoff(self._spin_s)
        while not self._user_msgs[peer]:
            self._poll_notifs()
            if self._user_msgs[peer]:
                break
            if time.monotonic() > deadline:
                raise NixlTimeoutError(
                    f"no notification from rank {peer} within {self._timeout(timeout)} s"
                )
            poll.sleep()
        return self._user_msgs[peer].popleft()

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        agent, self._agent = self._agent, None
        if agent is None:
            return
        if self._maps:
            if self._device.type == "cuda":
                torch.cuda.synchronize(self._device)  # no copy may still use a peer's mapping
            self._prepared.clear()
            self._maps.clear()
        for handle, _ in self._graveyard:
            with contextlib.suppress(Exception):
                handle.release()
        self._graveyard.clear()
        for reg in self._regs.values():
            with contextlib.suppress(Exception):
                agent.deregister_memory(reg.descs)
        self._regs.clear()
        self._exposed.clear()
        for name in self._peer_agent.values():
            with contextlib.suppress(Exception):
                agent.remove_remote_agent(name)
        del agent

    def stats(self) -> dict[str, int]:
        """Live resource counts, for leak checks: registrations, exposures, transfer handles."""
        return {
            "registrations": len(self._regs),
            "exposed": len(self._exposed),
            "live_xfer_handles": self._live_xfers,
            "leaked_xfer_handles": len(self._graveyard),
            "epoch": self._epoch,
        }

    def describe(self) -> dict[str, Any]:
        facts: dict[str, Any] = {
            "backend": ",".join(self._opts.backends),
            "last_xfer_backend": self._last_backend,
            "mem_type": _mem_type(self._device),
            "agent": self._name,
            "ucx_tls": os.environ.get("UCX_TLS", "(UCX default)"),
            CUDA_IPC_GET_ZCOPY: os.environ.get(CUDA_IPC_GET_ZCOPY, "(unset)"),
            "ucx_env_set_by_vllm_dist": self._set_ucx_env,
            "maps_peer_memory": self._use_maps and self._map_backend,
            "progress_delay_us": self._progress_delay_us,
        }
        with contextlib.suppress(Exception):
            from importlib import metadata

            facts["nixl"] = metadata.version("nixl")
        return facts

    @classmethod
    def unavailable_reason(cls, device_type: str) -> str | None:
        import importlib.util

        if importlib.util.find_spec("nixl") is None:
            return f"the nixl package is not installed ({INSTALL_HINT})"
        return None

    # -- internals: memory -------------------------------------------------------------------
    def _register(self, tensor: torch.Tensor) -> _Registration:
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        reg = self._regs.get(key)
        if reg is not None and reg.nbytes >= storage.nbytes():
            self._regs.move_to_end(key)
            return reg
        mem_type = _mem_type(tensor.device)
        dev = _device_id(tensor)
        descs = self._agent_ref().register_memory(
            [(storage.data_ptr(), storage.nbytes(), dev, "")], mem_type=mem_type
        )
        reg = _Registration(storage, descs, storage.data_ptr(), storage.nbytes(), dev, mem_type)
        self._regs[key] = reg
        self._evict(keep=reg)
        return reg

    def _evict(self, keep: _Registration | None = None) -> None:
        unpinned = [
            k for k, r in self._regs.items() if r.pinned == 0 and r.inflight == 0 and r is not keep
        ]
        excess = len(self._regs) - len(self._exposed) - self._opts.max_cached_registrations
        for key in unpinned[: max(0, excess)]:
            reg = self._regs.pop(key)
            self._agent_ref().deregister_memory(reg.descs)
            self._epoch += 1

    def _metadata_for(self, peer: int, reg: _Registration) -> tuple[bytes, bool]:
        """What ``peer`` must load to address ``reg``: nothing, a partial, or full metadata."""
        if peer in reg.shared_with and self._shared_epoch[peer] == self._epoch:
            return b"", False
        agent = self._agent_ref()
        if self._shared_epoch[peer] != self._epoch:  # we released memory: peer must reload
            self._shared_epoch[peer] = self._epoch
            for r in self._regs.values():
                r.shared_with.add(peer)
            return agent.get_agent_metadata(), True
        reg.shared_with.add(peer)
        return agent.get_partial_agent_metadata(reg.descs, False), False

    def _load_remote(self, rank: int, md: bytes, epoch: int, *, full: bool) -> None:
        agent = self._agent_ref()
        known = self._known_epoch[rank]
        if epoch < known:
            raise ValueError(
                f"metadata of rank {rank} at epoch {epoch} is older than the loaded epoch "
                f"{known}: the buffer was released since; ask the peer for a fresh descriptor"
            )
        if epoch != known:
            if not full:
                raise NixlTransferError(
                    f"rank {rank} sent partial metadata at epoch {epoch}, but epoch {known} is "
                    "loaded (internal protocol error)"
                )
            agent.remove_remote_agent(self._peer_agent[rank])
            self._known_epoch[rank] = epoch
        agent.add_remote_agent(md)

    # -- internals: transfers ----------------------------------------------------------------
    def _one_sided(
        self,
        op: str,
        peer: int,
        remote_name: str,
        local: torch.Tensor | Sequence[tuple[torch.Tensor, int, int]],
        remote_offset: int,
        notify: bytes | None,
    ) -> NixlTransfer:
        if isinstance(local, torch.Tensor):
            check_tensor(local, self._device, "local")
            requests = [(remote_name, remote_offset, local, local.numel() * local.element_size())]
        else:
            requests = [(remote_name, remote_offset + off, view, n) for view, off, n in local]
        return self._gather(op, peer, requests, notify)

    def _gather(
        self,
        op: str,
        peer: int,
        requests: Sequence[tuple[str, int, torch.Tensor, int]],
        notify: bytes | None,
    ) -> NixlTransfer:
        """One request over ``(remote name, remote offset, local view, nbytes)`` pieces."""
        self._check_peer(peer)
        pieces, copies = self._plan_gather(op, peer, requests, maps=self._use_maps)
        if copies is not None:
            return self._mapped_copy(op, peer, copies, notify)
        return self._post_pieces(op, peer, pieces, notify)

    def _plan_gather(
        self,
        op: str,
        peer: int,
        requests: Sequence[tuple[str, int, torch.Tensor, int]],
        *,
        maps: bool,
    ) -> tuple[
        list[tuple[torch.Tensor, int, int, ExposedBuffer]],
        list[tuple[torch.Tensor, torch.Tensor, int]] | None,
    ]:
        """Check byte requests; (NIXL pieces, copies on CUDA IPC mappings or None)."""
        pieces: list[tuple[torch.Tensor, int, int, ExposedBuffer]] = []
        copies: list[tuple[torch.Tensor, torch.Tensor, int]] | None = [] if maps else None
        for i, (remote_name, off, view, n) in enumerate(requests):
            remote = self._remote_buffer(peer, remote_name)
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
            mapped = None if copies is None else self._mapping(peer, remote)
            if mapped is None:
                copies = None
            elif copies is not None:
                mine = view.reshape(-1).view(torch.uint8)[:n]
                theirs = mapped[off : off + n]
                prepared = (mine, theirs, n) if op == "READ" else (theirs, mine, n)
                if self._is_exposed(view):  # kept alive by its exposure anyway: cache the views
                    if len(self._prepared) >= _MAX_PREPARED:
                        self._prepared.clear()
                    self._prepared[key] = prepared
                copies.append(prepared)
        return pieces, copies

    def _plan_strided(
        self,
        peer: int,
        requests: Sequence[tuple[str, int, Sequence[int], torch.Tensor]],
        *,
        maps: bool,
    ) -> tuple[
        list[tuple[torch.Tensor, int, int, ExposedBuffer]],
        list[tuple[torch.Tensor, torch.Tensor, int]] | None,
    ]:
        """Check strided read requests; (NIXL pieces, None) or, where every remote buffer is
        mapped here and ``maps``, ([], copies)."""
        copies: list[tuple[torch.Tensor, torch.Tensor, int]] | None = [] if maps else None
        checked = []
        typed_maps: dict[tuple[int, torch.dtype], torch.Tensor | None] = {}
        for i, (remote_name, off, stride, local) in enumerate(requests):
            remote = self._remote_buffer(peer, remote_name)
            key = None
            if copies is not None:
                key = (peer, "S", remote_name, remote.addr, off, tuple(stride), local.data_ptr())
                hit = self._prepared.get(key)
                if hit is not None and hit[3] is local:  # the same request as an earlier one
                    copies.append(hit[:3])
                    checked.append((remote, off, tuple(stride), local, hit[2]))  # for NIXL
                    continue
            check_tensor(local, self._device, f"local[{i}]", contiguous=False)
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
            checked.append((remote, off, stride, local, extent))
            mapped = None if copies is None else self._mapping(peer, remote)
            if mapped is None:
                copies = None
            elif copies is not None and extent:
                typed = typed_maps.get((id(mapped), local.dtype))
                if typed is None:  # the whole mapping as this dtype, once per call
                    typed = typed_maps[(id(mapped), local.dtype)] = _typed(mapped, local.dtype)
                if typed is not None:  # one view op, not three: 100,000 items per sync
                    theirs = typed.as_strided(size, stride, typed.storage_offset() + off // item)
                else:
                    theirs = mapped[off : off + extent].view(local.dtype).as_strided(size, stride)
                mine, theirs = widest_views(local, theirs)
                copies.append((mine, theirs, extent))
                if key is not None and self._is_exposed(local):  # kept alive by its exposure
                    if len(self._prepared) >= _MAX_PREPARED:
                        self._prepared.clear()
                    self._prepared[key] = (mine, theirs, extent, local)
        pieces: list[tuple[torch.Tensor, int, int, ExposedBuffer]] = []
        if copies is not None:
            return pieces, copies
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
            if len(starts) > _MAX_RUNS:
                raise ValueError(
                    f"request {i}: the remote view has {len(starts)} contiguous runs of {run} "
                    f"bytes (at most {_MAX_RUNS}); pack it on the owner's side instead"
                )
            flat = local.reshape(-1).view(torch.uint8)
            pieces.extend(
                (flat[k * run : (k + 1) * run], off + s, run, remote)
                for k, s in enumerate(starts.tolist())
            )
        return pieces, None

    def _remote_buffer(self, peer: int, remote_name: str) -> ExposedBuffer:
        known = self._remote_exposed.get(peer, {})
        remote = known.get(remote_name)
        if remote is None:
            raise ValueError(
                f"rank {peer} has exposed no buffer named {remote_name!r} that this worker "
                f"knows (known: {sorted(known)}); call exchange_exposed() or "
                "import_exposed() first"
            )
        return remote

    def _post_pieces(
        self,
        op: str,
        peer: int,
        pieces: Sequence[tuple[torch.Tensor, int, int, ExposedBuffer]],
        notify: bytes | None,
    ) -> NixlTransfer:
        """One NIXL request over ``(local view, remote offset, nbytes, remote buffer)``."""
        names = sorted({p[3].name for p in pieces})
        what = f"{op} of {', '.join(map(repr, names[:3]))}{' ...' if len(names) > 3 else ''}"
        notif = b"" if notify is None else _USER + bytes(notify)
        return self._post(
            op,
            peer,
            [(view, r.addr + off, n, r.device_id) for view, off, n, r in pieces],
            remote_mem=pieces[0][3].mem_type if pieces else "DRAM",
            notif=notif,
            what=f"{what} on rank {peer}",
        )

    def _is_exposed(self, view: torch.Tensor) -> bool:
        """Whether ``view`` lies in local memory exposed here (registered and pinned)."""
        reg = self._regs.get((str(view.device), view.untyped_storage().data_ptr()))
        return reg is not None and reg.pinned > 0

    def _mapping(self, peer: int, remote: ExposedBuffer) -> torch.Tensor | None:
        """The peer's exposed buffer mapped here (CUDA IPC, shared memory), or None (NIXL)."""
        if not self._use_maps or remote.mapping is None:
            return None
        if isinstance(remote.mapping, CudaIpcHandle) != (self._device.type == "cuda"):
            return None  # VRAM and DRAM peers copy through NIXL
        key = (peer, remote.name, remote.addr)
        if key not in self._maps:
            try:
                self._maps[key] = remote.mapping.open()
            except RuntimeError:  # e.g. no peer access between the two devices: NIXL still works
                self._maps[key] = None
        return self._maps[key]

    def _mapped_copy(
        self,
        op: str,
        peer: int,
        copies: Sequence[tuple[torch.Tensor, torch.Tensor, int]],
        notify: bytes | None,
    ) -> _CopyTransfer:
        """Copies over ``(destination, source, nbytes)`` byte views, one side of each a peer's
        mapping: one copy per large piece, one batched (``_foreach_copy_``) launch for all the
        small ones."""
        small_dst: list[torch.Tensor] = []
        small_src: list[torch.Tensor] = []
        for dst, src, n in copies:
            if n >= _BATCH_COPY_BYTES:
                dst.copy_(src, non_blocking=True)
            elif n:
                small_dst.append(dst)
                small_src.append(src)
        if small_dst:
            torch._foreach_copy_(small_dst, small_src, non_blocking=True)
        xfer = self._copied(f"{op} of rank {peer}'s buffer {self._map_via}")
        if notify is not None:  # the peer may look only after the bytes have landed
            xfer.wait()
            self._notify(peer, _USER, bytes(notify))
        return xfer

    def _copied(self, what: str) -> _CopyTransfer:
        """The transfer of copies just issued on mappings (on CUDA: behind an event)."""
        self._last_backend = self._map_backend
        if self._device.type != "cuda":
            return _CopyTransfer(self, None, what)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device))
        return _CopyTransfer(self, event, what)

    def _post(
        self,
        op: str,
        peer: int,
        pieces: Sequence[tuple[torch.Tensor, int, int, int]],
        *,
        remote_mem: str,
        notif: bytes,
        what: str,
    ) -> NixlTransfer:
        agent = self._agent_ref()
        pieces = [p for p in pieces if p[2] > 0]
        regs = []
        local = np.empty((len(pieces), 3), dtype=np.uint64)
        remote = np.empty((len(pieces), 3), dtype=np.uint64)
        try:
            for i, (view, raddr, n, remote_dev) in enumerate(pieces):
                reg = self._register(view)
                reg.inflight += 1  # held as it is made: the next registration cannot evict it
                regs.append(reg)
                local[i] = (view.data_ptr(), n, _device_id(view))
                remote[i] = (raddr, n, remote_dev)
            if not pieces:
                if notif:
                    self._notify(peer, notif[:1], notif[1:])
                return NixlTransfer(self, None, [], what)
            if self._device.type == "cuda":
                torch.cuda.current_stream(self._device).synchronize()  # the bytes must exist
            with _nixl_errors(f"{what}: creating the request"):
                handle = agent.initialize_xfer(
                    op,
                    agent.get_xfer_descs(local, _mem_type(self._device)),
                    agent.get_xfer_descs(remote, remote_mem),
                    self._peer_agent[peer],
                    notif,
                )
        except BaseException:
            for reg in regs:
                reg.inflight -= 1
            raise
        self._live_xfers += 1
        xfer = NixlTransfer(self, handle, regs, what)
        try:
            with _nixl_errors(f"{what}: posting"):
                state = agent.transfer(handle)
        except NixlTransferError as exc:
            xfer._fail(exc)
            raise
        if not self._last_backend:
            with contextlib.suppress(Exception):
                self._last_backend = agent.query_xfer_backend(handle)
        if state == "ERR":
            xfer._fail(NixlTransferError(f"{what} could not be posted (NIXL state ERR)"))
        return xfer

    def _release_xfer(
        self, handle: nixl_xfer_handle, regs: list[_Registration], failed: bool = False
    ) -> None:
        try:
            handle.release()
        except Exception:  # noqa: BLE001 - an in-flight request may refuse to abort
            self._graveyard.append((handle, regs))  # keep its memory registered and alive
            return
        finally:
            self._live_xfers -= 1
        for reg in regs:
            reg.inflight -= 1
        if failed:
            self._evict()

    # -- internals: notifications ------------------------------------------------------------
    def _notify(self, peer: int, kind: bytes, payload: Any) -> None:
        body = (
            payload
            if kind in (_USER, _DONE) and isinstance(payload, bytes)
            else pickle.dumps(payload)
        )
        with _nixl_errors(f"notifying rank {peer}"):
            self._agent_ref().send_notif(self._peer_agent[peer], kind + body)

    def _poll_notifs(self) -> None:
        with _nixl_errors("polling notifications"):
            news = self._agent_ref().get_new_notifs()
        for agent_name, messages in news.items():
            rank = self._agent_rank.get(agent_name)
            if rank is None:
                continue
            for msg in messages:
                kind, body = msg[:1], msg[1:]
                if kind == _USER:
                    self._user_msgs[rank].append(body)
                    continue
                payload = pickle.loads(body)
                if kind == _DONE:
                    self._inbox[(rank, kind, payload)] = None
                else:
                    self._inbox[(rank, kind, payload[0])] = payload[1:]

    def _wait_msg(
        self,
        peer: int,
        kind: bytes,
        seq: int,
        deadline: float,
        what: str,
        error_kind: bytes | None = None,
    ) -> Any:
        poll = _Backoff(self._spin_s)
        while True:
            self._poll_notifs()
            if (peer, kind, seq) in self._inbox:
                return self._inbox.pop((peer, kind, seq))
            if error_kind is not None and (peer, error_kind, seq) in self._inbox:
                (msg,) = self._inbox.pop((peer, error_kind, seq))
                raise ValueError(f"rank {peer} refused {what}: {msg}")
            if time.monotonic() > deadline:
                raise NixlTimeoutError(
                    f"rank {self._rank}: {what} did not arrive in time; rank {peer} may be dead, "
                    "stuck, or not calling the matching send/recv (raise 'timeout' if it is slow)"
                )
            poll.sleep()

    # -- internals: misc ---------------------------------------------------------------------
    def _agent_ref(self) -> nixl_agent:
        if self._agent is None:
            raise RuntimeError("this NixlRdtCommunicator is closed")
        return self._agent

    def _timeout(self, timeout: float | None) -> float:
        return self._opts.timeout if timeout is None else timeout

    def _check_peer(self, peer: int) -> None:
        if not 0 <= peer < self._world:
            raise ValueError(f"rank {peer} is outside this group of {self._world}")
        if peer == self._rank:
            raise ValueError(f"rank {peer} is this worker itself; use tensor.copy_ locally")


# -- Ray Direct Transport --------------------------------------------------------------------------


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
    prepare_ray_rdt_actor(targets[0].device)
    import ray
    from ray import exceptions as rex
    from ray.experimental import set_target_for_ref

    vram = targets[0].is_cuda
    if vram and os.environ.get(CUDA_IPC_GET_ZCOPY, "").lower() in ("n", "no", "off", "0"):
        raise RayRdtUnavailableError(
            f"{CUDA_IPC_GET_ZCOPY} is off in this actor: Ray's NIXL transport READs, which UCX then "
            "carries over TCP between processes on one GPU (it timed out on Ray 2.60); unset it or "
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


def ray_rdt_wait_lendable(refs: Sequence[Any], *, timeout: float) -> None:
    """Wait until RDT ``refs`` this process owns can be lent to another actor inside a container.

    Ray 2.60 refuses to pass an RDT ref on (``NotImplementedError``: "Tensor transport metadata is
    not available ... at the time of borrowing") until the owner has the producer's transport
    metadata, which can arrive after ``ray.wait`` already reported the ref ready (about one lend
    in three failed on the CPU machine right after ``ray.wait``). Refs that are not RDT refs of
    this process pass through.

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
