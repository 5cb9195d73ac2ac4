"""The storage arenas and copy engine the weight-transfer engines use, from one place.

They live in a backend-free module; importing them here only means the engines switch a single
import when that module moves.
"""

from vllm_dist.implementations.communicators.common import (
    DEVICE_ARENA_BYTES,
    CopyProgram,
    arena_range,
    batched_copy,
    gather_device_storages,
    share_storages,
    shared_arena,
    shared_empty,
)

__all__ = [
    "DEVICE_ARENA_BYTES",
    "CopyProgram",
    "arena_range",
    "batched_copy",
    "gather_device_storages",
    "share_storages",
    "shared_arena",
    "shared_empty",
]
