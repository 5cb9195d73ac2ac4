"""How much CPU does an idle NIXL_RDT worker burn, by progress-thread poll delay?

NIXL's Python agent busy-polls a core per worker with its progress thread (poll delay 0);
``NixlOptions.progress_delay_us`` > 0 lets the thread sleep until UCX has work. For each delay,
one two-rank launch moves 1 MiB once (so UCX's endpoints exist), then every rank measures the
CPU seconds its process uses per wall second while it sits idle. A delay of 0 is the control:
it should show about one core per worker, the default (1 us on DRAM) close to nothing. A
measurement, not a test: a loaded machine moves both numbers.

    python benchmarks/nixl_idle_cpu.py [--delays auto,0,1,100] [--seconds 1] [--repeats 3]
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from _common import make_parser, median, print_table, write_outputs  # noqa: E402

from vllm_dist import (  # noqa: E402
    CommunicatorType,
    CoordinatorType,
    GlobalCoordinatorDistributedTask,
    MPLauncher,
)
from vllm_dist.serialization import register_by_value  # noqa: E402

register_by_value(__name__)  # benchmark module is not importable from a worker's cwd


class IdleCpuTask(GlobalCoordinatorDistributedTask):
    """CPU seconds per wall second of this worker while its agent is idle, ``repeats`` times."""

    def post_init_distributed(self, seconds: float = 1.0, repeats: int = 3, **_: Any) -> Any:
        comm: Any = self.communicator
        buf = torch.zeros(1 << 20, dtype=torch.uint8)
        if self.coordinator.get_rank() == 0:
            comm.send(buf, dst=1)
        else:
            comm.recv(buf, src=0)
        used = []
        for _repeat in range(repeats):
            self.coordinator.barrier()
            cpu0, wall0 = time.process_time(), time.monotonic()
            time.sleep(seconds)
            used.append((time.process_time() - cpu0) / (time.monotonic() - wall0))
        self.coordinator.barrier()
        return {"cpu_per_s": used, "delay_us": comm.describe()["progress_delay_us"]}


def measure(delay: int | None, seconds: float, repeats: int, timeout: float) -> dict[str, Any]:
    """One launch at poll delay ``delay`` (None: the communicator's default)."""
    options: dict[str, Any] = {"timeout": 60.0}
    if delay is not None:
        options["progress_delay_us"] = delay
    ranks = MPLauncher(2, timeout=timeout).launch(
        task_type=IdleCpuTask,
        coordinator_type=CoordinatorType.TORCH_DISTRIBUTED,
        communicator_type=CommunicatorType.NIXL_RDT,
        device="cpu",
        communicator_options=options,
        seconds=seconds,
        repeats=repeats,
    )
    per_rank = [median(r["cpu_per_s"]) for r in ranks]
    return {
        "delay": "auto" if delay is None else str(delay),
        "delay_us": ranks[0]["delay_us"],
        "cpu_per_s_by_rank": per_rank,
        "cpu_per_s_max": max(per_rank),
        "samples": [r["cpu_per_s"] for r in ranks],
    }


def plot(rows: list[dict[str, Any]], png: str) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    labels = [f"{r['delay']} ({r['delay_us']} us)" for r in rows]
    ax.bar(labels, [r["cpu_per_s_max"] for r in rows])
    ax.set_xlabel("progress_delay_us option (effective)")
    ax.set_ylabel("idle CPU per wall second, busiest rank")
    ax.grid(True, axis="y", alpha=0.3)
    fig.savefig(png, dpi=120, bbox_inches="tight")


def main() -> None:
    p = make_parser(__doc__, whole=True)
    p.add_argument(
        "--delays",
        default="auto,0,1,100",
        help="progress-thread poll delays in microseconds, comma-separated (auto: the default)",
    )
    p.add_argument("--seconds", type=float, default=1.0, help="idle window per sample, seconds")
    p.add_argument("--repeats", type=int, default=3, help="samples per rank (median reported)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per launch")
    p.add_argument("--out", default="bench_results/nixl_idle_cpu.json", help="JSON path")
    args = p.parse_args()
    delays = [None if d == "auto" else int(d) for d in args.delays.split(",")]
    rows = [measure(d, args.seconds, args.repeats, args.timeout) for d in delays]
    print_table(
        "idle NIXL_RDT worker: CPU seconds per wall second (median of samples)",
        ["delay", "delay_us", "rank0", "rank1", "max"],
        [[r["delay"], r["delay_us"], *r["cpu_per_s_by_rank"], r["cpu_per_s_max"]] for r in rows],
    )
    payload = {"benchmark": "nixl_idle_cpu", "seconds": args.seconds, "rows": rows}
    write_outputs(args.out, payload, lambda png: plot(rows, png))


if __name__ == "__main__":
    main()
