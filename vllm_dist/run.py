"""Run one rank of a task in this process, placed by the launcher that started the process.

``torchrun``, ``srun`` and ``mpirun`` already start one process per rank; ``run_task`` is what
each of them runs, so a task written for ``MPLauncher`` runs unchanged under them. Wrapping those
tools in ``Launcher`` classes was rejected: they own the processes, and a launcher here would only
relay what their variables already say.
"""

from __future__ import annotations

import os
from typing import Any

from vllm_dist.interfaces import DistributedTask, WorkerInfo
from vllm_dist.log import configure as configure_logging


def run_task(task_type: type[DistributedTask], /, **kwargs: Any) -> Any:
    """Build ``task_type`` for this process's rank and return ``task.run(**kwargs)``.

    The rank, world, local rank and rendezvous come from ``WorkerInfo.from_env`` (torchrun,
    SLURM or Open MPI variables); the torchrun names are then set in ``os.environ`` too, as a
    vllm_dist launcher sets them, for code that reads them.

    Raises:
        TypeError: ``task_type`` is not a ``DistributedTask`` subclass.
        ValueError: the environment does not place this process; the message names what to set.
    """
    if not (isinstance(task_type, type) and issubclass(task_type, DistributedTask)):
        raise TypeError(f"task_type must be a DistributedTask subclass, got {task_type!r}")
    info = WorkerInfo.from_env()
    os.environ.update(info.env())
    configure_logging(rank=info.rank)  # VLLM_DIST_LOG_LEVEL, as under our own launchers
    return task_type(info).run(**kwargs)
