"""Does all-reduce through a DeviceCommunicator cost more than raw torch.distributed?

For each message size (1 KiB .. 256 MiB by default) one launch times ``communicator.all_reduce``
and raw ``torch.distributed.all_reduce`` on the same process group (``TORCH_DISTRIBUTED``) or on a
torch NCCL group over the same ranks (other backends, e.g. ``PYNCCL``), interleaved round by round
so drift hits both alike, and reports nccl-tests columns (time, algbw, busbw) side by side. On CUDA,
small messages are also timed as CUDA-graph replays. Each call is timed on its own, ours and raw
alternating, so the per-call delta is a median of paired differences (robust to drift).
Targets: at 64 MiB ours <= 1.05x raw; at 1 KiB at most 20 us more per call; PyNCCL >= 0.98x
torch NCCL busbw at >= 64 MiB. The plot's log axes show both ends: time per call (the fixed
overhead of small messages) and bus bandwidth (large ones).

    python benchmarks/all_reduce.py --world-size 2 [--device cuda] [--backends torch_distributed,pynccl]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import (  # noqa: E402
    CaseProgress,
    human,
    make_parser,
    median,
    print_table,
    size_sweep,
    time_calls,
    write_outputs,
)

from vllm_dist import (  # noqa: E402
    CommOp,
    GlobalCoordinatorDistributedTask,
    get_launcher_class,
)
from vllm_dist.cli import parse_size  # noqa: E402
from vllm_dist.serialization import register_by_value  # noqa: E402

register_by_value(__name__)  # benchmark module is not importable from a worker's cwd


class AllReduceSweep(GlobalCoordinatorDistributedTask):
    def post_init_distributed(
        self, sizes: list[int], rounds: int, graph_max: int, backend: str = "", **_: Any
    ) -> list[dict[str, Any]]:
        raw_group = self._raw_group()
        world = self.coordinator.get_world_size()
        # rank 0 reports each size as it finishes (stderr), outside the timed calls
        progress = CaseProgress(len(sizes)) if self.coordinator.get_rank() == 0 else None
        rows = []
        for size in sizes:
            case = f"all_reduce {backend} {human(max(1, size // 4) * 4)} float32"
            if progress is not None:
                progress.start(case)
            x = torch.ones(max(1, size // 4), dtype=torch.float32, device=self.device)
            iters = 100 if size <= 64 << 10 else 10 if size <= 4 << 20 else 3
            ours_fn = functools.partial(self.communicator.all_reduce, tensor_in=x)
            raw_fn = functools.partial(dist.all_reduce, x, group=raw_group)
            ours_fn(), raw_fn()  # warm up both paths
            ours, raw = [], []
            for i in range(rounds * iters):  # paired calls, order alternating: drift hits both
                first, second = (ours, raw) if i % 2 == 0 else (raw, ours)
                fns = (ours_fn, raw_fn) if i % 2 == 0 else (raw_fn, ours_fn)
                first.append(time_calls(fns[0], self._sync, 1))
                second.append(time_calls(fns[1], self._sync, 1))
            row = {
                "bytes": x.numel() * 4,
                "ours_s": median(ours),
                "raw_s": median(raw),
                "paired_delta_s": median([a - b for a, b in zip(ours, raw, strict=True)]),
                "samples": len(ours),
            }
            if self.device.type == "cuda" and size <= graph_max:
                capturable = CommOp.CUDA_GRAPH in self.communicator.supported_ops
                row["ours_graph_s"] = self._graph_time(ours_fn) if capturable else None
                row["raw_graph_s"] = self._graph_time(raw_fn)
            rows.append(row)
            if progress is not None:
                progress.done(
                    case,
                    f"ours {row['ours_s'] * 1e6:.1f} us, raw {row['raw_s'] * 1e6:.1f} us, "
                    f"paired delta {row['paired_delta_s'] * 1e6:+.1f} us",
                )
            x.fill_(1.0)
            self.communicator.all_reduce(tensor_in=x)
            assert x[0].item() == world, "all-reduce gave a wrong result"
        return rows

    def _raw_group(self) -> Any:
        group = getattr(self.communicator, "process_group", None)
        if group is not None:
            return group
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        return dist.new_group(self.coordinator.get_global_ranks(), backend=backend)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _graph_time(self, fn: Any, calls: int = 20) -> float | None:
        """Seconds per call when ``calls`` calls are captured in one CUDA graph and replayed."""
        stream = torch.cuda.Stream(device=self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                for _ in range(calls):
                    fn()
        except Exception as exc:  # noqa: BLE001 - a backend that cannot be captured is reported
            print(f"graph capture failed: {exc}", flush=True)
            return None
        graph.replay()
        times = [time_calls(graph.replay, self._sync, 10) / calls for _ in range(5)]
        return median(times)


def run(args: argparse.Namespace) -> dict[str, Any]:
    sizes = size_sweep(args.min_bytes, args.max_bytes)
    results: dict[str, Any] = {"world_size": args.world_size, "device": args.device, "backends": {}}
    launcher_cls = get_launcher_class(args.launcher)
    for backend in args.backends.split(","):
        launcher = launcher_cls(args.world_size, timeout=args.timeout)  # type: ignore[call-arg]
        ranks = launcher.launch(
            task_type=AllReduceSweep,
            coordinator_type="torch_distributed",
            communicator_type=backend,
            device=args.device,
            sizes=sizes,
            rounds=args.rounds,
            graph_max=64 << 10,
            backend=backend,
        )
        results["backends"][backend] = ranks[0]
        _print(backend, ranks[0], args.world_size)
    results["targets"] = _targets(results)
    return results


def _print(backend: str, rows: list[dict[str, Any]], world: int) -> None:
    factor = 2 * (world - 1) / world if world > 1 else 1.0
    table = []
    for r in rows:
        algbw_ours = r["bytes"] / r["ours_s"] / 1e9
        algbw_raw = r["bytes"] / r["raw_s"] / 1e9
        line = [
            human(r["bytes"]),
            r["ours_s"] * 1e6,
            algbw_ours,
            algbw_ours * factor,
            r["raw_s"] * 1e6,
            algbw_raw,
            algbw_raw * factor,
            r["ours_s"] / r["raw_s"],
            r["paired_delta_s"] * 1e6,
        ]
        if "ours_graph_s" in r:
            line += [_us(r.get("ours_graph_s")), _us(r.get("raw_graph_s"))]
        table.append(line)
    cols = [
        "size",
        "ours us",
        "algbw",
        "busbw",
        "raw us",
        "algbw",
        "busbw",
        "ours/raw",
        "paired delta us",
    ]
    if any("ours_graph_s" in r for r in rows):
        cols += ["graph ours us", "graph raw us"]
        table = [t + ["", ""] if len(t) < len(cols) else t for t in table]
    print_table(f"\nall_reduce float32 sum, {backend}, world {world} (GB/s)", cols, table)


def _us(v: float | None) -> Any:
    return "-" if v is None else v * 1e6


def _targets(results: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for backend, rows in results["backends"].items():
        by_size = {r["bytes"]: r for r in rows}
        if 64 << 20 in by_size:
            r = by_size[64 << 20]
            out[f"{backend}_64MiB_ours_over_raw"] = r["ours_s"] / r["raw_s"]
        if 1 << 10 in by_size:
            r = by_size[1 << 10]
            out[f"{backend}_1KiB_extra_us"] = r["paired_delta_s"] * 1e6
    print("\ntargets:", {k: round(v, 4) for k, v in out.items()})
    return out


def plot(results: dict[str, Any], png: str) -> None:
    """Time per call and bus bandwidth against size, all axes log: the left panel shows the
    small-size overhead (a flat floor), the right one how close large messages get to raw."""
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_bw) = plt.subplots(1, 2, figsize=(12, 4.8))
    world = results["world_size"]
    factor = 2 * (world - 1) / world if world > 1 else 1.0
    markers = iter(("o", "s", "^", "D", "v", "P"))
    for backend, rows in results["backends"].items():
        sizes = [r["bytes"] for r in rows]
        marker = next(markers, "o")
        for key, style, label in (
            ("ours_s", "-", f"{backend} (ours)"),
            ("raw_s", "--", f"{backend}: raw torch.distributed"),
        ):
            fill = "full" if key == "ours_s" else "none"
            kw = {"marker": marker, "linestyle": style, "fillstyle": fill, "label": label}
            ax_t.plot(sizes, [r[key] * 1e6 for r in rows], **kw)
            ax_bw.plot(sizes, [r["bytes"] / r[key] / 1e9 * factor for r in rows], **kw)
    for ax in (ax_t, ax_bw):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("message size (bytes)")
        ax.grid(True, which="both", alpha=0.3)
    ax_t.set_ylabel("time per call (us)")
    ax_t.set_title("time per call: small sizes show the fixed overhead")
    ax_bw.set_ylabel("bus bandwidth (GB/s)")
    ax_bw.set_title("bus bandwidth")
    ax_bw.legend(fontsize=8)
    fig.subplots_adjust(wspace=0.3)  # room for the right panel's axis label
    fig.subplots_adjust(wspace=0.3)  # room for the right panel's axis label
    fig.suptitle(f"all_reduce float32 sum, world {world}, {results['device']}")
    fig.savefig(png, dpi=120, bbox_inches="tight")


def main() -> None:
    p = make_parser(__doc__, whole=True)
    p.add_argument("--world-size", type=int, default=2, help="ranks (processes or Ray actors)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where tensors live")
    p.add_argument(
        "--backends", default="torch_distributed", help="communicators to time, comma-separated"
    )
    p.add_argument("--launcher", default="mp", help="launcher name: mp or ray")
    p.add_argument(
        "--min-bytes", type=parse_size, default="1KiB", help="smallest message (64KiB, 1MiB, ...)"
    )
    p.add_argument(
        "--max-bytes", type=parse_size, default="256MiB", help="largest message; sizes double"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=7,
        help="rounds per size: x100 paired calls up to 64 KiB, x10 up to 4 MiB, else x3",
    )
    p.add_argument("--timeout", type=float, default=1800, help="seconds before the launch stops")
    p.add_argument("--out", default="bench_results/all_reduce.json", help="JSON path; PNG beside")
    args = p.parse_args()
    results = run(args)
    write_outputs(args.out, results, lambda png: plot(results, png))


if __name__ == "__main__":
    main()
