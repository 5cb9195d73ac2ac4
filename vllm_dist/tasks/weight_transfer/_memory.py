"""The storage arenas and copy engine the weight-transfer engines use, from one place."""

from vllm_dist.memory import (
    DEVICE_ARENA_BYTES,
    ArenaMap,
    CopyProgram,
    StreamPool,
    batched_copy,
    gather_device_storages,
    share_storages,
    shared_empty,
)

__all__ = [
    "DEVICE_ARENA_BYTES",
    "ArenaMap",
    "CopyProgram",
    "StreamPool",
    "batched_copy",
    "gather_device_storages",
    "share_storages",
    "shared_empty",
]
