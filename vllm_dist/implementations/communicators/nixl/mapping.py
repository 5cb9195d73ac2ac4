"""Mapping a same-node peer's exposed memory into this process.

An exposed VRAM buffer ships a CUDA IPC handle with its descriptor, an exposed DRAM buffer whose
storage is in shared memory the owner's file descriptor; a peer on the same node maps it and
copies with a kernel or ``memcpy`` instead of a NIXL request, so a strided view or a thousand
small ones cost their bytes. Rejected alternative: moving a storage into shared memory at
``expose`` (that would free memory that copies planned earlier still address).

Access: an exposure is read-only unless its owner made it writable (a WRITE target). A peer maps
a read-only DRAM buffer ``O_RDONLY`` with ``PROT_READ``, so a store through the mapping faults;
the owner also clears the write bits of the shared-memory object, so a descriptor forged to ask
for write access is refused here (and by the OS for a peer that is not root). Legacy CUDA IPC
handles (``cudaIpcOpenMemHandle``) always map read-write: a VRAM peer that ignores the
descriptor's access can write. Read-only VRAM would take VMM allocations (``cuMemCreate`` with a
shareable handle, exported as a POSIX file descriptor, mapped by the peer with ``cuMemMap`` and
``cuMemSetAccess(..., CU_MEM_ACCESS_FLAGS_PROT_READ)``), i.e. the exposed weights allocated
through VMM rather than torch's caching allocator; not done.
"""

from __future__ import annotations

import mmap
import os
import stat
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vllm_dist.implementations.communicators.nixl.agent import (
    ReadOnlyExposureError,
    Registration,
)

if TYPE_CHECKING:
    from vllm_dist.implementations.communicators.nixl.descriptors import ExposedBuffer


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
            node=node_id(),
            device_uuid=str(torch.cuda.get_device_properties(tensor.device).uuid),
            rebuild=reduce_tensor(flat),
        )

    def open(self, writable: bool = False) -> torch.Tensor | None:
        """The peer's buffer as a flat uint8 tensor here, or None when it cannot be mapped.
        Always read-write, whatever ``writable`` says (legacy CUDA IPC has no read-only map)."""
        if self.node != node_id():
            return None
        local = local_device_index(self.device_uuid)
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
    def of(tensor: torch.Tensor, writable: bool = False) -> SharedMemoryHandle | None:
        """The handle of ``tensor``'s storage, whose write bits are set to ``writable``
        (``grant``); None when it is not in shared memory or its access cannot be set."""
        storage = tensor.untyped_storage()
        if not (storage.nbytes() and storage.is_shared()):
            return None
        try:
            fd, size = storage._share_fd_cpu_()
            grant(fd, writable)
            st = os.fstat(fd)
        except (RuntimeError, OSError, AttributeError):  # e.g. shared by file name
            return None
        return SharedMemoryHandle(
            node=node_id(),
            pid=os.getpid(),
            fd=fd,
            inode=(st.st_dev, st.st_ino),
            size=size,
            offset=tensor.data_ptr() - storage.data_ptr(),
            nbytes=tensor.numel() * tensor.element_size(),
        )

    def open(self, writable: bool = False) -> torch.Tensor | None:
        """The buffer as a flat uint8 tensor mapped here (read-only unless ``writable``), or
        None when it cannot be mapped.

        Raises:
            ReadOnlyExposureError: ``writable`` asked of an object its owner made read-only.
        """
        if self.node != node_id():
            return None
        path = f"/proc/{self.pid}/fd/{self.fd}"
        try:
            fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        except PermissionError:
            if writable:
                raise _refused(self.pid) from None
            return None
        except OSError:  # gone, or another PID namespace: NIXL still works
            return None
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != self.inode or st.st_size < self.size:
                return None
            refused = writable and not st.st_mode & stat.S_IWUSR  # the owner's word
            whole = None if refused else _map(fd, self.size, writable)
        except (OSError, RuntimeError, ValueError):
            return None
        finally:
            os.close(fd)  # the mapping keeps the object
        if whole is None:
            raise _refused(self.pid)
        return whole[self.offset : self.offset + self.nbytes]


def grant(fd: int, writable: bool) -> None:
    """Set the owner's write bit of shared-memory object ``fd`` (writable) or clear every write
    bit (read-only): what ``SharedMemoryHandle.open`` checks before mapping it read-write."""
    mode = stat.S_IMODE(os.fstat(fd).st_mode)
    want = mode | stat.S_IWUSR if writable else mode & ~0o222
    if want != mode:
        os.fchmod(fd, want)


