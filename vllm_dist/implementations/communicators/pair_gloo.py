"""PairGlooCommunicator: send/recv over one two-member gloo group per peer, built at run time.

A gloo group over a whole fleet takes no new member and breaks when one dies. A
``torch.distributed.ProcessGroupGloo(store, rank, 2)`` needs no default group, so an elastic
fleet builds one per (producer, consumer) pair when the consumer is admitted (``add_peer``),
over a ``PrefixStore`` of the fleet's authenticated store named by both members' incarnations,
and drops it when the consumer leaves (``remove_peer``): no other pair notices. The
rendezvous keys gloo leaves in the store are deleted once both ends hold the group, so the
store does not grow as consumers come and go. CPU tensors
only (gloo); rejected alternative: a ``ProcessGroupNCCL`` per pair, which would hold a NCCL
communicator per pair in VRAM and is left for when a GPU fleet over NCCL needs it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from vllm_dist.implementations.communicators.common import SendRecvOnly, check_tensor
from vllm_dist.implementations.communicators.torch_distributed import PendingTransfer
from vllm_dist.interfaces import CommOp, DeviceCommunicator, WorkerCoordinator


class PairGlooCommunicator(SendRecvOnly, DeviceCommunicator):
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
        self._prefixes: dict[int, str] = {}  # peer rank -> its pair group's store prefix

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
        prefix = f"pairpg/{names[0]}/{names[1]}/"
        self._prefixes[rank] = prefix  # from here on remove_peer deletes its keys
        store = dist.PrefixStore(prefix, member.fleet.store)
        group = dist.ProcessGroupGloo(store, me, 2, timedelta(seconds=self._timeout))
        self._groups[rank] = (group, 1 - me)
        # rank 1 of the pair tells rank 0 it holds the group (so it read rank 0's key); rank 0
        # held it already (it read rank 1's), so it then deletes both rendezvous keys
        done = torch.zeros(1, dtype=torch.uint8)
        if me == 1:
            self.send(done, rank)
        else:
            self.recv(done, rank)
            self._forget_keys(self._prefixes.pop(rank))

    def remove_peer(self, rank: int) -> None:
        """Drop the pair group with ``rank`` (it left) and any of its keys left in the store
        (a peer that died while the group was built); others are untouched."""
        self._groups.pop(rank, None)
        prefix = self._prefixes.pop(rank, None)
        if prefix is not None:
            self._forget_keys(prefix)

    def _forget_keys(self, prefix: str) -> None:
        """Delete the store keys under ``prefix`` (a pair group's rendezvous)."""
        store = self._member().fleet.store
        for key in store.list_keys():
            if key.startswith(prefix):
                store.delete_key(key)

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

    def close(self) -> None:
        self._groups.clear()
