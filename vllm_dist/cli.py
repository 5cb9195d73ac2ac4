"""The ``vllm-dist`` command: run a distributed job, or report what this machine can run.

Every flag is checked in the parent before a worker starts (exit code 2, one line naming the flag
and the fix). Rejected alternative: letting the task raise in every worker, which costs a launch
and prints a traceback per rank for a typo.
``info`` prints what ``vllm_dist.info`` probes.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

from vllm_dist import __version__, registry
from vllm_dist.info import collect_info, communicator_unavailable, cuda_unavailable, render_info
from vllm_dist.interfaces import CommOp, LaunchError

MAX_SIZE = 1 << 40  # 1 TiB: far above any one device's memory, far below an overflow
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE_RE = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?", re.IGNORECASE)

# what each job needs of a communicator: any one of these sets of operations
_JOB_OPS: dict[str, tuple[frozenset[CommOp], ...]] = {
    "all-reduce": (frozenset({CommOp.ALL_REDUCE}),),
    "weight-transfer": (frozenset({CommOp.READ}), frozenset({CommOp.SEND, CommOp.RECV})),
}


class UsageError(Exception):
    """A flag the parent refuses before any worker starts; the message names flag and fix."""


def parse_size(text: str) -> int:
    """``"64MiB"`` -> 67108864. Accepts B, K/KiB, M/MiB, G/GiB, T/TiB (powers of two); a plain
    decimal number, no exponent; between 1 byte and 1 TiB."""
    match = _SIZE_RE.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size like 4096, 64KiB, 64MiB or 1GiB (no exponents)"
        )
    value = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if not 1 <= value <= MAX_SIZE:
        raise argparse.ArgumentTypeError(f"{text!r} is outside 1B..1TiB")
    return value


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < 1e7:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _gpus(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GPUs") from None
    if not 0 <= value <= 1024:
        raise argparse.ArgumentTypeError(
            f"must be between 0 and 1024 (fractions allowed), got {text}"
        )
    return value


def _backend_name(axis: str) -> Callable[[str], str]:
    """A ``type=`` that resolves a registry name (case-insensitive) and suggests on a typo."""
    reg = getattr(registry, f"{axis}s")

    def parse(text: str) -> str:
        try:
            return str(reg.resolve_name(text))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc) + _did_you_mean(text, reg.names())) from None

    parse.__name__ = f"{axis} name"
    return parse


def _did_you_mean(word: str, candidates: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors and a suggestion for a mistyped option or command; an
    unknown option is reported by the command it was given to, not by ``vllm-dist``."""

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            leaf = _chosen_command(self, parsed)
            hint = _option_elsewhere(self, leaf, extras[0]) if extras[0].startswith("-") else ""
            leaf.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
        return parsed

    def error(self, message: str) -> NoReturn:
        message += self._suggestion(message)
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def _suggestion(self, message: str) -> str:
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:
            options = re.findall(r"'?([\w.-]+)'?", choice.group(2))
            return _did_you_mean(choice.group(1), options)
        unknown = re.search(r"unrecognized arguments: (\S+)", message)
        if unknown and unknown.group(1).startswith("-") and " (" not in message:
            return _did_you_mean(unknown.group(1).split("=")[0], sorted(_all_options(self)))
        return ""


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """``{dest value: parser}`` of ``parser``'s sub-commands (empty for a leaf)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _chosen_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Any:
    """The parser of the sub-command ``args`` chose (``vllm-dist run all-reduce``'s)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            sub = action.choices.get(getattr(args, action.dest, None) or "")
            return parser if sub is None else _chosen_command(sub, args)
    return parser


def _option_elsewhere(root: argparse.ArgumentParser, leaf: Any, word: str) -> str:
    """A hint for an option ``leaf`` did not take: it belongs after the command, or to another
    command (`` (--device is an option of 'vllm-dist run all-reduce')``), or is a typo of one."""
    option = word.split("=")[0]
    if option in _all_options(leaf):  # given before the command's name
        return f" (options go after the command: {leaf.prog} {option} ...)"
    leaves = []
    stack = [root]
    while stack:
        parser = stack.pop()
        subs = _subcommands(parser)
        stack.extend(subs.values())
        if not subs and parser is not leaf:
            leaves.append(parser)
    owners = sorted(f"'{p.prog}'" for p in leaves if option in _all_options(p))
    if owners:
        return f" ({option} is an option of {' and '.join(owners)})"
    if _did_you_mean(option, sorted(_all_options(leaf))):
        return ""  # the leaf's own suggestion follows
    for parser in sorted(leaves, key=lambda p: p.prog):
        close = difflib.get_close_matches(option, sorted(_all_options(parser)), n=1, cutoff=0.75)
        if close:
            return f" (did you mean {close[0]!r}, an option of '{parser.prog}'?)"
    return ""


def _all_options(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of ``parser`` and of its sub-commands, recursively."""
    found: set[str] = set()
    for action in parser._actions:
        found.update(s for s in action.option_strings if s.startswith("--"))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _all_options(sub)
    return found


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults shown in help; descriptions kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "%(default)" in text:
            return text
        return super()._get_help_string(action)


# --------------------------------------------------------------------------- checks


def check_args(args: argparse.Namespace) -> None:
    """Refuse flags that cannot work here, before any worker starts; raises ``UsageError``.

    Device checks run only for the local launcher: under Ray the workers' nodes have the GPUs.
    """
    device = getattr(args, "device", "cpu")
    launcher = getattr(args, "launcher", "mp")
    local = launcher == "mp"
    address = getattr(args, "address", None)
    if address is not None and launcher != "ray":
        raise UsageError("--address joins a Ray cluster: add --launcher ray, or drop --address")
    if address is not None and not address.strip():
        raise UsageError(
            "--address is empty: give 'auto', 'host:port' or 'ray://host:port', or drop it "
            "for a private local Ray cluster"
        )
    _check_gpus_per_task(launcher, device, getattr(args, "gpus_per_task", None))
    if device == "cuda" and local:
        _check_local_cuda(args)
    _check_communicator(args.job, args.communicator, device if local else None)
    if args.job == "weight-transfer" and args.consumers % args.tp_size:
        raise UsageError(
            f"--consumers {args.consumers} must be a multiple of --tp-size {args.tp_size} "
            f"(each replica has --tp-size consumers): try --consumers {args.tp_size}"
        )


def _check_gpus_per_task(launcher: str, device: str, gpus: float | None) -> None:
    if gpus is None:
        return
    if launcher != "ray":
        raise UsageError(
            "--gpus-per-task reserves GPUs for Ray actors: add --launcher ray, or drop it "
            "(the mp launcher gives each worker cuda:<local rank>)"
        )
    if device == "cuda" and gpus == 0:
        raise UsageError(
            "--device cuda with --gpus-per-task 0 leaves the workers without a GPU: "
            "use --gpus-per-task 1, or --device cpu"
        )


def _check_communicator(job: str, name: str, device: str | None) -> None:
    """The backend loads, has the job's operations and (``device`` given) runs on it here."""
    try:
        cls = registry.get_communicator_class(name)
    except (ImportError, ValueError, TypeError) as exc:
        raise UsageError(f"--communicator {name}: {exc}") from None
    needed = _JOB_OPS.get(job, ())
    if needed and not _has_ops(cls, needed):
        wanted = " or ".join("+".join(sorted(o.value for o in want)) for want in needed)
        able = _communicators_for(needed, device)
        raise UsageError(
            f"--communicator {name} lacks {wanted}, which {job} needs: use --communicator "
            + " or ".join(able or ["<a backend that has it>"])
        )
    reason = None if device is None else communicator_unavailable(cls, device)
    if reason:
        others = [n for n in _communicators_for(needed, device) if n != name]
        fix = f"use --communicator {' or '.join(others)}" if others else "see vllm-dist info"
        reason = reason.split(". ")[0]  # the cause; the fix below is in CLI terms
        raise UsageError(f"--communicator {name} cannot run on --device {device}: {reason}; {fix}")


def _has_ops(cls: type, needed: tuple[frozenset[CommOp], ...]) -> bool:
    return any(want <= cls.supported_ops for want in needed)  # type: ignore[attr-defined]


def _communicators_for(needed: tuple[frozenset[CommOp], ...], device: str | None) -> list[str]:
    """Loadable communicators with the operations (and usable on ``device`` when given)."""
    names = []
    for name in registry.communicators.names():
        try:
            cls = registry.get_communicator_class(name)
        except (ImportError, ValueError, TypeError):
            continue
        if _has_ops(cls, needed) and (device is None or not communicator_unavailable(cls, device)):
            names.append(name)
    return names


def _check_local_cuda(args: argparse.Namespace) -> None:
    reason = cuda_unavailable()
    if reason:
        raise UsageError(f"--device cuda: {reason}; run with --device cpu")
    import torch

    world, gpus = getattr(args, "world_size", 1), torch.cuda.device_count()
    if args.communicator in ("pynccl", "torch_distributed") and world > gpus:
        raise UsageError(
            f"--world-size {world} needs a GPU per rank for NCCL, this machine has {gpus}: "
            f"use --world-size {gpus}, or --communicator nixl_rdt"
        )


def make_launcher(args: argparse.Namespace, n_tasks: int) -> Any:
    """The launcher the flags ask for, built in the parent (a missing Ray fails here)."""
    cls = registry.get_launcher_class(args.launcher)
    kwargs: dict[str, Any] = {"timeout": args.timeout}
    if args.launcher == "ray":
        gpus = args.gpus_per_task
        cuda = getattr(args, "device", "cpu") == "cuda"
        kwargs["address"] = args.address
        kwargs["num_gpus_per_task"] = (1 if cuda else 0) if gpus is None else gpus
    try:
        return cls(n_tasks, **kwargs)  # type: ignore[call-arg]
    except (ImportError, ValueError, TypeError) as exc:
        raise UsageError(f"--launcher {args.launcher}: {exc}") from None


# --------------------------------------------------------------------------- run


@contextlib.contextmanager
def _workers_output(as_json: bool) -> Iterator[None]:
    """With ``--json``, worker output (and NIXL's log lines) go to stderr: stdout is the JSON."""
    if not as_json:
        yield
        return
    with contextlib.redirect_stdout(sys.stderr):
        yield


def cmd_all_reduce(args: argparse.Namespace) -> int:
    from vllm_dist.tasks.all_reduce import AllReduceBenchTask

    launcher = make_launcher(args, args.world_size)
    start = time.perf_counter()
    with _workers_output(args.json):
        results = launcher.launch(
            task_type=AllReduceBenchTask,
            coordinator_type=args.coordinator,
            communicator_type=args.communicator,
            device=args.device,
            size_bytes=args.size,
            iters=args.iters,
            dtype=args.dtype,
        )
    elapsed = time.perf_counter() - start
    ok = all(r["verified"] for r in results)
    if args.json:
        summary = {"job": "all-reduce", "verified": ok, "launch_seconds": elapsed}
        print(json.dumps({**summary, "ranks": results}, indent=2, default=str))
    else:
        print(_all_reduce_summary(results, args, elapsed))
    return 0 if ok else 1


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
    """A small Llama-shaped model on the producers, TP consumers on the CPU."""
    from vllm_dist.examples.weight_sync_demo import run_demo

    options: dict[str, Any] = {}
    if args.launcher != "mp":
        options["launcher"] = make_launcher(args, args.producers + args.consumers)
    with _workers_output(args.json):
        summary = run_demo(
            producers=args.producers,
            consumers=args.consumers,
            syncs=args.syncs,
            tp_size=args.tp_size,
            timeout=args.timeout,
            communicator=args.communicator,
            **options,
        )
    if args.json:
        print(json.dumps(summarize_lists(summary, always=True), indent=2, default=str))
    else:
        print(f"weight transfer (small Llama, tensor-parallel consumers, CPU, {args.communicator})")
        for key, value in summarize_lists(summary, always=False).items():
            bytes_ = isinstance(value, int) and "bytes" in key and value >= 1024
            print(f"  {key:<18} {_fmt(value)}" + (f" ({value / 2**20:.3g} MiB)" if bytes_ else ""))
    return 0 if summary.get("verified") else 1


LONG_LIST = 8  # per-sync lists longer than this are printed as count / min / median / max


def summarize_lists(summary: dict[str, Any], *, always: bool) -> dict[str, Any]:
    """Per-sync lists as ``{count, first, min, median, max}`` (booleans: how many are true);
    ``always`` for a JSON schema that does not change with the number of syncs."""
    out: dict[str, Any] = {}
    for key, value in summary.items():
        if not isinstance(value, list) or not (always or len(value) > LONG_LIST):
            out[key] = value
        elif all(isinstance(v, bool) for v in value):
            out[key] = {"count": len(value), "true": sum(value)}
        elif value and all(isinstance(v, (int, float)) for v in value):
            out[key] = {
                "count": len(value),
                "first": value[0],
                "min": min(value),
                "median": statistics.median(value),
                "max": max(value),
            }
        else:
            out[key] = value
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(_fmt(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k} {_fmt(v)}" for k, v in value.items())
    return str(value)


# --------------------------------------------------------------------------- info


def cmd_info(args: argparse.Namespace) -> int:
    facts = collect_info(args.master_addr)
    print(json.dumps(facts, indent=2) if args.json else render_info(facts))
    return 0


# --------------------------------------------------------------------------- parser


def _add_backend_args(p: argparse.ArgumentParser, job: str) -> None:
    comms = registry.communicators.names()
    _add_launcher_args(p)
    p.add_argument(
        "--coordinator",
        type=_backend_name("coordinator"),
        default="torch_distributed",
        metavar="{" + ",".join(registry.coordinators.names()) + "}",
        help="the CPU control plane between workers",
    )
    p.add_argument(
        "--communicator",
        type=_backend_name("communicator"),
        default="torch_distributed",
        metavar="{" + ",".join(comms) + "}",
        help="the data plane that moves the tensors"
        + (" (torch_distributed: gloo on cpu, NCCL on cuda)" if job == "all-reduce" else ""),
    )
    p.add_argument(
        "--device",
        default="cpu",
        choices=["cpu", "cuda"],
        help="where the tensors live; cuda: each worker on cuda:<local rank>",
    )
    _add_common_args(p)


def _add_launcher_args(p: argparse.ArgumentParser, *, has_device: bool = True) -> None:
    p.add_argument(
        "--launcher",
        type=_backend_name("launcher"),
        default="mp",
        metavar="{" + ",".join(registry.launchers.names()) + "}",
        help="how workers start: mp (processes on this machine) or ray (Ray actors)",
    )
    p.add_argument(
        "--address",
        default=None,
        metavar="ADDR",
        help="existing Ray cluster to join with --launcher ray: 'auto' (the one RAY_ADDRESS or "
        "'ray start' names), 'host:port' or 'ray://host:port'; default: a private local cluster",
    )
    p.add_argument(
        "--gpus-per-task",
        type=_gpus,
        default=None,
        metavar="N",
        help="GPUs Ray reserves for each worker with --launcher ray (fractions allowed); "
        + ("default: 1 with --device cuda, else 0" if has_device else "default: 0"),
    )


def _add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--timeout",
        type=_seconds,
        default=300.0,
        metavar="SECONDS",
        help="seconds before the launch is stopped",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print only JSON on stdout (worker output and logs go to stderr)",
    )


class _RootFormatter(argparse.RawDescriptionHelpFormatter, _Formatter):
    """The top-level help: the examples keep their lines."""


_EXAMPLES = """examples:
  vllm-dist run all-reduce --world-size 2 --size 64MiB
  vllm-dist run weight-transfer --producers 2 --consumers 2 --syncs 3
  vllm-dist info --json
  vllm-dist run all-reduce --help      (every option, its unit and default)"""


def build_parser() -> argparse.ArgumentParser:
    """The ``vllm-dist`` argument parser."""
    parser = _Parser(
        prog="vllm-dist",
        description="Run a verified distributed job, or report what this machine can run.",
        epilog=_EXAMPLES,
        formatter_class=_RootFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{run,info}")
    run = sub.add_parser(
        "run", help="run a distributed job", description="Run a verified distributed job."
    )
    jobs = run.add_subparsers(dest="job", required=True, metavar="{all-reduce,weight-transfer}")
    _add_all_reduce(jobs)
    _add_weight_transfer(jobs)
    info = sub.add_parser(
        "info",
        help="versions, devices, environment and which backends work here",
        description="Versions, devices, NCCL_/UCX_/NIXL_ variables in force, and every "
        "registered backend with whether it works on this machine (and why not).",
        formatter_class=_Formatter,
    )
    info.add_argument("--json", action="store_true", help="print the report as JSON")
    info.add_argument(
        "--master-addr",
        default="127.0.0.1",
        type=str,
        help="the rendezvous address whose listeners to describe",
    )
    info.set_defaults(func=cmd_info, job=None)
    return parser


def _add_all_reduce(jobs: Any) -> None:
    ar = jobs.add_parser(
        "all-reduce",
        help="a verified, timed all-reduce",
        description="Every rank sums a tensor over the world, checks the result and times "
        "--iters calls (after 3 warm-up calls).",
        formatter_class=_Formatter,
    )
    ar.add_argument(
        "--world-size",
        type=_int_at_least(1),
        default=2,
        metavar="N",
        help="number of workers (ranks)",
    )
    ar.add_argument(
        "--size",
        type=parse_size,
        metavar="BYTES",
        default="64MiB",
        help="bytes per rank: 4096, 64KiB, 64MiB, 1GiB (powers of two)",
    )
    ar.add_argument("--iters", type=_int_at_least(1), default=10, metavar="N", help="timed calls")
    ar.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "float16", "bfloat16"],
        help="element type",
    )
    _add_backend_args(ar, "all-reduce")
    ar.set_defaults(func=cmd_all_reduce)


def _add_weight_transfer(jobs: Any) -> None:
    wt = jobs.add_parser(
        "weight-transfer",
        help="a verified trainer-to-inference weight sync",
        description="Producers (trainer ranks) hold a small Llama-shaped model; consumers "
        "(inference workers, --tp-size per replica) load their own shard of it with their own "
        "loaders. The weights change before every sync and every consumer checks every byte. "
        "Runs on the CPU, in processes on this machine or in Ray actors (--launcher ray).",
        formatter_class=_Formatter,
    )
    wt.add_argument(
        "--producers",
        type=_int_at_least(1),
        metavar="N",
        default=2,
        help="trainer ranks holding the weights",
    )
    wt.add_argument(
        "--consumers",
        type=_int_at_least(1),
        metavar="N",
        default=2,
        help="inference workers, a multiple of --tp-size",
    )
    wt.add_argument(
        "--syncs",
        type=_int_at_least(1),
        metavar="N",
        default=3,
        help="weight updates to push and verify",
    )
    wt.add_argument(
        "--tp-size",
        type=_int_at_least(1),
        metavar="N",
        default=2,
        help="tensor-parallel size of each inference replica",
    )
    wt.add_argument(
        "--communicator",
        type=_backend_name("communicator"),
        default="torch_distributed",
        metavar="{" + ",".join(registry.communicators.names()) + "}",
        help="torch_distributed: send/recv over gloo; nixl_rdt: one-sided READs of the "
        "trainer's memory (needs the nixl package), whole syncs replayed from the second on",
    )
    _add_launcher_args(wt, has_device=False)
    _add_common_args(wt)
    wt.set_defaults(func=cmd_weight_transfer)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``vllm-dist``; returns the exit code (2: bad flags, 130: interrupted)."""
    try:
        return _run(argv)
    except KeyboardInterrupt:
        print("vllm-dist: interrupted; workers stopped", file=sys.stderr)
        return 130


def _run(argv: Sequence[str] | None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a flag argparse refused
        return exc.code if isinstance(exc.code, int) else 2
    try:
        if args.command == "run":
            check_args(args)
            os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL's INFO lines, unless asked
        return int(args.func(args))
    except UsageError as exc:
        print(f"vllm-dist: {exc}", file=sys.stderr)
        return 2
    except LaunchError as exc:
        print(f"vllm-dist: {exc}", file=sys.stderr)
        return 1
    except (ValueError, TypeError, ImportError) as exc:
        print(f"vllm-dist: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
