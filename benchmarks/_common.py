"""Shared by the benchmark scripts: sizes, timing statistics, table printing, JSON and PNG output."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written (its line breaks kept), each option's default after its help
    (none for a flag or an unset option)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False):
            return action.help
        return super()._get_help_string(action)


def make_parser(doc: str, *, whole: bool = False) -> argparse.ArgumentParser:
    """An argument parser described by the module docstring ``doc`` (its first line, or all of
    it with ``whole``), without RST markup, showing every option's default in ``--help``."""
    text = doc if whole else doc.strip().splitlines()[0]
    return argparse.ArgumentParser(
        description=text.replace("``", "").strip(), formatter_class=_HelpFormatter
    )


def size_sweep(lo: int, hi: int) -> list[int]:
    """Powers of two from ``lo`` to ``hi`` bytes."""
    sizes, s = [], lo
    while s <= hi:
        sizes.append(s)
        s *= 2
    return sizes


def human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f}{unit}" if unit == "B" else f"{nbytes:.4g}{unit}"
        nbytes /= 1024
    return str(nbytes)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def time_calls(fn: Callable[[], Any], sync: Callable[[], None], iters: int) -> float:
    """Seconds per call of ``fn``, over ``iters`` back-to-back calls between two syncs."""
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - start) / iters


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    widths = [max(len(str(c)), *(len(_cell(r[i])) for r in rows)) for i, c in enumerate(columns)]
    lines = [title, "  ".join(str(c).rjust(w) for c, w in zip(columns, widths, strict=False))]
    for r in rows:
        lines.append("  ".join(_cell(v).rjust(w) for v, w in zip(r, widths, strict=False)))
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"
    return str(v)


class CaseProgress:
    """One stderr line per finished case (``[3/8] case: summary``), so a long sweep shows where
    it is; where stderr is a terminal, the case running now is shown on a line that the next
    finished case overwrites. Stdout keeps only the tables."""

    def __init__(self, total: int, stream: Any = None) -> None:
        self.total, self.done_count = total, 0
        self.stream = sys.stderr if stream is None else stream
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._started = time.perf_counter()

    def start(self, case: str) -> None:
        """Case ``case`` begins (shown only on a terminal)."""
        self._started = time.perf_counter()
        if self.tty:
            self.stream.write(f"\r\033[K[{self.done_count + 1}/{self.total}] running {case} ...")
            self.stream.flush()

    def done(self, case: str, summary: str) -> None:
        """Case ``case`` finished: one line with its result and how long it took."""
        self.done_count += 1
        took = time.perf_counter() - self._started
        clear = "\r\033[K" if self.tty else ""
        self.stream.write(
            f"{clear}[{self.done_count}/{self.total}] {case}: {summary} ({took:.1f} s)\n"
        )
        self.stream.flush()


def machine_facts() -> dict[str, Any]:
    facts: dict[str, Any] = {"host_cpus": os.cpu_count(), "python": platform.python_version()}
    try:
        import torch

        facts["torch"] = torch.__version__
        if torch.cuda.is_available():
            facts["gpu"] = torch.cuda.get_device_name(0)
            facts["gpus"] = torch.cuda.device_count()
    except ImportError:
        pass
    return facts


def write_outputs(path: str, payload: dict[str, Any], plot: Callable[[str], None] | None) -> None:
    """Write ``payload`` as JSON to ``path`` and, when matplotlib is there, ``plot`` to a PNG."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    payload = {"machine": machine_facts(), **payload}
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)
    print(f"wrote {path}")
    if plot is None:
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
    except ImportError:
        print("matplotlib not installed: no plot (pip install 'vllm_dist[bench]')")
        return
    png = os.path.splitext(path)[0] + ".png"
    plot(png)
    print(f"wrote {png}")