def grant_storage(storage: Any, writable: bool) -> None:
    """``grant`` on the shared-memory object of a CPU ``storage`` (nothing for any other)."""
    if storage.device.type != "cpu" or not (storage.nbytes() and storage.is_shared()):
        return
    try:
        fd, _ = storage._share_fd_cpu_()
        grant(fd, writable)
    except (RuntimeError, OSError, AttributeError):
        return


def _map(fd: int, size: int, writable: bool) -> torch.Tensor:
    """``size`` bytes of ``fd`` mapped shared as a flat uint8 tensor; ``PROT_READ`` only unless
    ``writable`` (the tensor keeps the mapping alive)."""
    if writable:
        storage = torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", True, size)
        whole = torch.empty(0, dtype=torch.uint8)
        whole.set_(storage, 0, (size,), (1,))  # type: ignore[arg-type]
        return whole
    view = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*", category=UserWarning)
        return torch.frombuffer(view, dtype=torch.uint8)  # holds ``view``: the pages stay


def _refused(pid: int) -> ReadOnlyExposureError:
    return ReadOnlyExposureError(
        f"process {pid} exposed this buffer read-only, but its descriptor asks for write "
        "access: refused. The owner must expose it with writable=True to let peers write."
    )


def node_id() -> str:
    """This node's identity: host name and boot id (handles mean nothing on another node)."""
    import socket

    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def local_device_index(uuid_text: str) -> int | None:
    """The index, in this process's numbering, of the CUDA device with UUID ``uuid_text``."""
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid_text:
            return i
    return None


class PeerMaps:
    """Peers' exposed buffers mapped here, opened once each: CUDA IPC on a CUDA device, shared
    memory on the CPU, or nothing when ``enabled`` is off (every transfer goes through NIXL)."""

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self._device = device
        self._cuda = device.type == "cuda"
        self.enabled = enabled
        self.backend = "cuda_ipc" if self._cuda else "shared_memory"
        self.via = "through CUDA IPC" if self._cuda else "through shared memory"
        self._maps: dict[tuple[int, str, int], torch.Tensor | None] = {}

    def handle(
        self, tensor: torch.Tensor, reg: Registration, writable: bool
    ) -> CudaIpcHandle | SharedMemoryHandle | None:
        """What a same-node peer needs to map ``tensor``, exposed now (``writable`` or not) from
        registration ``reg``; None: peers go through NIXL. A storage gets its exposures' widest
        access."""
        reg.writable += writable
        if not self.enabled:
            return None
        if tensor.is_cuda:
            return CudaIpcHandle.of(tensor)
        return SharedMemoryHandle.of(tensor, reg.writable > 0)

    def release(self, reg: Registration, writable: bool) -> None:
        """One exposure (``writable`` or not) of ``reg`` ended: from now on peers may open its
        storage for writing only while a writable exposure remains, or once none does."""
        reg.writable -= writable
        grant_storage(reg.storage, writable=reg.writable > 0 or reg.pinned == 0)

    def open(self, peer: int, remote: ExposedBuffer) -> torch.Tensor | None:
        """The peer's exposed buffer mapped here, or None (NIXL carries it)."""
        if not self.enabled or remote.mapping is None:
            return None
        if isinstance(remote.mapping, CudaIpcHandle) != self._cuda:
            return None  # VRAM and DRAM peers copy through NIXL
        key = (peer, remote.name, remote.addr)
        if key not in self._maps:
            try:
                self._maps[key] = remote.mapping.open(remote.writable)
            except RuntimeError:  # e.g. no peer access between the two devices: NIXL still works
                self._maps[key] = None
        return self._maps[key]

    def forget(self, peer: int) -> None:
        """Drop the mappings of ``peer``'s buffers (it is gone)."""
        for key in [k for k in self._maps if k[0] == peer]:
            del self._maps[key]

    def close(self, exposed: Iterable[Registration] = ()) -> None:
        """Drop every mapping once no copy may still use one; hand the storages of ``exposed``
        (registrations still exposed) back writable, as they were."""
        for reg in exposed:
            grant_storage(reg.storage, writable=True)
        if self._maps and self._cuda:
            torch.cuda.synchronize(self._device)
        self._maps.clear()
