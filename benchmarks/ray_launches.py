"""Does a driver stay flat over many RayLauncher launches, and does a killed one leave Ray behind?

Question 1: 50 launches of a 2-rank task (successes, raises and exits in turn) in one fresh
driver that had no Ray: the driver's threads, open fds and RSS after launches 1, 5, 10, 20, 30,
40 and 50, and the Ray session folders left. RayLauncher starts one private Ray at the first
launch and reuses it, so after the first launch the counts should stay flat.

Question 2: the driver is SIGKILLed after a launch: how many of the processes it started (Ray's
GCS, raylet, agents, workers) are alive 1, 5, 10 and 30 s later.

Prints both tables and writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import print_table, write_outputs  # noqa: E402

_DRIVER = """
import json, os, sys, time
from vllm_dist import DistributedTask, LaunchError, RayLauncher


class Task(DistributedTask):
    def run(self, mode):
        if self.worker_info.rank == 1 and mode == "raise":
            raise RuntimeError("boom")
        if self.worker_info.rank == 1 and mode == "exit":
            os._exit(3)
        return self.worker_info.rank


def rss_kb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


if __name__ == "__main__":
    launches, hold = int(sys.argv[1]), sys.argv[2] == "hold"
    launcher = RayLauncher(2, timeout=60)
    for i in range(launches):
        mode = "exit" if i % 6 == 5 else "raise" if i % 6 == 2 else "ok"
        start = time.monotonic()
        try:
            launcher.launch(task_type=Task, mode=mode)
        except LaunchError:
            assert mode != "ok"
        row = {
            "launch": i + 1,
            "mode": mode,
            "seconds": time.monotonic() - start,
            "threads": len(os.listdir("/proc/self/task")),
            "fds": len(os.listdir("/proc/self/fd")),
            "rss_mb": rss_kb() / 1024,
        }
        print("ROW " + json.dumps(row), flush=True)
    if hold:
        print("READY", flush=True)
        time.sleep(600)
"""


def _env(ray_tmp: str) -> dict[str, str]:
    return {
        **os.environ,
        "RAY_TMPDIR": ray_tmp,
        "RAY_ADDRESS": "",
        "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
    }


def flatness(launches: int) -> dict[str, Any]:
    ray_tmp = tempfile.mkdtemp(prefix="ray")
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _DRIVER, str(launches), "exit"],
            env=_env(ray_tmp),
            capture_output=True,
            text=True,
            timeout=1800,
        )
        sessions = glob.glob(f"{ray_tmp}/session_2*") + glob.glob(f"{ray_tmp}/*/session_2*")
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-3000:])
    rows = [json.loads(ln[4:]) for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
    return {"rows": rows, "session_dirs": len(sessions)}


def killed_driver(marks: tuple[float, ...] = (1.0, 5.0, 10.0, 30.0)) -> list[dict[str, Any]]:
    import psutil

    ray_tmp = tempfile.mkdtemp(prefix="ray")
    proc = subprocess.Popen(
        [sys.executable, "-c", _DRIVER, "1", "hold"],
        env=_env(ray_tmp),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        while not proc.stdout.readline().startswith("READY"):
            pass
        tree = psutil.Process(proc.pid).children(recursive=True)
        out = [{"after_s": 0.0, "alive": len(tree), "names": sorted(p.name() for p in tree)}]
        os.kill(proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        for mark in marks:
            time.sleep(max(0.0, killed + mark - time.monotonic()))
            alive = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            out.append({"after_s": mark, "alive": len(alive), "names": [p.name() for p in alive]})
        return out
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(ray_tmp, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--launches", type=int, default=50)
    ap.add_argument("--out", default="benchmarks/results/ray_launches.json")
    args = ap.parse_args()
    flat = flatness(args.launches)
    rows = flat["rows"]
    shown = [r for r in rows if r["launch"] in {1, 5, 10, 20, 30, 40, args.launches}]
    print_table(
        f"driver after N RayLauncher launches (one private Ray; {flat['session_dirs']} session "
        "folder(s) in all)",
        ["launch", "threads", "fds", "rss_mb", "launch_s"],
        [(r["launch"], r["threads"], r["fds"], r["rss_mb"], r["seconds"]) for r in shown],
    )
    first, last = rows[0], rows[-1]
    print(
        f"growth from launch 1 to {last['launch']}: threads {last['threads'] - first['threads']:+d}"
        f", fds {last['fds'] - first['fds']:+d}, RSS {last['rss_mb'] - first['rss_mb']:+.1f} MB"
    )
    killed = killed_driver()
    print_table(
        "processes the driver started, alive after it was SIGKILLed",
        ["after_s", "alive", "names"],
        [(k["after_s"], k["alive"], " ".join(k["names"])) for k in killed],
    )
    write_outputs(args.out, {"flatness": flat, "killed_driver": killed}, None)


if __name__ == "__main__":
    main()
