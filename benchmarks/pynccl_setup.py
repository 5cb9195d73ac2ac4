"""How long PyNcclCommunicator takes to set up, against NCCL's own ncclCommInitRank.

Question: is communicator set-up for N ranks within 2x of ``ncclCommInitRank``? For each
world size, every rank of one launch times, ``--repeats`` times each:

- ``nccl_init``: ``ncclCommInitRank`` alone, the unique id already shared (NCCL's floor);
- ``pynccl``: ``PyNcclCommunicator(coordinator)`` end to end (library load, unique id, its
  broadcast over the coordinator, init);
- ``torch_nccl``: ``TorchDistributedCommunicator`` on CUDA (an eagerly initialised NCCL process
  group), for context.

A repeat's time is the slowest rank's (set-up is done when the last rank is); the table gives the
median over repeats and the ratio pynccl / nccl_init.

    python benchmarks/pynccl_setup.py results/pynccl_setup.json --ranks 1 2 4 8 --repeats 5

Writes the JSON to the path given, and a PNG beside it when matplotlib is installed.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

import torch
from _common import make_parser  # the script's own directory is on sys.path

from vllm_dist import (
    CommunicatorType,
    CoordinatorType,
    GlobalCoordinatorDistributedTask,
    MPLauncher,
)
from vllm_dist.implementations.communicators.pynccl.communicator import PyNcclCommunicator
from vllm_dist.implementations.communicators.pynccl.library import load_nccl
from vllm_dist.implementations.communicators.torch_distributed import (
    TorchDistributedCommunicator,
)

KINDS = ("nccl_init", "pynccl", "torch_nccl")


class SetupTimingTask(GlobalCoordinatorDistributedTask):
    """Times each kind of set-up ``repeats`` times; returns {kind: [seconds, ...]} per rank."""

    def post_init_distributed(self, repeats: int = 5, **_: Any) -> dict[str, list[float]]:
        times: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for _repeat in range(repeats):
            times["nccl_init"].append(self._raw_init())
            times["pynccl"].append(self._timed(lambda: PyNcclCommunicator(self.coordinator)))
            times["torch_nccl"].append(
                self._timed(lambda: TorchDistributedCommunicator(self.coordinator, device="cuda"))
            )
        return times

    def _raw_init(self) -> float:
        lib = load_nccl()
        rank, world = self.coordinator.get_rank(), self.coordinator.get_world_size()
        uid = self.coordinator.broadcast_object(lib.get_unique_id() if rank == 0 else None, 0)
        torch.cuda.set_device(self.device)
        self.coordinator.barrier()
        start = time.perf_counter()
        comm = lib.comm_init_rank(world, uid, rank)
        elapsed = time.perf_counter() - start
        lib.comm_abort(comm)
        return elapsed

    def _timed(self, make: Any) -> float:
        self.coordinator.barrier()
        start = time.perf_counter()
        comm = make()
        elapsed = time.perf_counter() - start
        comm.close()
        return elapsed


def measure(world_size: int, repeats: int, timeout: float) -> dict[str, Any]:
    per_rank = MPLauncher(world_size, timeout=timeout).launch(
        task_type=SetupTimingTask,
        coordinator_type=CoordinatorType.TORCH_DISTRIBUTED,
        communicator_type=CommunicatorType.TORCH_DISTRIBUTED,  # the task builds its own
        device="cuda",
        repeats=repeats,
    )
    row: dict[str, Any] = {"ranks": world_size, "repeats": repeats}
    for kind in KINDS:
        slowest = [max(rank[kind][i] for rank in per_rank) for i in range(repeats)]
        row[f"{kind}_ms"] = statistics.median(slowest) * 1e3
        row[f"{kind}_all_ms"] = [s * 1e3 for s in slowest]
    row["ratio_pynccl_vs_nccl_init"] = row["pynccl_ms"] / row["nccl_init_ms"]
    return row


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'ranks':>5} {'nccl_init ms':>13} {'pynccl ms':>10} {'torch_nccl ms':>14} {'ratio':>6}")
    for r in rows:
        print(
            f"{r['ranks']:>5} {r['nccl_init_ms']:>13.1f} {r['pynccl_ms']:>10.1f} "
            f"{r['torch_nccl_ms']:>14.1f} {r['ratio_pynccl_vs_nccl_init']:>6.2f}"
        )


def plot(rows: list[dict[str, Any]], path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    ranks = [r["ranks"] for r in rows]
    for kind in KINDS:
        ax.plot(ranks, [r[f"{kind}_ms"] for r in rows], marker="o", label=kind)
    ax.set_xlabel("ranks")
    ax.set_ylabel("set-up time, median of slowest rank (ms)")
    ax.set_xticks(ranks)
    ax.legend()
    ax.grid(alpha=0.3)
    png = path.rsplit(".", 1)[0] + ".png"
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    return png


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__, whole=True)
    parser.add_argument("output", help="where to write the JSON results (a PNG goes beside)")
    parser.add_argument(
        "--ranks", type=int, nargs="+", default=[1, 2, 4, 8], help="world sizes to time"
    )
    parser.add_argument("--repeats", type=int, default=5, help="set-ups per world size")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    args = parser.parse_args(argv)

    reason = PyNcclCommunicator.unavailable_reason("cuda")
    if reason:
        print(f"cannot run: {reason}", file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count()
    ranks = [n for n in args.ranks if n <= gpus]  # NCCL refuses two ranks on one GPU
    skipped = sorted(set(args.ranks) - set(ranks))
    if skipped:
        print(f"skipping {skipped} ranks: only {gpus} GPU(s) here", file=sys.stderr)
    rows = [measure(n, args.repeats, args.timeout) for n in ranks]
    print_table(rows)
    result = {
        "benchmark": "pynccl_setup",
        "nccl": load_nccl().version_string,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "rows": rows,
    }
    with open(args.output, "w") as f:
        json.dump(result, f, indent=2)
    png = plot(rows, args.output)
    print(f"wrote {args.output}" + (f" and {png}" if png else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
