"""PairNcclCommunicator: send/recv over one two-rank NCCL communicator per peer, built at run time.

A NCCL communicator over a whole fleet takes no new member, and one dead member stalls it. An
elastic fleet on GPUs therefore makes one per (producer, consumer) pair when the consumer is
admitted (``add_peer``, both ends): the lower rank makes the unique id and sends it over the
coordinator's object messages (the fleet's signed messages, never the data plane), both call
``ncclCommInitRank(2, ...)``. When the consumer leaves or dies the pair is aborted
(``remove_peer``): ``ncclCommAbort`` ends the pair's operations still queued on a stream, so a
dead peer holds up the others only until it is found gone. No other pair notices.

Operations are queued on the current CUDA stream, as ``PyNcclCommunicator`` does; the engines'
stream-ordered push path issues them in one fleet-wide order. Rejected alternative: a
``torch.distributed.ProcessGroupNCCL`` per pair, whose watchdog tears the whole process down
when a peer dies (``TORCH_NCCL_ASYNC_ERROR_HANDLING``) unless that is turned off process-wide.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, ClassVar

import torch

from vllm_dist.implementations.communicators.common import SendRecvOnly, check_tensor
from vllm_dist.implementations.communicators.pynccl.communicator import _cuda_device, move_args
from vllm_dist.implementations.communicators.pynccl.library import (
    NcclLibrary,
    load_nccl,
    torch_dtype_table,
)
from vllm_dist.interfaces import CommOp, DeviceCommunicator, WorkerCoordinator

logger = logging.getLogger("vllm_dist")

ABORT_WAIT_S = 10.0  # how long close() waits for each pair's abort before going on
INIT_POLL_S = 0.2  # how often a pair's set-up asks the coordinator whether the peer left


class PairNcclCommunicator(SendRecvOnly, DeviceCommunicator):
    """Point-to-point transfers on CUDA memory with each peer over a NCCL communicator of its own.

    Args:
        coordinator: carries each pair's unique id (``send_object``/``recv_object``): the
            fleet's ``SlotCoordinator`` in an elastic fleet.
        device: a CUDA device; None or ``"cuda"`` = ``cuda:<local rank>``.
        timeout: seconds a pair's set-up may take (the peer must reach ``add_peer`` too).
        library_path: a libnccl to load instead of searching (``library.load_nccl``).
    """

    supported_ops: ClassVar[frozenset[CommOp]] = frozenset({CommOp.SEND, CommOp.RECV})

    def __init__(
        self,
        coordinator: WorkerCoordinator,
        device: torch.device | str | None = None,
        *,
        timeout: float = 60.0,
        library_path: str | None = None,
    ) -> None:
        self._pairs: dict[int, tuple[int, int]] = {}  # peer rank -> (comm, peer's pair rank)
        self._device = _cuda_device(coordinator, device)
        self._lib: NcclLibrary = load_nccl(library_path)
        self._coord = coordinator
        self._rank = coordinator.get_rank()
        self._timeout = timeout
        self._dtypes = torch_dtype_table(self._lib.version)
        self._lock = threading.Lock()
        self._aborts: list[threading.Thread] = []  # aborts issued, joined by close()

    @property
    def device(self) -> torch.device:
        return self._device

    def describe(self) -> dict[str, Any]:
        return {
            "backend": "pynccl pairs",
            "nccl": self._lib.version_string,
            "device": str(self._device),
            "rank": self._rank,
            "peers": sorted(self._pairs),
        }

    # -- peers -----------------------------------------------------------------------------------
    def peer_info(self) -> None:
        """Nothing: the pair's unique id travels in ``add_peer`` itself."""
        return None

    def add_peer(self, rank: int, info: Any = None) -> None:
        """Build the pair communicator with ``rank``: a rendezvous, so both ends call it (in the
        same order of pairs). Raises ``TimeoutError`` when the peer does not join in time."""
        self.remove_peer(rank)
        me = 0 if self._rank < rank else 1
        if me == 0:
            unique_id = self._lib.get_unique_id()
            self._coord.send_object(unique_id, dst=rank)
        else:
            unique_id = self._coord.recv_object(src=rank)
            if not isinstance(unique_id, bytes):
                raise TypeError(f"rank {rank} sent a {type(unique_id).__name__}, not a NCCL id")
        comm = self._init(unique_id, me, rank)
        with self._lock:
            self._pairs[rank] = (comm, 1 - me)

    def _init(self, unique_id: bytes, me: int, rank: int) -> int:
        """``ncclCommInitRank(2)`` on a thread of its own, bounded by the timeout; a late one
        is aborted as soon as it returns, so it never leaks."""
        box: dict[str, Any] = {}
        given_up, lock = threading.Event(), threading.Lock()

        def give_up(why: str) -> TimeoutError:
            with lock:
                given_up.set()
                done = "comm" in box  # it returned meanwhile: abort it here
            if done:
                self._abort_soon(box["comm"])
            return TimeoutError(f"rank {self._rank}: {why}")

        def run() -> None:
            try:
                with torch.cuda.device(self._device):
                    comm = self._lib.comm_init_rank(2, unique_id, me)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box["error"] = exc
                return
            with lock:
                box["comm"] = comm
                late = given_up.is_set()
            if late:
                self._abort(comm)

        thread = threading.Thread(target=run, name=f"nccl-pair-{rank}", daemon=True)
        thread.start()
        # a coordinator that knows when a rank's holder left (an elastic fleet's roster) ends
        # the wait for a dead peer early
        gone = getattr(self._coord, "gone", None)
        deadline = time.monotonic() + self._timeout
        while thread.is_alive() and time.monotonic() < deadline:
            thread.join(INIT_POLL_S)
            if thread.is_alive() and gone is not None and gone(rank):
                raise give_up(f"the holder of rank {rank} left before their NCCL pair was set up")
        if thread.is_alive():
            raise give_up(
                f"the NCCL pair with rank {rank} was not set up within {self._timeout} s (the "
                "peer died or never called add_peer)"
            )
        if "error" in box:
            raise box["error"]
        return int(box["comm"])

    def remove_peer(self, rank: int) -> None:
        """Abort the pair with ``rank``: its operations still queued end, its memory is freed;
        the other pairs are untouched."""
        with self._lock:
            pair = self._pairs.pop(rank, None)
        if pair is not None:
            self._abort_soon(pair[0])

    def _abort(self, comm: int) -> None:
        with torch.cuda.device(self._device):
            self._lib.comm_abort(comm)

    def _abort_soon(self, comm: int) -> None:
        """Abort ``comm`` on a thread of its own, not waiting: its clean-up may wait for the
        device, which another pair's kernels (a peer not yet found dead) can hold up."""
        thread = threading.Thread(target=self._abort, args=(comm,), name="nccl-abort", daemon=True)
        thread.start()
        self._aborts.append(thread)

    def _pair(self, peer: int) -> tuple[int, int]:
        pair = self._pairs.get(peer)
        if pair is None:
            raise ValueError(f"rank {peer} is not a peer of rank {self._rank} (add_peer it first)")
        return pair

    # -- point to point (queued on the current stream) -----------------------------------------
    def send(self, tensor: torch.Tensor, dst: int) -> None:
        check_tensor(tensor, self._device)
        comm, peer = self._pair(dst)
        count, dtype = move_args(self._dtypes, tensor)
        self._lib.send(tensor.data_ptr(), count, dtype, peer, comm, self._stream())

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        check_tensor(tensor, self._device)
        comm, peer = self._pair(src)
        count, dtype = move_args(self._dtypes, tensor)
        self._lib.recv(tensor.data_ptr(), count, dtype, peer, comm, self._stream())
        return tensor

    def _stream(self) -> int:
        return int(torch.cuda.current_stream(self._device).cuda_stream)

    def close(self) -> None:
        """Abort every pair (each on a thread of its own) and wait, bounded, for the aborts."""
        with self._lock:
            comms, self._pairs = [c for c, _ in self._pairs.values()], {}
        for comm in comms:
            self._abort_soon(comm)
        aborts, self._aborts = self._aborts, []
        for thread in aborts:
            thread.join(ABORT_WAIT_S)
            if thread.is_alive():
                logger.warning(
                    "vllm_dist: a NCCL pair's abort did not return in %s s", ABORT_WAIT_S
                )
