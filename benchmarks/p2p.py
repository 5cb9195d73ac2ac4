"""Point-to-point bandwidth between two worker processes: NIXL_RDT against torch.distributed.

Question: how close do two processes on one node get to a single-process copy of the same bytes?
For each size it measures, in the same run, NIXL_RDT READ / WRITE / send-recv, torch.distributed
send/recv (gloo on CPU, NCCL on CUDA; NCCL refuses two ranks on one GPU, reported as n/a), and
the baseline: ``copy_`` into a preallocated tensor in one process (CPU) or an in-process
device-to-device copy (CUDA). Targets: >= 40% of ``copy_`` on CPU and >= 85% of the device copy
on one GPU, for 64 MiB and up.

    python benchmarks/p2p.py [--device cpu|cuda] [--quick] [--out bench_results/p2p.json]

Prints a table, writes JSON and a PNG next to it; each size prints a line to stderr as it
finishes. Sizes are exact MiB (2^20 bytes) of payload per transfer. The JSON records which
transport carried the bytes (``describe()`` of the communicator: NIXL backend, UCX settings).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import CaseProgress, make_parser  # noqa: E402
from vllm_dist import (  # noqa: E402
    CommunicatorType,
    CoordinatorType,
    GlobalCoordinatorDistributedTask,
    LaunchError,
    MPLauncher,
)
from vllm_dist.serialization import register_by_value  # noqa: E402

MiB = 1 << 20


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _iters(nbytes: int) -> int:
    return max(3, min(50, (2 << 30) // max(nbytes, 1)))


def _timed(fn: Any, n: int, device: torch.device, barrier: Any = None) -> float:
    """Seconds per call (median of ``n`` after one warm-up)."""
    fn()
    _sync(device)
    times = []
    for _ in range(n):
        if barrier is not None:
            barrier()
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def _size(nbytes: int) -> str:
    return f"{nbytes / MiB:g} MiB"


def _report(progress: CaseProgress | None, case: str, nbytes: int, secs: float) -> None:
    """One finished case on stderr (rank 0 only), outside the timed calls."""
    if progress is not None:
        progress.done(case, f"{secs * 1e6:.1f} us, {nbytes / secs / 1e9:.2f} GB/s")


def copy_baseline(sizes: list[int], device: torch.device) -> dict[int, float]:
    """Seconds for one in-process copy of each size (copy_ on CPU, device-to-device on CUDA)."""
    out = {}
    progress = CaseProgress(len(sizes))
    for n in sizes:
        progress.start(f"in-process copy {_size(n)}")
        src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
        dst = torch.empty_like(src)
        dst.copy_(src)  # fault the pages in before timing
        out[n] = _timed(lambda s=src, d=dst: d.copy_(s), _iters(n), device)
        del src, dst
        _report(progress, f"in-process copy {_size(n)}", n, out[n])
    return out


class NixlP2PTask(GlobalCoordinatorDistributedTask):
    """Rank 0 drives READ / WRITE into rank 1's exposed buffer, then send/recv."""

    def post_init_distributed(self, sizes: list[int], **kwargs: Any) -> Any:
        comm: Any = self.communicator
        rank = self.coordinator.get_rank()
        top = max(sizes)
        remote = torch.zeros(top, dtype=torch.uint8, device=self.device)
        local = torch.ones(top, dtype=torch.uint8, device=self.device)
        comm.expose(remote, "buf", writable=True)  # the peers WRITE into it
        comm.expose(local, "local")
        comm.exchange_exposed()
        rows: list[dict[str, Any]] = []
        progress = CaseProgress(3 * len(sizes)) if rank == 0 else None
        self.coordinator.barrier()
        for n in sizes:
            if rank == 0:
                view = local[:n]
                for op, fn in (
                    ("read", lambda v=view: comm.read(1, "buf", v)),
                    ("write", lambda v=view: comm.write(1, "buf", v)),
                ):
                    if progress is not None:
                        progress.start(f"nixl_rdt {op} {_size(n)}")
                    secs = _timed(fn, _iters(n), self.device)
                    rows.append({"op": op, "backend": "nixl_rdt", "bytes": n, "seconds": secs})
                    _report(progress, f"nixl_rdt {op} {_size(n)}", n, secs)
            self.coordinator.barrier()
            if progress is not None:
                progress.start(f"nixl_rdt send_recv {_size(n)}")
            secs = self._send_recv(rank, local[:n], remote[:n], n)
            if rank == 0:
                rows.append({"op": "send_recv", "backend": "nixl_rdt", "bytes": n, "seconds": secs})
                _report(progress, f"nixl_rdt send_recv {_size(n)}", n, secs)
        self.coordinator.barrier()
        return {"rows": rows, "describe": comm.describe()}

    def _send_recv(self, rank: int, src: torch.Tensor, dst: torch.Tensor, n: int) -> float:
        iters = _iters(n)
        comm = self.communicator
        if rank == 0:
            return _timed(lambda: comm.send(src, dst=1), iters, self.device)
        for _ in range(iters + 1):
            comm.recv(dst, src=0)
        return 0.0


