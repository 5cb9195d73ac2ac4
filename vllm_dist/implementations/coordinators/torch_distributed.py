"""TorchDistributedCoordinator: the control plane on a torch.distributed gloo process group.

The world coordinator joins (or, under torchrun, reuses) torch.distributed's default group;
sub-groups are gloo groups made with ``use_local_synchronization=True`` so that only their members
take part, which lets every group of a ``GroupCoordinatorDistributedTask`` build its own without the
rest of the world. The default group is process-global in torch, which is why this coordinator
never reads a rank from it: every rank here comes from the ``WorkerInfo`` it was given.

With a launch secret (``WorkerInfo.secret``) the rendezvous is the authenticated store of
``auth_store`` and the object collectives are tagged (``signed_objects``): a process without the
secret takes no rank and no Python object it sends is unpickled. Gloo listens on the route to
``master_addr`` only (``binding``). Without a secret (torchrun without ``VLLM_DIST_SECRET``) the
rendezvous is torch's own TCPStore and a warning says so.

Each operation is recorded, on entry and on exit, in the file a launcher names through
``PROGRESS_FILE_ENV``: one rewrite of a short line per operation, so that a launch that times
out can name the rank that never arrived and what it did last. Rejected alternative: keys in the
rendezvous store, a network round trip per operation and unreadable once rank 0 is gone.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import inspect
import logging
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from vllm_dist.implementations.coordinators.auth_store import AuthStoreClient, AuthStoreServer
from vllm_dist.implementations.coordinators.binding import bound_gloo, gloo_bind_host
from vllm_dist.implementations.coordinators.signed_objects import SignedObjects, object_key
from vllm_dist.interfaces import (
    AuthenticationError,
    CoordinatorTimeoutError,
    RendezvousPortTakenError,
    WorkerCoordinator,
    WorkerInfo,
)
from vllm_dist.interfaces.launcher import PROGRESS_FILE_ENV, SECRET_ENV

logger = logging.getLogger("vllm_dist")

DEFAULT_TIMEOUT_S = 300.0
_RECORD_BYTES = 200  # one record, padded, rewritten in place


class ProgressLog:
    """The last coordinator operation this worker entered, kept in a file its launcher reads.

    A record reads ``in barrier #3 group=[0, 1] t=<time.time()>`` while the operation runs and
    ``after ...`` once it returned. Without ``PROGRESS_FILE_ENV`` (torchrun) nothing is written.
    """

    def __init__(self, path: str | None) -> None:
        self._fd = -1
        self._counts: dict[tuple[int, ...], int] = {}
        if path:
            with contextlib.suppress(OSError):
                self._fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)

    @contextlib.contextmanager
    def op(self, name: str, group: Sequence[int]) -> Iterator[None]:
        """Record entering ``name`` on ``group`` (global ranks), then leaving it."""
        if self._fd < 0:
            yield
            return
        key = tuple(group)
        n = self._counts[key] = self._counts.get(key, 0) + 1
        what = f"{name} #{n} group={list(key)}"
        self._write(f"in {what} t={time.time():.3f}")
        yield
        self._write(f"after {what} t={time.time():.3f}")

    def _write(self, record: str) -> None:
        with contextlib.suppress(OSError):
            os.pwrite(self._fd, record.encode()[:_RECORD_BYTES].ljust(_RECORD_BYTES), 0)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class TorchDistributedCoordinator(WorkerCoordinator):
    """A coordinator over the whole launch, or (via ``new_group``) over a subset of it.

    Args:
        worker_info: this worker's place in the launch.
        timeout: seconds any collective may wait for a peer.
    """

    def __init__(self, worker_info: WorkerInfo, *, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self._info = worker_info
        self._timeout = timeout
        self._global_ranks = list(range(worker_info.world_size))
        self._group: dist.ProcessGroup | None = None
        self._owns_default_group = False
        self._children: list[TorchDistributedCoordinator] = []
        self._closed = False
        self._progress = ProgressLog(os.environ.get(PROGRESS_FILE_ENV))
        self._owns_progress = True  # a sub-group writes into its world coordinator's record
        self._bind_host = gloo_bind_host(worker_info.master_addr)
        self._key = object_key(worker_info.secret) if worker_info.secret else b""
        self._signed: SignedObjects | None = None
        self._store: AuthStoreClient | None = None
        self._server: AuthStoreServer | None = None

    # -- set-up ------------------------------------------------------------------------------
    def initialize(self) -> None:
        if self._group is not None:
            return
        info = self._info
        if dist.is_initialized():
            if dist.get_world_size() != info.world_size or dist.get_rank() != info.rank:
                raise RuntimeError(
                    "torch.distributed is already initialized with rank "
                    f"{dist.get_rank()}/{dist.get_world_size()}, but this worker is "
                    f"{info.rank}/{info.world_size}; destroy the existing process group first"
                )
        else:
            timeout = datetime.timedelta(seconds=self._timeout)
            try:
                with self._progress.op("rendezvous", self._global_ranks):
                    self._init_default_group(info, timeout)
            except AuthenticationError:
                self._close_store()
                raise
            except (RuntimeError, dist.DistStoreError, OSError) as exc:
                self._close_store()
                if _address_in_use(exc):
                    raise RendezvousPortTakenError(
                        f"rank {info.rank}: port {info.master_port} on {info.master_addr} is "
                        f"held by another process; pick a free port: {exc}",
                        port=info.master_port,
                    ) from exc
                raise CoordinatorTimeoutError(
                    f"rank {info.rank}: could not join the group at "
                    f"{info.master_addr}:{info.master_port} within {self._timeout} s: {exc}"
                ) from exc
            self._owns_default_group = True
        self._group = dist.group.WORLD
        self._sign(self._require_group())

    def _init_default_group(self, info: WorkerInfo, timeout: datetime.timedelta) -> None:
        options: dict[str, Any] = {}
        if info.secret:
            options["store"] = self._authenticated_store(info, timeout)
        elif info.launch_id:
            options["store"] = _launch_store(info, timeout)
        else:
            options["init_method"] = f"tcp://{_host(info.master_addr)}:{info.master_port}"
        if not info.secret:
            logger.warning(
                "vllm_dist: rank %d joins an unauthenticated control plane at %s:%s (no launch "
                "secret: set %s for workers that torchrun, srun or mpirun starts)",
                info.rank,
                info.master_addr,
                info.master_port,
                SECRET_ENV,
            )
        with bound_gloo(self._bind_host):
            dist.init_process_group(
                backend="gloo",
                rank=info.rank,
                world_size=info.world_size,
                timeout=timeout,
                **options,
            )

    def _authenticated_store(self, info: WorkerInfo, timeout: datetime.timedelta) -> dist.Store:
        """Rank 0 serves the store on exactly ``master_addr``; every rank connects to it and
        proves it holds the secret (and checks that the server does) before any command."""
        if info.rank == 0:
            self._server = AuthStoreServer(info.master_addr, info.master_port, info.secret)
        self._store = AuthStoreClient(
            info.master_addr, info.master_port, info.secret, timeout=timeout, server=self._server
        )
        if not info.launch_id:
            return self._store
        return dist.PrefixStore(f"vllm_dist/{info.launch_id}", self._store)

    def _sign(self, group: dist.ProcessGroup) -> None:
        if self._key:
            self._signed = SignedObjects(self._key, group, self._global_ranks, self.get_rank())

    def _close_store(self) -> None:
        for closable in (self._store, self._server):
            if closable is not None:
                closable.close()
        self._store = self._server = None

    @property
    def rendezvous_refusals(self) -> list[str]:
        """Peer addresses of the connections this rank's store refused (rank 0; else empty)."""
        return list(self._server.refusals) if self._server is not None else []

    @property
    def process_group(self) -> dist.ProcessGroup:
        """The gloo group behind this coordinator (for backends built on torch.distributed)."""
        return self._require_group()

    @property
    def timeout(self) -> float:
        return self._timeout

    @property
    def bind_host(self) -> str | None:
        """The address this worker's gloo groups listen on (None: gloo's own choice, for a
        user who set ``GLOO_SOCKET_IFNAME``); communicators pass it to ``new_torch_group``."""
        return self._bind_host

    # -- rank facts --------------------------------------------------------------------------
    def get_rank(self) -> int:
        return self._global_ranks.index(self._info.rank)

    def get_world_size(self) -> int:
        return len(self._global_ranks)

    def get_local_rank(self) -> int:
        return self._info.local_rank

    def get_local_world_size(self) -> int:
        return self._info.local_world_size

    def get_global_ranks(self) -> list[int]:
        return list(self._global_ranks)

    # -- collectives -------------------------------------------------------------------------
    def barrier(self, timeout: float | None = None) -> None:
        group = self._require_group()
        seconds = self._timeout if timeout is None else timeout
        try:
            with self._progress.op("barrier", self._global_ranks):
                dist.monitored_barrier(
                    group=group, timeout=datetime.timedelta(seconds=seconds), wait_all_ranks=True
                )
        except RuntimeError as exc:
            raise CoordinatorTimeoutError(
                f"barrier on group {self._global_ranks} did not complete within {seconds} s: {exc}"
            ) from exc

    def broadcast_object(self, obj: Any, src: int) -> Any:
        self._check_rank(src, "src")
        group = self._require_group()
        with self._progress.op(f"broadcast_object(src={src})", self._global_ranks):
            if self._signed is not None:
                return self._signed.broadcast(obj, src)
            box = [obj if self.get_rank() == src else None]
            dist.broadcast_object_list(box, group_src=src, group=group)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        group = self._require_group()
        with self._progress.op("all_gather_object", self._global_ranks):
            if self._signed is not None:
                return self._signed.all_gather(obj)
            out: list[Any] = [None] * self.get_world_size()
            dist.all_gather_object(out, obj, group=group)
        return out

    def send_object(self, obj: Any, dst: int) -> None:
        self._check_rank(dst, "dst", peer=True)
        group = self._require_group()
        with self._progress.op(f"send_object(dst={dst})", self._global_ranks):
            if self._signed is not None:
                self._signed.send(obj, dst)
            else:
                dist.send_object_list([obj], group_dst=dst, group=group)

    def recv_object(self, src: int) -> Any:
        self._check_rank(src, "src", peer=True)
        group = self._require_group()
        with self._progress.op(f"recv_object(src={src})", self._global_ranks):
            if self._signed is not None:
                return self._signed.recv(src)
            box: list[Any] = [None]
            dist.recv_object_list(box, group_src=src, group=group)
        return box[0]

    # -- groups ------------------------------------------------------------------------------
    def new_group(self, ranks: Sequence[int]) -> TorchDistributedCoordinator:
        ranks = list(ranks)
        self._require_group()
        check_group_ranks(ranks, self.get_world_size(), self.get_rank())
        global_ranks = [self._global_ranks[r] for r in ranks]
        child = TorchDistributedCoordinator(self._info, timeout=self._timeout)
        child._global_ranks = global_ranks
        child._progress.close()
        child._progress, child._owns_progress = self._progress, False  # one record per worker
        with self._progress.op("new_group", global_ranks):
            child._group = new_torch_group(
                global_ranks, "gloo", self._timeout, bind_host=self._bind_host
            )
        child._sign(child._group)
        self._children.append(child)
        return child

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for child in self._children:
            child.close()
        if self._owns_default_group and dist.is_initialized():
            dist.destroy_process_group()
        self._close_store()
        if self._owns_progress:
            self._progress.close()
        self._group = None

    # -- helpers -----------------------------------------------------------------------------
    def _require_group(self) -> dist.ProcessGroup:
        if self._group is None:
            state = "closed" if self._closed else "not initialized; call initialize() first"
            raise RuntimeError(f"coordinator for ranks {self._global_ranks} is {state}")
        return self._group

    def _check_rank(self, rank: int, what: str, peer: bool = False) -> None:
        if not 0 <= rank < self.get_world_size():
            raise ValueError(f"{what}={rank} is outside this group of {self.get_world_size()}")
        if peer and rank == self.get_rank():
            raise ValueError(f"{what}={rank} is this worker itself")


