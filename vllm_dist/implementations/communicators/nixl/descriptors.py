"""``ExposedBuffer``: what a peer needs to address a buffer another worker exposed, and its
explicit byte codec for channels that carry bytes (a notification, a socket).

The codec is versioned JSON (bytes fields in base64), checked field by field when decoded;
``writable`` (the access the owner grants) travels with it, and a peer's mapping honours it. A
CUDA IPC mapping travels as the fields of torch's CUDA IPC reduction, rebuilt here with torch's
own ``rebuild_cuda_tensor``. Rejected alternative: pickling the descriptor, which lets whoever
wrote the bytes choose what code runs when they are read.
"""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_dist.implementations.communicators.nixl.mapping import CudaIpcHandle, SharedMemoryHandle

DESCRIPTOR_VERSION = 2
_MEM_TYPES = ("DRAM", "VRAM")


@dataclass(frozen=True, kw_only=True, slots=True)
class ExposedBuffer:
    """A registered buffer that peers may read (and write, where ``writable``): picklable, or
    ``to_bytes``.

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
    writable: bool = False  # peers may WRITE into it (else READ only; peers map it read-only)

    def to_bytes(self) -> bytes:
        """The descriptor as versioned JSON bytes (``from_bytes`` reads them back)."""
        doc: dict[str, Any] = {
            "v": DESCRIPTOR_VERSION,
            **{k: getattr(self, k) for k in _INTS + _STRS},
            "metadata": _b64(self.metadata),
            "mapping": _encode_mapping(self.mapping),
            "writable": self.writable,
        }
        return json.dumps(doc, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> ExposedBuffer:
        """The descriptor in ``data``; ValueError naming what is malformed."""
        try:
            doc = json.loads(data)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"malformed ExposedBuffer: not JSON ({exc})") from exc
        if not isinstance(doc, dict) or doc.get("v") != DESCRIPTOR_VERSION:
            got = doc.get("v") if isinstance(doc, dict) else type(doc).__name__
            raise ValueError(
                f"ExposedBuffer of version {got!r}, this worker reads {DESCRIPTOR_VERSION}: run "
                "the same vllm_dist version on every worker"
            )
        fields = {k: _field(doc, k, int) for k in _INTS}
        fields.update({k: _field(doc, k, str) for k in _STRS})
        if fields["mem_type"] not in _MEM_TYPES or any(fields[k] < 0 for k in _INTS):
            raise ValueError(f"malformed ExposedBuffer: fields out of range: {fields}")
        return cls(
            **fields,
            metadata=_unb64(_field(doc, "metadata", str)),
            mapping=_decode_mapping(doc.get("mapping")),
            writable=_field(doc, "writable", bool),
        )


_INTS = ("rank", "addr", "nbytes", "device_id", "epoch")
_STRS = ("name", "agent", "mem_type")
# torch's CUDA IPC reduction of a flat uint8 view (``CudaIpcHandle.of``): the fields that vary
_IPC_INTS = ("offset", "device", "storage_size", "storage_offset", "ref_counter_offset")
_IPC_BYTES = ("handle", "ref_counter_handle", "event_handle")


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def _unb64(text: str | None) -> bytes:
    if text is None:
        raise ValueError("malformed ExposedBuffer: a bytes field is missing")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"malformed ExposedBuffer: bad base64 ({exc})") from exc


def _field(doc: dict[str, Any], key: str, typ: type) -> Any:
    value = doc.get(key)
    if type(value) is not typ:  # bool is not an int here
        raise ValueError(f"malformed ExposedBuffer: {key!r} must be {typ.__name__}, got {value!r}")
    return value


def _encode_mapping(mapping: Any) -> dict[str, Any] | None:
    if mapping is None:
        return None
    if isinstance(mapping, SharedMemoryHandle):
        return {
            "kind": "shared_memory", "node": mapping.node, "pid": mapping.pid, "fd": mapping.fd,
            "inode": list(mapping.inode), "size": mapping.size, "offset": mapping.offset,
            "nbytes": mapping.nbytes,
        }  # fmt: skip
    if isinstance(mapping, CudaIpcHandle):
        return {"kind": "cuda_ipc", "node": mapping.node, "uuid": mapping.device_uuid,
                **_encode_ipc(mapping.rebuild)}  # fmt: skip
    raise TypeError(f"an ExposedBuffer cannot carry a mapping of type {type(mapping).__name__}")


def _encode_ipc(rebuild: Any) -> dict[str, Any]:
    """The varying fields of torch's CUDA IPC reduction of a flat uint8 view."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    fn, args = rebuild
    if fn is not rebuild_cuda_tensor or len(args) != 15:
        raise TypeError("a CUDA IPC mapping must be the reduction of a flat uint8 tensor")
    (tcls, size, stride, offset, _scls, dtype, device, handle, ssize, soff, grad, rc_handle,
     rc_off, ev_handle, ev_sync) = args  # fmt: skip
    flat = len(size) == 1 and tuple(stride) == (1,) and dtype == torch.uint8 and not grad
    if tcls is not torch.Tensor or not flat:
        raise TypeError("a CUDA IPC mapping must be the reduction of a flat uint8 tensor")
    ints = dict(zip(_IPC_INTS, (offset, device, ssize, soff, rc_off), strict=True))
    blobs = {k: _b64(v) for k, v in zip(_IPC_BYTES, (handle, rc_handle, ev_handle), strict=True)}
    return {**ints, **blobs, "numel": int(size[0]), "event_sync": bool(ev_sync)}


def _decode_mapping(doc: Any) -> CudaIpcHandle | SharedMemoryHandle | None:
    if doc is None:
        return None
    if not isinstance(doc, dict):
        raise ValueError(f"malformed ExposedBuffer: mapping must be an object, got {doc!r}")
    kind = doc.get("kind")
    if kind == "shared_memory":
        ints = {k: _field(doc, k, int) for k in ("pid", "fd", "size", "offset", "nbytes")}
        inode = doc.get("inode")
        if not (isinstance(inode, list) and len(inode) == 2 and all(type(i) is int for i in inode)):
            raise ValueError(f"malformed ExposedBuffer: inode must be two ints, got {inode!r}")
        return SharedMemoryHandle(node=_field(doc, "node", str), inode=(inode[0], inode[1]), **ints)
    if kind == "cuda_ipc":
        return CudaIpcHandle(
            node=_field(doc, "node", str),
            device_uuid=_field(doc, "uuid", str),
            rebuild=_decode_ipc(doc),
        )
    raise ValueError(f"malformed ExposedBuffer: unknown mapping kind {kind!r}")


def _decode_ipc(doc: dict[str, Any]) -> tuple[Any, tuple[Any, ...]]:
    """torch's CUDA IPC reduction of a flat uint8 view, from its checked fields."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    offset, device, ssize, soff, rc_off = (_field(doc, k, int) for k in _IPC_INTS)
    handle, rc_handle, ev_handle = (
        None if doc.get(k) is None else _unb64(_field(doc, k, str)) for k in _IPC_BYTES
    )  # torch leaves them None for an empty storage
    numel = _field(doc, "numel", int)
    if min(offset, device, ssize, soff, rc_off, numel) < 0:
        raise ValueError("malformed ExposedBuffer: negative CUDA IPC field")
    args = (torch.Tensor, torch.Size([numel]), (1,), offset, torch.storage.TypedStorage,
            torch.uint8, device, handle, ssize, soff, False, rc_handle, rc_off, ev_handle,
            _field(doc, "event_sync", bool))  # fmt: skip
    return rebuild_cuda_tensor, args