class TorchP2PTask(GlobalCoordinatorDistributedTask):
    """torch.distributed send/recv of the same sizes (rank 0 sends, timed on rank 0)."""

    def post_init_distributed(self, sizes: list[int], **kwargs: Any) -> Any:
        rank = self.coordinator.get_rank()
        buf = torch.ones(max(sizes), dtype=torch.uint8, device=self.device)
        rows = []
        progress = CaseProgress(len(sizes)) if rank == 0 else None
        for n in sizes:
            iters = _iters(n)
            self.coordinator.barrier()
            if rank == 0:
                if progress is not None:
                    progress.start(f"torch_distributed send_recv {_size(n)}")
                secs = _timed(
                    lambda b=buf[:n]: self.communicator.send(b, dst=1), iters, self.device
                )
                rows.append(
                    {"op": "send_recv", "backend": "torch_distributed", "bytes": n, "seconds": secs}
                )
                _report(progress, f"torch_distributed send_recv {_size(n)}", n, secs)
            else:
                for _ in range(iters + 1):
                    self.communicator.recv(buf[:n], src=0)
                _sync(self.device)
        return {"rows": rows, "describe": self.communicator.describe()}


def _launch(
    task: type,
    comm: CommunicatorType,
    device: str,
    sizes: list[int],
    nixl_options: dict[str, Any] | None = None,
) -> Any:
    return MPLauncher(2, timeout=1800).launch(
        task_type=task,
        coordinator_type=CoordinatorType.TORCH_DISTRIBUTED,
        communicator_type=comm,
        device=device,
        communicator_options=nixl_options if comm is CommunicatorType.NIXL_RDT else None,
        sizes=sizes,
    )[0]


def main(argv: list[str] | None = None) -> int:
    parser = make_parser(__doc__, whole=True)
    parser.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda"], help="cuda: both ranks on cuda:0"
    )
    parser.add_argument("--quick", action="store_true", help="sizes up to 64 MiB only")
    parser.add_argument("--min-mib", type=float, default=1, help="smallest transfer, MiB")
    parser.add_argument(
        "--max-mib",
        type=float,
        default=None,
        help="largest transfer, MiB (sizes double); default: 1024, 64 with --quick",
    )
    parser.add_argument("--out", default="bench_results/p2p.json", help="JSON path; PNG beside")

    args = parser.parse_args(argv)
    top = args.max_mib or (64 if args.quick else 1024)
    sizes, n = [], int(args.min_mib * MiB)
    while n <= top * MiB:
        sizes.append(n)
        n *= 4
    device = "cuda:0" if args.device.startswith("cuda") else "cpu"
    register_by_value(sys.modules[__name__])

    nixl_options = {"timeout": 120.0}
    # the baseline runs here, in a process with no agent, before any worker starts
    baseline = copy_baseline(sizes, torch.device(device))
    nixl = _launch(NixlP2PTask, CommunicatorType.NIXL_RDT, device, sizes, nixl_options)
    rows = list(nixl["rows"])
    try:
        torch_res = _launch(TorchP2PTask, CommunicatorType.TORCH_DISTRIBUTED, device, sizes)
        rows += torch_res["rows"]
        torch_facts = torch_res["describe"]
    except LaunchError as exc:  # NCCL refuses two ranks on one GPU
        torch_facts = {"error": str(exc).splitlines()[0]}
    for row in rows:
        row["GBps"] = row["bytes"] / row["seconds"] / 1e9
        row["vs_copy"] = baseline[row["bytes"]] / row["seconds"]
    base_rows = [
        {
            "op": "copy",
            "backend": "in-process",
            "bytes": n,
            "seconds": s,
            "GBps": n / s / 1e9,
            "vs_copy": 1.0,
        }
        for n, s in baseline.items()
    ]
    _print_table(base_rows + rows)
    result = {
        "device": device,
        "sizes": sizes,
        "rows": base_rows + rows,
        "nixl_rdt": nixl["describe"],
        "nixl_options": nixl_options,
        "torch_distributed": torch_facts,
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"transport: {json.dumps(nixl['describe'])}")
    print(f"wrote {args.out}")
    _plot(base_rows + rows, os.path.splitext(args.out)[0] + ".png", device)
    return 0


def _print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'size':>10} {'op':>10} {'backend':>18} {'time_us':>12} {'GB/s':>8} {'vs copy':>8}")
    for r in sorted(
        rows, key=lambda r: (r["bytes"], r["backend"] != "in-process", r["op"], r["backend"])
    ):
        size = _size(r["bytes"])
        print(
            f"{size:>10} {r['op']:>10} {r['backend']:>18} {r['seconds'] * 1e6:>12.1f} "
            f"{r['GBps']:>8.2f} {r['vs_copy']:>7.0%}"
        )


def _plot(rows: list[dict[str, Any]], path: str, device: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'vllm_dist[bench]')")
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    series: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        series.setdefault(f"{r['backend']} {r['op']}", []).append((r["bytes"], r["GBps"]))
    # lines that coincide (READ and WRITE through one path) stay visible: each series has its
    # own marker and dash pattern, hollow markers over filled ones
    markers = ("o", "s", "^", "D", "v", "P", "X", "*")
    dashes = ("-", "--", "-.", ":")
    for i, (label, pts) in enumerate(sorted(series.items())):
        pts.sort()
        baseline = label.startswith("in-process")
        ax.plot(
            [p[0] / MiB for p in pts],
            [p[1] for p in pts],
            marker=markers[i % len(markers)],
            linestyle="-" if baseline else dashes[i % len(dashes)],
            fillstyle="full" if baseline else ("none" if i % 2 else "full"),
            color="black" if baseline else None,
            linewidth=2.5 if baseline else 1.5,
            markersize=8 if i % 2 else 6,
            alpha=0.9,
            label=f"{label} (baseline)" if baseline else label,
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("transfer size (MiB)")
    ax.set_ylabel("GB/s")
    ax.set_title(f"two processes, {device}: point-to-point vs in-process copy")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