def check_group_ranks(ranks: list[int], world_size: int, my_rank: int) -> None:
    """Validate a sub-group's ranks; shared by coordinators."""
    if not ranks:
        raise ValueError("a group needs at least one rank")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"group ranks {ranks} contain duplicates")
    bad = [r for r in ranks if not 0 <= r < world_size]
    if bad:
        raise ValueError(f"group ranks {bad} are outside the world of {world_size}")
    if my_rank not in ranks:
        raise ValueError(f"rank {my_rank} is not in group {ranks}; only members build a group")


def new_torch_group(
    global_ranks: list[int],
    backend: str,
    timeout: float,
    device_id: Any = None,
    *,
    bind_host: str | None = None,
) -> dist.ProcessGroup:
    """A torch.distributed group whose rank i is ``global_ranks[i]``, built by its members only.

    A gloo group listens on ``bind_host`` (``TorchDistributedCoordinator.bind_host``); without
    it, on the route to the default group's rendezvous address when that is known.
    torch builds without ``sort_ranks`` (2.11 and older) order a group by global rank; there an
    unsorted ``global_ranks`` is refused rather than silently renumbered.
    """
    options: dict[str, Any] = {}
    params = inspect.signature(dist.new_group).parameters
    if "sort_ranks" in params:
        options["sort_ranks"] = False
    elif global_ranks != sorted(global_ranks):
        raise ValueError(
            f"torch {torch.__version__} orders group ranks by global rank, so group "
            f"{global_ranks} cannot keep its order; list the ranks sorted or upgrade torch"
        )
    if device_id is not None and "device_id" in params:
        options["device_id"] = device_id
    if backend == "gloo" and bind_host is None:
        bind_host = _default_bind_host()
    with bound_gloo(bind_host if backend == "gloo" else None):
        group = dist.new_group(
            global_ranks,
            backend=backend,
            timeout=datetime.timedelta(seconds=timeout),
            use_local_synchronization=True,
            **options,
        )
    assert group is not None
    return group


