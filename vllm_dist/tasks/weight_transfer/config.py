"""The settings, results and errors of a weight-transfer deployment, and its tuning constants.

Everything here is plain data: the engines, their paths and the task import it, it imports
nothing of theirs. The tuning constants are module constants rather than ``TransferConfig``
fields because producers and consumers never need to agree on them and users never tune them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from vllm_dist.tasks.weight_transfer.ops import Loader
from vllm_dist.tasks.weight_transfer.plan import LayoutConfig

Route = Callable[[str], Iterable[tuple[str, Loader]]]
"""``route(hf_name)`` -> the (destination parameter name, loader) pairs that take that weight."""

MAX_PINNED = 1024
"""Destination storages a consumer registers up front on the READ path."""
BATCHES_IN_FLIGHT = 4
"""Batched reads a consumer keeps posted at once on the READ path."""
ANNOUNCE_BYTES = 256 << 20
"""A producer announces at least this often within a long group (READ path)."""
FIRST_ANNOUNCE_BYTES = 16 << 20
"""The first announcement of a sync, when announcements are batched by bytes."""
RECV_AHEAD = 8
"""Push path: receives a consumer keeps posted per producer (``irecv``)."""
STRIDED_DIRECT_BYTES = 8 << 10
"""With strided reads, items this large travel alone and are read in place."""


class UnservedNameError(ValueError):
    """A consumer asked a producer for a weight that producer does not hold or serve."""


class WeightTransferSetupError(RuntimeError):
    """Set-up failed on another rank of the fleet; the message carries that rank's reason."""


class UnfilledWeightsError(WeightTransferSetupError):
    """Set-up found weights a consumer routes that no producer holds, or consumer parameters
    that no route fills: either would stay stale through every sync."""


class TornModelError(RuntimeError):
    """A sync failed part-way: the consumer's parameters may be part old, part new.

    ``held``: the version fully held before it (None: none yet); ``target``: the version it
    was receiving. The next successful sync rewrites every parameter it fills.
    """

    def __init__(self, message: str, *, held: int | None, target: int) -> None:
        super().__init__(message)
        self.held = held
        self.target = target


@dataclass(frozen=True, kw_only=True, slots=True)
class TransferConfig:
    """Settings of one weight-transfer deployment; producers and consumers must agree."""

    ring_slots: int = 2
    """K, the serve-ring slots per (producer, consumer) pair."""
    align: int = 256
    """Byte alignment of every packed item."""
    max_chunk_bytes: int = 64 << 20
    """A gather group's items are split into chunks of at most this size."""
    stall_timeout: float = 60.0
    """Seconds any wait on a peer may take before ``TransferStallError``."""
    workers_per_replica: int = 0
    """Consumers per inference replica (0: the whole fleet is one replica)."""
    presize_bytes: int = 0
    """Serve buffers are at least this large (``buffer_alloc_bytes``)."""
    direct_bytes: int = 1 << 20
    """Items this large travel alone, straight from the source view into the destination
    view where those are contiguous (no pack, no unpack)."""
    announce_bytes: int = 0
    """READ path. 0: announce at every gather group. N > 0: announcements double in size from
    16 MiB up to N bytes (or an eighth of the pair's bytes), for when round trips are dear."""
    transport: str = "auto"
    """``"auto"`` (one-sided READ where offered, else send/recv), ``"read"`` (refuse a
    communicator without READ) or ``"send_recv"``."""
    strided_reads: bool | None = None
    """READ path: consumers read non-contiguous source views in place. None: where the
    communicator maps its peers' memory; True: also through NIXL (a descriptor per row)."""
    mapped_unpack: bool = True
    """READ path with strided reads on a mapped ring: copy each packed item straight from the
    producer's ring slot into its parameter (one copy where read and unpack were two)."""
    share_cpu_weights: bool = True
    """Producer, CPU, consumers that map its memory: move the source's storages into shared
    memory once at set-up (in place), so consumers read the trainer's memory and nothing is
    packed."""
    share_gpu_weights: bool = True
    """The same on CUDA: the storages of weights travelling in chunks of several move into
    VRAM arenas at set-up. Data pointers the trainer took before set-up go stale."""
    gather_cpu_params: bool = True
    """Consumer, CPU: move parameters receiving chunks of several into private arenas at
    set-up, in chunk order, so copies batch; the model must not run during set-up."""
    replay: bool = True
    """READ path, resident source: a sync in which no tensor moved runs as a replay of the
    last one (one message per consumer). False: every sync chunk by chunk."""
    allow_unfilled_params: bool = False
    """Consumer: accept parameters that no route fills (they keep what they hold); by
    default set-up refuses them, naming them."""
    atomic: bool = False
    """Consumer: receive into a staging copy of every parameter it fills and copy it into
    the live parameters only once the whole sync arrived, so a failed sync leaves the last
    version intact (never torn). Costs a second copy of those parameters in memory and one
    device copy of them per sync."""
    push_threads: bool | None = None
    """Push path. True: a thread per (producer, consumer) pair; False: one fleet-wide order
    from each rank's own thread (what NCCL needs). None: False on CUDA, True elsewhere."""

    def __post_init__(self) -> None:
        self.layout()  # validates the layout fields
        if self.transport not in ("auto", "read", "send_recv"):
            raise ValueError(
                f"transport must be 'auto', 'read' or 'send_recv', got {self.transport!r}"
            )
        if self.stall_timeout <= 0:
            raise ValueError(f"stall_timeout must be positive, got {self.stall_timeout}")
        if self.workers_per_replica < 0 or self.presize_bytes < 0 or self.announce_bytes < 0:
            raise ValueError("workers_per_replica, presize_bytes and announce_bytes must be >= 0")

    def layout(self) -> LayoutConfig:
        """The layout fields as the planner takes them."""
        return LayoutConfig(
            align=self.align,
            max_chunk_bytes=self.max_chunk_bytes,
            ring_slots=self.ring_slots,
            direct_bytes=self.direct_bytes,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class Fleet:
    """Which ranks of the coordinator's group are producers and which are consumers."""

    producer_ranks: tuple[int, ...]
    consumer_ranks: tuple[int, ...]

    def __post_init__(self) -> None:
        ranks = [*self.producer_ranks, *self.consumer_ranks]
        if not self.producer_ranks or not self.consumer_ranks or len(set(ranks)) != len(ranks):
            raise ValueError(f"a fleet needs distinct producer and consumer ranks, got {self}")

    @classmethod
    def split(cls, num_producers: int, num_consumers: int) -> Fleet:
        """Ranks ``[0, P)`` produce, ``[P, P + C)`` consume."""
        return cls(
            producer_ranks=tuple(range(num_producers)),
            consumer_ranks=tuple(range(num_producers, num_producers + num_consumers)),
        )


@dataclass(kw_only=True)
class SyncStats:
    """One sync as seen by one rank."""

    seconds: float
    bytes: int
    chunks: int
    path: str
    packed: int = 0
    """Chunks that went through a pack (producer) or an unpack (consumer) copy."""
    replayed: bool = False
    """READ path: the whole sync ran as a replay of the previous one."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "seconds": self.seconds,
            "bytes": self.bytes,
            "chunks": self.chunks,
            "path": self.path,
            "packed": self.packed,
            "replayed": self.replayed,
        }
