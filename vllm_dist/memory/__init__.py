"""Backend-free memory and copies: storage arenas and in-place storage moves, copy kernels,
copy planning, and recorded copy programs (CUDA graphs).

Process-wide bookkeeping is held by objects that their owner passes in (``ArenaMap`` for the
arenas made, ``StreamPool`` for graph-capture streams), never by module globals. This package
imports only torch, numpy, the standard library and ``vllm_dist.interfaces``.
"""

from vllm_dist.memory.arenas import (
    DEVICE_ARENA_BYTES,
    SHM_SPARE_BYTES,
    ArenaMap,
    gather_device_storages,
    share_storages,
    shared_empty,
)
from vllm_dist.memory.copyplan import SOLO_COPY_BYTES
from vllm_dist.memory.kernels import IndexedCopy, RowGather, batched_copy, widest_views
from vllm_dist.memory.programs import GRAPH_BRANCHES, CopyProgram, StreamPool, balance

__all__ = [
    "DEVICE_ARENA_BYTES",
    "GRAPH_BRANCHES",
    "SHM_SPARE_BYTES",
    "SOLO_COPY_BYTES",
    "ArenaMap",
    "CopyProgram",
    "IndexedCopy",
    "RowGather",
    "StreamPool",
    "balance",
    "batched_copy",
    "gather_device_storages",
    "share_storages",
    "shared_empty",
    "widest_views",
]