def _launch_store(info: WorkerInfo, timeout: datetime.timedelta) -> dist.Store:
    """The rendezvous store of ``info``'s launch: rank 0's TCP store, every key under the
    launch's id. Rank 0 does not count the clients that connect (``wait_for_workers``): a
    worker of another launch that reached this port would count as one of ours; each rank
    waits for its peers' keys instead, and a stray worker waits for keys no one writes."""
    store = dist.TCPStore(
        info.master_addr.strip("[]"),
        info.master_port,
        info.world_size,
        is_master=info.rank == 0,
        timeout=timeout,
        wait_for_workers=False,
    )
    return dist.PrefixStore(f"vllm_dist/{info.launch_id}", store)


def _default_bind_host() -> str | None:
    """Where the default group's gloo listens: the route to its rendezvous store's address,
    read from the store the default group was made with (ours or torch's TCPStore)."""
    with contextlib.suppress(Exception):
        store: Any = dist.distributed_c10d._get_default_store()
        for _ in range(8):  # unwrap PrefixStores
            host = getattr(store, "host", None)
            if isinstance(host, str) and host:
                return gloo_bind_host(host)
            store = getattr(store, "underlying_store", None)
            if store is None:
                break
    return None


def _address_in_use(exc: BaseException) -> bool:
    """The rendezvous could not listen: EADDRINUSE from our store's bind, or torch's TCPStore
    (libuv says EADDRINUSE, the older backend errno 98)."""
    if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
        return True
    text = str(exc)
    return "EADDRINUSE" in text or "Address already in use" in text


def _host(addr: str) -> str:
    return f"[{addr}]" if ":" in addr and not addr.startswith("[") else addr
