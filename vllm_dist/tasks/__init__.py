"""Distributed tasks: compose a coordinator and a communicator from the registry.

Concrete tasks (``all_reduce``, ``weight_transfer``) are imported from their own modules so that
importing this package does not import torch.
"""

from vllm_dist.tasks.base import GlobalCoordinatorDistributedTask, GroupCoordinatorDistributedTask

__all__ = ["GlobalCoordinatorDistributedTask", "GroupCoordinatorDistributedTask"]
