"""What every data path offers its engine: one small interface per role.

The engine picks its path once, at construction (one-sided READ where the communicator offers
it, else push) and drives it through these methods; nothing else tests which path is in use.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping

import torch

from vllm_dist.tasks.weight_transfer.config import SyncStats
from vllm_dist.tasks.weight_transfer.pairs import ProducerPair
from vllm_dist.tasks.weight_transfer.plan import Chunk
from vllm_dist.tasks.weight_transfer.ring import FreeBarrier, SerialWorker


class ProducerPath(ABC):
    """How a producer serves a sync's chunks."""

    name: str
    """``"read"`` (one-sided) or ``"send_recv"``."""

    def begin(self, start: float) -> SyncStats | None:
        """Before the chunks: the stats of the whole sync where it was done here (a replay),
        else None."""
        return None

    def schedule(self, pairs: Mapping[int, ProducerPair]) -> list[tuple[int, int, int]]:
        """(group, consumer, chunk index) in serving order: (group, consumer, chunk), the one
        order every rank keeps (a consumer's plan runs group by group; within a group and
        consumer this producer's chunks come in the consumer's plan order)."""
        return sorted((c.group, cid, c.index) for cid, p in pairs.items() for c in p.chunks)

    def pair_worker(self, cid: int) -> SerialWorker | None:
        """The thread that serves consumer ``cid``'s chunks, where the path has one."""
        return None

    @abstractmethod
    def reset(self) -> None:
        """Per-pair state back to the start of a sync."""

    def new_group(self, barrier: FreeBarrier) -> None:  # noqa: B027 - optional hook
        """A new gather group is about to open."""

    def opened(self, group: int, tensors: Mapping[str, torch.Tensor]) -> None:  # noqa: B027
        """Gather group ``group`` was opened as ``tensors``."""

    @abstractmethod
    def serve(
        self,
        cid: int,
        pair: ProducerPair,
        chunk: Chunk,
        tensors: Mapping[str, torch.Tensor],
        barrier: FreeBarrier,
    ) -> None:
        """Serve one chunk to consumer ``cid``; its group is released through ``barrier``."""

    @abstractmethod
    def finish(self, barrier: FreeBarrier) -> None:
        """Every chunk was served: wait until every consumer has it."""

    def end(self) -> None:  # noqa: B027 - optional hook
        """The sync ended well."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the path holds."""


class ConsumerPath(ABC):
    """How a consumer takes a sync's chunks."""

    @abstractmethod
    def receive(self) -> bool:
        """Take one sync into the parameters; True when it ran as a replay."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the path holds."""
