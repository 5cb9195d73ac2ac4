"""How much does a vllm_dist launcher cost over doing the same launch by hand?

Question: the wall time of a 2-rank launch of a trivial task (every rank returns its rank).

* ``MPLauncher(n_tasks=2)`` against ``torchrun --nproc-per-node 2`` running the same trivial work
  (a tiny script written to a temp dir). Target: MPLauncher <= 1.3x torchrun.
* ``RayLauncher(2)`` on a running local cluster against raw Ray: a placement group of two
  bundles, two actors in it, one call each, actors killed and the group removed, all by hand.
  Target: RayLauncher <= 1.3x raw Ray. Raw Ray without a placement group is shown too.

Each variant runs once to warm up, then ``--repeats`` times, interleaved in rotating order; the table
shows the median and the min. Results go to ``--out`` (JSON) and, with matplotlib, a PNG next to it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # keep the local Ray on loopback

from vllm_dist import DistributedTask, MPLauncher  # noqa: E402

N_TASKS = 2
TARGET = 1.3
_TORCHRUN_SCRIPT = """
import os
rank = int(os.environ["RANK"])
assert 0 <= rank < int(os.environ["WORLD_SIZE"])
"""


class RankTask(DistributedTask):
    """The trivial work: return the rank."""

    def run(self) -> int:
        return self.worker_info.rank


class RawActor:
    """What a hand-written Ray launch starts: one actor per rank that returns its rank."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def run(self) -> int:
        return self.rank


def mp_launch() -> None:
    assert MPLauncher(N_TASKS, timeout=120).launch(task_type=RankTask) == [0, 1]


def torchrun_launch(script: Path) -> Callable[[], None]:
    cmd = [
        shutil.which("torchrun") or "torchrun",
        "--nproc-per-node",
        str(N_TASKS),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        "0",
        str(script),
    ]

    def launch() -> None:
        subprocess.run(cmd, check=True, timeout=120, capture_output=True)

    return launch


def ray_launch() -> None:
    from vllm_dist import RayLauncher

    assert RayLauncher(N_TASKS, timeout=120).launch(task_type=RankTask) == [0, 1]


def raw_ray_launch(with_placement_group: bool) -> Callable[[], None]:
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    actor_cls = ray.remote(RawActor)

    def launch() -> None:
        pg = None
        if with_placement_group:
            pg = placement_group([{"CPU": 1}] * N_TASKS, strategy="PACK")
            ray.get(pg.ready(), timeout=120)
        actors = []
        for rank in range(N_TASKS):
            options: dict[str, Any] = {"num_cpus": 1}
            if pg is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=rank
                )
            actors.append(actor_cls.options(**options).remote(rank))
        assert ray.get([a.run.remote() for a in actors], timeout=120) == [0, 1]
        for a in actors:
            ray.kill(a)
        if pg is not None:
            remove_placement_group(pg)

    return launch


def measure(variants: dict[str, Callable[[], None]], repeats: int) -> dict[str, list[float]]:
    """Warm each variant up once, then run them ``repeats`` times, interleaved.

    The order rotates every round, so no variant always runs right after the one whose
    leftovers (exiting processes, Ray refilling its worker pool) still hold the CPUs.
    """
    for fn in variants.values():
        fn()
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            start = time.perf_counter()
            variants[name]()
            times[name].append(time.perf_counter() - start)
    return times


def run_mp(repeats: int) -> dict[str, list[float]]:
    tmp = Path(tempfile.mkdtemp(prefix="bench_launch"))
    try:
        script = tmp / "trivial.py"
        script.write_text(_TORCHRUN_SCRIPT)
        return measure({"torchrun": torchrun_launch(script), "MPLauncher": mp_launch}, repeats)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_ray(repeats: int) -> dict[str, list[float]]:
    import ray

    temp_dir = tempfile.mkdtemp(prefix="ray")  # short: Ray's socket paths have a length limit
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        _temp_dir=temp_dir,
        log_to_driver=False,
    )
    try:
        return measure(
            {
                "raw Ray (placement group)": raw_ray_launch(with_placement_group=True),
                "RayLauncher": ray_launch,
                "raw Ray (no placement group)": raw_ray_launch(with_placement_group=False),
            },
            repeats,
        )
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)


def summarize(times: dict[str, list[float]]) -> list[dict[str, Any]]:
    pairs = {"MPLauncher": "torchrun", "RayLauncher": "raw Ray (placement group)"}
    rows = []
    for name, samples in times.items():
        row: dict[str, Any] = {
            "variant": name,
            "median_s": statistics.median(samples),
            "min_s": min(samples),
            "samples_s": samples,
        }
        baseline = pairs.get(name)
        if baseline in times:
            row["baseline"] = baseline
            row["ratio"] = row["median_s"] / statistics.median(times[baseline])
            row["target"] = TARGET
            row["meets_target"] = row["ratio"] <= TARGET
        rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'variant':<30} {'median s':>9} {'min s':>7} {'ratio':>6}  target")
    for r in rows:
        ratio = f"{r['ratio']:.2f}" if "ratio" in r else "-"
        verdict = ""
        if "ratio" in r:
            verdict = f"<= {TARGET} vs {r['baseline']}: {'met' if r['meets_target'] else 'MISSED'}"
        print(f"{r['variant']:<30} {r['median_s']:>9.3f} {r['min_s']:>7.3f} {ratio:>6}  {verdict}")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install 'vllm_dist[bench]')")
        return
    fig, ax = plt.subplots(figsize=(8, 3.5))
    names = [r["variant"] for r in rows]
    ax.barh(names, [r["median_s"] for r in rows], color="tab:blue")
    ax.set_xlabel(f"median wall time of a {N_TASKS}-rank launch (s)")
    ax.invert_yaxis()
    for i, r in enumerate(rows):
        if "ratio" in r:
            ax.text(r["median_s"], i, f"  {r['ratio']:.2f}x", va="center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", type=Path, default=Path("bench_results/launch.json"))
    parser.add_argument("--skip-ray", action="store_true", help="only MPLauncher vs torchrun")
    args = parser.parse_args()

    times = run_mp(args.repeats)
    if not args.skip_ray:
        times.update(run_ray(args.repeats))
    rows = summarize(times)
    print_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"n_tasks": N_TASKS, "repeats": args.repeats, "cpus": os.cpu_count()}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {args.out}")
    plot(rows, args.out.with_suffix(".png"))


if __name__ == "__main__":
    sys.exit(main())
