"""PairGlooCommunicator: send/recv over one two-member gloo group per peer, built at run time.

A gloo group over a whole fleet takes no new member and breaks when one dies. A
``torch.distributed.ProcessGroupGloo(store, rank, 2)`` needs no default group, so an elastic
fleet builds one per (producer, consumer) pair when the consumer is admitted (``add_peer``),
over a ``PrefixStore`` of the fleet's authenticated store named by both members' incarnations,
and drops it when the consumer leaves (``remove_peer``): no other pair notices. CPU tensors
only (gloo); rejected alternative: a ``ProcessGroupNCCL`` per pair, which would hold a NCCL
communicator per pair in VRAM and is left for when a GPU fleet over NCCL needs it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from vllm_dist.implementations.communicators.common import check_tensor
from vllm_dist.implementations.communicators.torch_distributed import PendingTransfer
from vllm_dist.interfaces import CommOp, DeviceCommunicator, ReduceOp, WorkerCoordinator


class PairGlooCommunicator(DeviceCommunicator):
    """Point-to-point transfers with each peer over a gloo group of its own.

    Args:
        coordinator: the fleet's ``SlotCoordinator`` (its rank, and once attached, the member
            whose store and id name the pair groups).
        device: must be the CPU (None means the CPU).
        timeout: seconds a pair group's set-up or transfer may take.
    """

    supported_ops: ClassVar[frozenset[CommOp]] = frozenset({CommOp.SEND, CommOp.RECV})

    def __init__(
        self,
        coordinator: WorkerCoordinator,
        device: torch.device | str | None = None,
        *,
        timeout: float = 60.0,
    ) -> None:
        self._device = torch.device("cpu" if device is None else device)
        if self._device.type != "cpu":
            raise ValueError(
                f"PairGlooCommunicator moves CPU tensors (gloo); got device {self._device}: use "
                "the nixl_rdt communicator for an elastic fleet on GPUs"
            )
        self._coord = coordinator
        self._rank = coordinator.get_rank()
        self._timeout = timeout
        self._groups: dict[int, tuple[Any, int]] = {}  # peer rank -> (group, peer's index)

    @property
    def device(self) -> torch.device:
        return self._device

    # -- peers -----------------------------------------------------------------------------------
    def _member(self) -> Any:
        member = getattr(self._coord, "member", None)
        if member is None:
            raise RuntimeError("PairGlooCommunicator needs a SlotCoordinator attached to a member")
        return member

    def peer_info(self) -> str:
        """This worker's member id: both ends name their pair group by the two ids."""
        return str(self._member().id)

    def add_peer(self, rank: int, info: Any) -> None:
        """Build the pair group with the member ``info`` (its ``peer_info()``) that holds
        ``rank``: a rendezvous, so both ends call it (in the same order of pairs)."""
        self.remove_peer(rank)
        member = self._member()
        mine, theirs = str(member.id), str(info)
        me = 0 if self._rank < rank else 1
        names = (mine, theirs) if me == 0 else (theirs, mine)
        # the member's own connection: gloo uses the store only while this call rendezvouses,
        # on this thread (a clone of the Python store does not work under gloo)
        store = dist.PrefixStore(f"pairpg/{names[0]}/{names[1]}/", member.fleet.store)
        group = dist.ProcessGroupGloo(store, me, 2, timedelta(seconds=self._timeout))
        self._groups[rank] = (group, 1 - me)

    def remove_peer(self, rank: int) -> None:
        """Drop the pair group with ``rank`` (it left); others are untouched."""
        self._groups.pop(rank, None)

    def _pair(self, peer: int) -> tuple[Any, int]:
        pair = self._groups.get(peer)
        if pair is None:
            raise ValueError(f"rank {peer} is not a peer of rank {self._rank} (add_peer it first)")
        return pair

    # -- point to point --------------------------------------------------------------------------
    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self.isend(tensor, dst).wait(self._timeout)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        self.irecv(tensor, src).wait(self._timeout)
        return tensor

    def isend(self, tensor: torch.Tensor, dst: int) -> PendingTransfer:
        check_tensor(tensor, self._device)
        group, peer = self._pair(dst)
        return PendingTransfer(group.send([tensor], peer, 0), f"send to rank {dst}")

    def irecv(self, tensor: torch.Tensor, src: int) -> PendingTransfer:
        check_tensor(tensor, self._device)
        group, peer = self._pair(src)
        return PendingTransfer(group.recv([tensor], peer, 0), f"recv from rank {src}")

    # -- collectives: none (a fleet of pairs) ----------------------------------------------------
    def _unsupported(self, op: str) -> Exception:
        return NotImplementedError(f"PairGlooCommunicator has no {op}: it only sends and receives")

    def all_reduce(
        self,
        tensor_in: torch.Tensor,
        tensor_out: torch.Tensor | None = None,
        op: ReduceOp = ReduceOp.SUM,
    ) -> torch.Tensor:
        raise self._unsupported("all_reduce")

    def all_gather(
        self, tensor_in: torch.Tensor, tensor_out: torch.Tensor | None = None
    ) -> torch.Tensor:
        raise self._unsupported("all_gather")

    def reduce_scatter(
        self,
        tensor_in: torch.Tensor,
        tensor_out: torch.Tensor | None = None,
        op: ReduceOp = ReduceOp.SUM,
    ) -> torch.Tensor:
        raise self._unsupported("reduce_scatter")

    def broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        raise self._unsupported("broadcast")

    def close(self) -> None:
        self._groups.clear()
