"""The NIXL agent of one worker: options, errors, creation, and the state kept around it.

``RegistrationCache`` holds this worker's memory registrations (one per tensor storage, kept
alive by the cache) and what each peer has loaded of them; ``Peers`` holds the peers' agents and
the buffers they exposed. Agents meet through the coordinator (``all_gather_object`` of their
metadata), so there is no extra port and no etcd.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm_dist.implementations.communicators.nixl.network import quiet_env, scoped_env, ucx_env
from vllm_dist.interfaces import WorkerCoordinator

if TYPE_CHECKING:
    from nixl._api import nixl_agent

    from vllm_dist.implementations.communicators.nixl.descriptors import ExposedBuffer

INSTALL_HINT = "pip install 'vllm_dist[nixl]'"
CUDA_IPC_GET_ZCOPY = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"


class NixlTransferError(RuntimeError):
    """A NIXL transfer failed (the peer died, the endpoint broke, or the request was invalid)."""


class NixlTimeoutError(NixlTransferError, TimeoutError):
    """A transfer or a peer's message did not complete within the timeout (peer slow or dead)."""


class NixlProtocolError(NixlTransferError, ValueError):
    """A peer's notification is malformed, forged or of another wire version: it is refused."""


class ReadOnlyExposureError(PermissionError):
    """A WRITE into a peer's buffer that its owner exposed read-only, or a descriptor forged to
    ask for write access to one: refused."""


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
            0 on VRAM. 0 busy-polls a core (what ``nixl_agent`` always does); a positive value
            lets the thread sleep until UCX has work, leaving the core to the copies.
        cuda_ipc: one-sided READ/WRITE of an exposed VRAM buffer on the same node run as copy
            kernels on a CUDA IPC mapping (faster than UCX's copy-engine path). NIXL still
            carries notifications, send/recv and every other transfer.
        cuda_graphs: ``prepare_reads`` on CUDA IPC mappings records its copies into a CUDA
            graph at the first post and replays it: one launch for many weights.
        shared_memory: one-sided READ/WRITE of an exposed DRAM buffer of a process on the same
            node run as ``memcpy`` on a mapping of it, where its storage is in shared memory
            (``share_memory_()``, ``shared_empty``); any other buffer goes through NIXL.
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


def unavailable_reason(device_type: str) -> str | None:
    """Why NIXL_RDT cannot run on ``device_type`` here (the package, CUDA), or None."""
    import importlib.util

    if importlib.util.find_spec("nixl") is None:
        return f"the nixl package is not installed ({INSTALL_HINT})"
    if device_type == "cuda":
        if torch.version.cuda is None:
            return f"this torch build ({torch.__version__}) has no CUDA"
        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            return "no CUDA device is visible (check CUDA_VISIBLE_DEVICES and the driver)"
    return None


def load_nixl() -> Any:
    """NIXL's Python API module; an ImportError naming the install command without it."""
    try:
        with scoped_env(quiet_env()):  # both read their level as they load
            from nixl import _api
    except ImportError as exc:
        raise ImportError(
            f"the NIXL_RDT communicator needs the nixl package ({exc}); install it with: "
            f"{INSTALL_HINT}"
        ) from exc
    return _api


_AGENT_LOCK = threading.Lock()


def new_agent(api: Any, name: str, opts: NixlOptions, delay_us: int) -> Any:
    """``api.nixl_agent(name, config)`` of ``opts`` with the progress thread's poll delay set,
    no NIXL listener thread, and UCX kept on loopback for a loopback launch
    (``network.ucx_env``, set only while the agent is made).

    ``nixl_agent.__init__`` builds its ``nixlAgentConfig`` itself and hard-codes
    ``pthrDelay = 0``; for the length of the call the binding's config class is swapped for a
    subclass that turns that 0 into ``delay_us`` (under a lock: one agent is built at a time).
    """
    config = api.nixl_agent_config(
        enable_prog_thread=True,  # a target makes progress without calling us (one-sided)
        enable_listen_thread=False,  # no port of NIXL's own: agents meet via the coordinator
        backends=list(opts.backends),
        num_threads=opts.num_threads,
    )
    bind = api.nixlBind
    base = bind.nixlAgentConfig
    field_ = base.pthrDelay

    class _Config(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:  # noqa: N802 - the binding's name
            return int(field_.__get__(self))

        @pthrDelay.setter
        def pthrDelay(self, value: int) -> None:  # noqa: N802
            field_.__set__(self, delay_us if value == 0 else value)

    with _AGENT_LOCK, scoped_env({**quiet_env(), **ucx_env()}):
        if delay_us == 0:
            return api.nixl_agent(name, config)
        bind.nixlAgentConfig = _Config
        try:
            return api.nixl_agent(name, config)
        finally:
            bind.nixlAgentConfig = base


@contextlib.contextmanager
def nixl_errors(what: str) -> Iterator[None]:
    """Turn the binding's own exceptions (``nixlRemoteDisconnectError``, ...) into ours."""
    try:
        yield
    except Exception as exc:
        if type(exc).__module__.split(".")[0] not in ("nixl", "nixl_cu12", "nixl_cu13"):
            raise
        raise NixlTransferError(f"{what}: {type(exc).__name__}: {exc}") from exc


def mem_type(device: torch.device) -> str:
    """NIXL's memory type of ``device``."""
    return "VRAM" if device.type == "cuda" else "DRAM"


def device_id(t: torch.Tensor) -> int:
    """NIXL's device id of ``t`` (0 for host memory)."""
    return max(t.get_device(), 0)


class AgentSlot:
    """The one agent every collaborator of a communicator uses; empty once closed."""

    def __init__(self, agent: nixl_agent) -> None:
        self._agent: nixl_agent | None = agent

    def get(self) -> nixl_agent:
        if self._agent is None:
            raise RuntimeError("this NixlRdtCommunicator is closed")
        return self._agent

    @property
    def closed(self) -> bool:
        return self._agent is None

    def take(self) -> nixl_agent | None:
        """The agent, leaving the slot closed (None if it was already)."""
        agent, self._agent = self._agent, None
        return agent


@dataclass(eq=False)
class Registration:
    """One registered storage and who uses it."""

    storage: Any  # the tensor storage: keeps the registered memory alive
    descs: Any  # nixlRegDList
    base: int
    nbytes: int
    device_id: int
    mem_type: str
    pinned: int = 0  # exposures of this storage
    writable: int = 0  # exposures of this storage that peers may write
    inflight: int = 0  # transfers using it now
    shared_with: set[int] = field(default_factory=set)  # ranks that loaded its metadata


class RegistrationCache:
    """Registrations of local memory, one per storage, least recently used evicted first.

    Exposed buffers pin theirs; transfers hold theirs while in flight. ``epoch`` grows whenever
    one is released, so peers know when metadata they loaded is stale.
    """

    def __init__(self, agent: AgentSlot, max_cached: int) -> None:
        self._agent = agent
        self._max_cached = max_cached
        self.regs: OrderedDict[tuple[str, int], Registration] = OrderedDict()
        self.exposed: dict[str, tuple[ExposedBuffer, Registration]] = {}
        self.epoch = 0
        self.shared_epoch: dict[int, int] = {}  # peer rank -> our epoch it has loaded

    def register(self, tensor: torch.Tensor) -> Registration:
        """The registration of ``tensor``'s storage, made now if there is none."""
        storage = tensor.untyped_storage()
        key = (str(tensor.device), storage.data_ptr())
        reg = self.regs.get(key)
        if reg is not None and reg.nbytes >= storage.nbytes():
            self.regs.move_to_end(key)
            return reg
        mtype = mem_type(tensor.device)
        dev = device_id(tensor)
        descs = self._agent.get().register_memory(
            [(storage.data_ptr(), storage.nbytes(), dev, "")], mem_type=mtype
        )
        reg = Registration(storage, descs, storage.data_ptr(), storage.nbytes(), dev, mtype)
        self.regs[key] = reg
        self.evict(keep=reg)
        return reg

    def evict(self, keep: Registration | None = None) -> None:
        """Release unused registrations beyond the cache's size."""
        unpinned = [
            k for k, r in self.regs.items() if r.pinned == 0 and r.inflight == 0 and r is not keep
        ]
        excess = len(self.regs) - len(self.exposed) - self._max_cached
        for key in unpinned[: max(0, excess)]:
            reg = self.regs.pop(key)
            self._agent.get().deregister_memory(reg.descs)
            self.epoch += 1

    def is_exposed(self, view: torch.Tensor) -> bool:
        """Whether ``view`` lies in local memory exposed here (registered and pinned)."""
        reg = self.regs.get((str(view.device), view.untyped_storage().data_ptr()))
        return reg is not None and reg.pinned > 0

    def metadata_for(self, peer: int, reg: Registration) -> tuple[bytes, bool]:
        """What ``peer`` must load to address ``reg``: nothing, a partial, or full metadata."""
        if peer in reg.shared_with and self.shared_epoch[peer] == self.epoch:
            return b"", False
        agent = self._agent.get()
        if self.shared_epoch[peer] != self.epoch:  # we released memory: peer must reload
            self.shared_epoch[peer] = self.epoch
            for r in self.regs.values():
                r.shared_with.add(peer)
            return agent.get_agent_metadata(), True
        reg.shared_with.add(peer)
        return agent.get_partial_agent_metadata(reg.descs, False), False

    def shared_everything(self, peers: Iterable[int]) -> None:
        """Every peer in ``peers`` has loaded our full metadata at the current epoch."""
        peers = list(peers)
        for peer in peers:
            self.shared_epoch[peer] = self.epoch
        for reg in self.regs.values():
            reg.shared_with.update(peers)

    def release_all(self, agent: nixl_agent) -> None:
        """Deregister everything (at close; errors are ignored)."""
        for reg in self.regs.values():
            with contextlib.suppress(Exception):
                agent.deregister_memory(reg.descs)
        self.regs.clear()
        self.exposed.clear()


class Peers:
    """The group's agents by rank and name, the epoch of each peer's metadata loaded here, and
    the buffers peers exposed."""

    def __init__(self, agent: AgentSlot, rank: int) -> None:
        self._agent = agent
        self.rank = rank
        self.agent_of: dict[int, str] = {}  # peer rank -> agent name
        self.rank_of: dict[str, int] = {}  # agent name -> rank (this worker's too)
        self.known_epoch: dict[int, int] = {}  # peer rank -> epoch of its metadata loaded here
        self.exposed: defaultdict[int, dict[str, ExposedBuffer]] = defaultdict(dict)

    def connect(self, coordinator: WorkerCoordinator, name: str) -> None:
        """Collective: every member loads every other member's agent metadata."""
        agent = self._agent.get()
        everyone = coordinator.all_gather_object((name, agent.get_agent_metadata()))
        for rank, entry in enumerate(everyone):
            if entry is None:  # an elastic fleet's empty slot: ``add`` when a member takes it
                continue
            self.rank_of[entry[0]] = rank
            if rank != self.rank:
                self.add(rank, *entry)

    def add(self, rank: int, name: str, md: bytes) -> None:
        """Load peer ``rank``'s agent ``name`` (its full metadata ``md``) at run time."""
        if rank in self.agent_of:
            self.remove(rank)
        self._agent.get().add_remote_agent(md)
        self.agent_of[rank] = name
        self.rank_of[name] = rank
        self.known_epoch[rank] = 0

    def remove(self, rank: int) -> None:
        """Forget peer ``rank``: its agent, its exposed buffers (errors of a dead peer ignored)."""
        name = self.agent_of.pop(rank, None)
        self.exposed.pop(rank, None)
        self.known_epoch.pop(rank, None)
        if name is None:
            return
        self.rank_of.pop(name, None)
        with contextlib.suppress(Exception):
            self._agent.get().remove_remote_agent(name)

    def load(self, rank: int, md: bytes, epoch: int, *, full: bool) -> None:
        """Load ``rank``'s metadata at ``epoch``; full metadata replaces an older epoch's."""
        agent = self._agent.get()
        known = self.known_epoch[rank]
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
            agent.remove_remote_agent(self.agent_of[rank])
            self.known_epoch[rank] = epoch
        agent.add_remote_agent(md)

    def buffer(self, peer: int, remote_name: str) -> ExposedBuffer:
        """``peer``'s exposed buffer ``remote_name``; ValueError naming the known ones."""
        known = self.exposed.get(peer, {})
        remote = known.get(remote_name)
        if remote is None:
            raise ValueError(
                f"rank {peer} has exposed no buffer named {remote_name!r} that this worker "
                f"knows (known: {sorted(known)}); call exchange_exposed() or "
                "import_exposed() first"
            )
        return remote

    def forget(self, agent: nixl_agent) -> None:
        """Remove every peer's agent (at close; errors are ignored)."""
        for name in self.agent_of.values():
            with contextlib.suppress(Exception):
                agent.remove_remote_agent(name)
