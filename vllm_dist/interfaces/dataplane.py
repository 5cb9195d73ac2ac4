"""Data-plane capabilities beyond collectives: one-sided reads, strided reads, prepared read
sets, asynchronous send/recv, and the handles they return.

A task checks once, at construction, which of these its communicator offers (``isinstance``
against these runtime-checkable Protocols) and keeps typed references. Protocols rather than
ABC mix-ins: a backend offers a capability by having the methods, without importing this
package. A method set to ``None`` on a class (``prepare_reads = None``) withdraws it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

ByteRead = tuple[str, int, "torch.Tensor"]
"""(remote exposed name, byte offset there, local tensor filled whole)."""
StridedRead = tuple[str, int, Sequence[int], "torch.Tensor"]
"""(remote exposed name, byte offset, remote element strides, local tensor of the same shape)."""


@runtime_checkable
class ReadHandle(Protocol):
    """An in-flight one-sided transfer."""

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the transfer completed; False or a ``TimeoutError`` after ``timeout`` s."""
        ...

    def done(self) -> bool:
        """True once the transfer completed (raises if it failed); never blocks."""
        ...


@runtime_checkable
class TransferHandle(Protocol):
    """A started ``isend`` / ``irecv``."""

    def wait(self, timeout: float | None = None) -> Any:
        """True once complete; False or ``TimeoutError`` when not within ``timeout`` s."""
        ...


@runtime_checkable
class ExposedDescriptor(Protocol):
    """What ``expose`` returns: handed to peers to import, as an object (the coordinator) or
    as ``to_bytes`` (a notification), which the peer's ``decode_exposed`` reads back."""

    @property
    def name(self) -> str:
        """The name the buffer is exposed under."""
        ...

    @property
    def mapping(self) -> Any:
        """What a same-node peer needs to map the buffer, or None (peers go through the wire)."""
        ...

    @property
    def writable(self) -> bool:
        """Whether the owner lets peers write the buffer (a WRITE target); else READ only."""
        ...

    def to_bytes(self) -> bytes:
        """The descriptor as bytes for a byte channel; never a pickle."""
        ...


@runtime_checkable
class PreparedReadSet(Protocol):
    """A set of reads from one peer laid out once; ``post`` starts them all."""

    def post(self) -> Any:
        """Start the reads; returns a ``ReadHandle`` or a list of them."""
        ...

    def close(self) -> None:
        """Release what the set holds; idempotent."""
        ...


@runtime_checkable
class OneSidedCommunicator(Protocol):
    """One-sided READ / WRITE into buffers that peers expose, plus ordered notifications.

    ``expose`` registers a local tensor under ``name``, read-only for peers unless it is a WRITE
    target (``writable=True``); ``exchange_exposed`` (collective) makes every member's exposures
    addressable; ``import_exposed`` does so for one descriptor received out of band
    (``decode_exposed`` reads one that came as bytes). ``read_async`` copies ``local``'s bytes
    from byte ``remote_offset`` of a peer's buffer; ``read_batch_async`` is one request over
    ``ByteRead`` triples. ``notify`` /
    ``wait_notification`` (``TimeoutError`` after ``timeout``) carry small messages, in order per
    peer. Ranks are the communicator's group ranks.
    """

    def expose(self, tensor: torch.Tensor, name: str, *, writable: bool = False) -> Any:
        """Register ``tensor`` for peers under ``name``; returns its descriptor. Peers may only
        read it (same-node peers map it read-only where the OS allows) unless ``writable``."""
        ...

    def unexpose(self, name: str) -> None:
        """Stop exposing ``name``."""
        ...

    def exchange_exposed(self) -> Any:
        """Collective: every member learns every other member's exposed buffers."""
        ...

    def import_exposed(self, desc: Any) -> None:
        """Make a peer's descriptor (received out of band) addressable."""
        ...

    def decode_exposed(self, data: bytes) -> ExposedDescriptor:
        """The descriptor a peer's ``ExposedDescriptor.to_bytes`` wrote; ValueError if malformed."""
        ...

    def read_async(
        self,
        peer: int,
        remote_name: str,
        local: torch.Tensor | Sequence[tuple[torch.Tensor, int, int]],
        remote_offset: int = 0,
    ) -> ReadHandle:
        """Start reading ``local``'s bytes from ``peer``'s buffer ``remote_name``."""
        ...

    def read_batch_async(self, peer: int, requests: Sequence[ByteRead]) -> ReadHandle:
        """Start one read over several (name, offset, local) requests of one peer."""
        ...

    def notify(self, peer: int, message: bytes) -> None:
        """Send ``message`` to ``peer``, ordered after this rank's completed transfers."""
        ...

    def wait_notification(self, peer: int, timeout: float | None = None) -> bytes:
        """The next message from ``peer``; ``TimeoutError`` after ``timeout`` s."""
        ...


@runtime_checkable
class StridedReadCommunicator(Protocol):
    """Reads of non-contiguous remote views, and whether peers' memory is mapped here."""

    @property
    def maps_peer_memory(self) -> bool:
        """Whether reads from same-node peers run as copies on a mapping of their memory."""
        ...

    def maps_exposed(self, peer: int, remote_name: str) -> bool:
        """Whether ``peer``'s exposed buffer ``remote_name`` is mapped here."""
        ...

    def read_strided_async(self, peer: int, requests: Sequence[StridedRead]) -> ReadHandle:
        """Start one read of strided remote views into local tensors."""
        ...


@runtime_checkable
class PreparedReadCommunicator(Protocol):
    """Read sets laid out once and posted many times."""

    def prepare_reads(
        self,
        peer: int,
        requests: Sequence[ByteRead] = (),
        strided: Sequence[StridedRead] = (),
    ) -> PreparedReadSet:
        """Lay out a set of reads from ``peer`` once; ``post`` starts them."""
        ...

    def merge_prepared(self, peer: int, sets: Sequence[Any]) -> PreparedReadSet | None:
        """One set doing what ``sets`` do, planned by none; None where they cannot merge."""
        ...


@runtime_checkable
class AsyncSendRecvCommunicator(Protocol):
    """Point-to-point transfers that are posted and then waited on with a timeout."""

    def isend(self, tensor: torch.Tensor, dst: int) -> TransferHandle:
        """Start sending ``tensor`` to ``dst``."""
        ...

    def irecv(self, tensor: torch.Tensor, src: int) -> TransferHandle:
        """Post a receive into ``tensor`` from ``src``."""
        ...
