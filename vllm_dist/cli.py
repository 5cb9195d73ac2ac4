"""The ``vllm-dist`` command: run a distributed job, or report what this machine can run.

``vllm-dist run all-reduce --world-size 2``   a verified multi-process all-reduce (CPU default)
``vllm-dist run weight-transfer --producers 2 --consumers 2``   a verified weight sync demo
``vllm-dist info``   versions, devices, and every registered backend with whether it is usable
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from vllm_dist import registry
from vllm_dist.interfaces import LaunchError

_UNITS = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "KIB": 1 << 10,
    "M": 1 << 20,
    "MIB": 1 << 20,
    "G": 1 << 30,
    "GIB": 1 << 30,
}


def parse_size(text: str) -> int:
    """``"64MiB"`` -> 67108864; accepts B, K/KiB, M/MiB, G/GiB (powers of two)."""
    raw = text.strip().upper()
    digits = raw.rstrip("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unit = raw[len(digits) :]
    if not digits or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 4096, 64KiB, 64MiB or 1GiB")
    value = int(float(digits) * _UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def _launcher(args: argparse.Namespace, n_tasks: int) -> Any:
    # resolve every name here, so that a typo fails before any worker starts
    args.coordinator = registry.coordinators.resolve_name(args.coordinator)
    args.communicator = registry.communicators.resolve_name(args.communicator)
    cls = registry.get_launcher_class(args.launcher)
    return cls(n_tasks, timeout=args.timeout)  # type: ignore[call-arg]


def _add_backend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--launcher", default="mp", help="launcher name (default: mp)")
    p.add_argument("--coordinator", default="torch_distributed", help="coordinator name")
    p.add_argument("--communicator", default="torch_distributed", help="communicator name")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="default: cpu")
    p.add_argument(
        "--timeout", type=float, default=300.0, help="seconds before the launch is stopped"
    )
    p.add_argument("--json", action="store_true", help="print the per-rank results as JSON")


def cmd_all_reduce(args: argparse.Namespace) -> int:
    from vllm_dist.tasks.all_reduce import AllReduceBenchTask

    start = time.perf_counter()
    results = _launcher(args, args.world_size).launch(
        task_type=AllReduceBenchTask,
        coordinator_type=args.coordinator,
        communicator_type=args.communicator,
        device=args.device,
        size_bytes=args.size,
        iters=args.iters,
        dtype=args.dtype,
    )
    elapsed = time.perf_counter() - start
    if args.json:
        print(json.dumps(results, indent=2, default=str))
    print(_all_reduce_summary(results, args, elapsed))
    return 0 if all(r["verified"] for r in results) else 1


def _all_reduce_summary(
    results: list[dict[str, Any]], args: argparse.Namespace, elapsed: float
) -> str:
    world = len(results)
    nbytes = results[0]["bytes"]
    median = max(r["median_s"] for r in results)
    algbw = nbytes / median / 1e9 if median else 0.0
    busbw = algbw * 2 * (world - 1) / world
    lines = [
        f"all-reduce  world={world}  launcher={args.launcher}  coordinator={args.coordinator}  "
        f"communicator={args.communicator}  device={results[0]['device']}",
        f"{'rank':>4}  {'device':<8} {'verified':<8} {'time/call':>10}",
    ]
    for r in results:
        lines.append(
            f"{r['rank']:>4}  {r['device']:<8} {str(r['verified']):<8} {r['median_s'] * 1e3:>8.3f}ms"
        )
    ok = all(r["verified"] for r in results)
    lines.append(
        f"{nbytes / 2**20:.2f} MiB {args.dtype}: every rank holds {results[0]['expected']:g} "
        f"({'verified' if ok else 'WRONG RESULT'}); algbw {algbw:.3f} GB/s, busbw {busbw:.3f} GB/s; "
        f"launch took {elapsed:.2f} s"
    )
    return "\n".join(lines)


def cmd_weight_transfer(args: argparse.Namespace) -> int:
    """A tiny Llama on the producers, TP consumers on the CPU over torch.distributed."""
    from vllm_dist.examples.weight_sync_demo import run_demo

    summary = run_demo(
        producers=args.producers,
        consumers=args.consumers,
        syncs=args.syncs,
        tp_size=args.tp_size,
        timeout=args.timeout,
        communicator=args.communicator,
    )
    if args.json:
        print(json.dumps(summary, indent=2, default=str))
    else:
        print(f"weight transfer (tiny Llama, tensor-parallel consumers, CPU, {args.communicator})")
        for key, value in summary.items():
            print(f"  {key:<18} {_fmt(value)}")
    return 0 if summary.get("verified") else 1


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(_fmt(v) for v in value)
    return str(value)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cmd_info(args: argparse.Namespace) -> int:
    import torch

    print("versions")
    print(f"  python       {sys.version.split()[0]}")
    print(f"  vllm_dist    {_version('vllm_dist')}")
    print(f"  torch        {torch.__version__}")
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-"
    print(f"  torch NCCL   {nccl}")
    print(f"  libnccl      {_libnccl_version()}")
    print(f"  ray          {_version('ray')}")
    print(f"  nixl         {_version('nixl')}")
    print(f"  cloudpickle  {_version('cloudpickle')}")
    print("devices")
    print("  cpu")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            print(f"  cuda:{i}       {torch.cuda.get_device_name(i)}")
    else:
        print("  (no CUDA device)")
    print("backends")
    for axis, reg in (
        ("launcher", registry.launchers),
        ("coordinator", registry.coordinators),
        ("communicator", registry.communicators),
    ):
        for name in reg.names():
            print(f"  {axis:<12} {name:<18} {_usability(axis, reg, name)}")
    return 0


def _libnccl_version() -> str:
    try:
        from vllm_dist.implementations.communicators.pynccl.library import load_nccl

        lib = load_nccl()
        return f"{lib.version_string} ({lib.path})"
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return f"not found ({str(exc).splitlines()[0][:80]})"


def _usability(axis: str, reg: Any, name: str) -> str:
    try:
        cls = reg.get(name)
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        return f"unusable: {exc}"
    if axis != "communicator":
        return "usable"
    parts = []
    for device in ("cpu", "cuda"):
        reason = cls.unavailable_reason(device)
        parts.append(f"{device}: {'usable' if reason is None else 'no (' + reason + ')'}")
    return "; ".join(parts)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-dist", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a distributed job")
    jobs = run.add_subparsers(dest="job", required=True)

    ar = jobs.add_parser("all-reduce", help="a verified, timed all-reduce")
    ar.add_argument("--world-size", type=int, default=2)
    ar.add_argument("--size", type=parse_size, default=parse_size("64MiB"), help="bytes per rank")
    ar.add_argument("--iters", type=int, default=10)
    ar.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    _add_backend_args(ar)
    ar.set_defaults(func=cmd_all_reduce)

    wt = jobs.add_parser("weight-transfer", help="a verified trainer-to-inference weight sync")
    wt.add_argument("--producers", type=int, default=2)
    wt.add_argument("--consumers", type=int, default=2)
    wt.add_argument("--syncs", type=int, default=3, help="weight updates to push and verify")
    wt.add_argument("--tp-size", type=int, default=2, help="tensor-parallel size of each replica")
    wt.add_argument("--timeout", type=float, default=300.0)
    wt.add_argument(
        "--communicator",
        default="torch_distributed",
        choices=["torch_distributed", "nixl_rdt"],
        help="send/recv over torch.distributed, or one-sided READs over NIXL (replayed syncs)",
    )
    wt.add_argument("--json", action="store_true")
    wt.set_defaults(func=cmd_weight_transfer)

    info = sub.add_parser("info", help="versions, devices and backends")
    info.set_defaults(func=cmd_info)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "world_size", 1) < 1:
        print("vllm-dist: --world-size must be at least 1", file=sys.stderr)
        return 2
    try:
        return int(args.func(args))
    except LaunchError as exc:
        print(f"vllm-dist: {exc}", file=sys.stderr)
        return 1
    except (ValueError, TypeError, ImportError) as exc:
        print(f"vllm-dist: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
