"""Elastic fleets: how long a new consumer takes to its first complete sync, and what membership
changes cost the consumers that stay.

Question: when an inference engine joins, dies (kill -9 of its launch) or leaves a running fleet,
how long until the fleet is whole again, and do the other consumers' syncs slow down meanwhile?
Two producers (one launch) hold the model; consumer launches of one worker each (a replica)
come and go on the CPU or one GPU. Events, in order: two consumers sync steadily (the baseline:
a fleet that does not change); a third joins; it is killed; a new launch takes its slot; one of
the first two leaves cleanly. "recover" is, for a join, the time from the launch's start to the
roster showing it ready (its first complete sync done: process start, imports, data plane,
admission, first sync), and for a death or a leave, the time until the producers dropped it.
"others" gives the per-sync seconds of consumer 0 (which never changes) during each event's
window. Weights stay as they are between syncs (every sync still moves every byte: the fleet
runs without replays); each consumer checks every byte after its first and its last sync.

Cases: ``dense`` (``--dense-mb``, default 64 on the CPU and 1000 on CUDA, bf16 matrices of
8 MiB) and ``moe`` (``--moe-tensors`` small expert tensors, default 100,000).

    python benchmarks/elastic.py [--device cpu|cuda] [--comm nixl_rdt|torch_distributed]
        [--dense-mb 64] [--moe-tensors 100000] [--cases dense,moe] [--out bench_results/elastic.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import human, print_table, write_outputs  # noqa: E402
from vllm_dist import CommunicatorType  # noqa: E402
from vllm_dist.examples.elastic_demo import FleetDriver  # noqa: E402
from vllm_dist.examples.elastic_task import ElasticTransferTask  # noqa: E402
from vllm_dist.examples.llama_tp import fill_weights, replicated, tensor_digest  # noqa: E402
from vllm_dist.implementations.coordinators.membership import MembershipConfig  # noqa: E402
from vllm_dist.serialization import register_by_value  # noqa: E402
from vllm_dist.tasks.weight_transfer import (  # noqa: E402
    ConsumerSpec,
    StateDictSource,
    TransferConfig,
    WeightSource,
)

MEMBERSHIP = MembershipConfig(heartbeat_interval_s=0.25, lease_s=2.0, timeout_s=600.0)
Shapes = dict[str, tuple[tuple[int, ...], torch.dtype]]


def dense_shapes(mb: int) -> Shapes:
    """bf16 matrices of 8 MiB (2048 x 2048) adding up to about ``mb`` MB."""
    n = max(1, mb * 10**6 // (2048 * 2048 * 2))
    return {f"layers.{i}.w": ((2048, 2048), torch.bfloat16) for i in range(n)}


def moe_shapes(tensors: int, layers: int = 50) -> Shapes:
    """``tensors`` expert weights of 8 x 16 bf16, spread over ``layers`` layers."""
    per = max(1, tensors // layers)
    return {
        f"layers.{i}.experts.{e}.w": ((8, 16), torch.bfloat16)
        for i in range(layers)
        for e in range(per)
    }


class BenchTask(ElasticTransferTask):
    """Producers hold ``shapes`` filled once; consumers take whole copies and check them after
    their first and last sync (``bytes verified``)."""

    def make_source(self, producer_idx: int, num_producers: int, **kw: Any) -> WeightSource:
        state = {
            n: torch.empty(s, dtype=d, device=self.device) for n, (s, d) in kw["shapes"].items()
        }
        fill_weights(state, 0, 0)
        return StateDictSource(state)

    def make_consumer(self, consumer_idx: int, num_consumers: int, **kw: Any) -> ConsumerSpec:
        self._params = {
            n: torch.zeros(s, dtype=d, device=self.device) for n, (s, d) in kw["shapes"].items()
        }
        self._checked = 0
        loader = replicated()
        return ConsumerSpec(params=self._params, route=lambda name: [(name, loader)])

    def after_consumer_sync(self, step: int, spec: ConsumerSpec, **kw: Any) -> Any:
        self._checked += 1
        if self._checked > 1 and not os.path.exists(kw.get("check_file", "")):
            return None
        want = {n: torch.empty_like(t, device="cpu") for n, t in self._params.items()}
        fill_weights(want, 0, 0)
        bad = [n for n, t in self._params.items() if tensor_digest(t) != tensor_digest(want[n])]
        return {"verified": not bad, "bytes": sum(t.nbytes for t in self._params.values())}


def others(results: Any, start: float, end: float) -> list[float]:
    """Consumer 0's per-sync seconds of the syncs that ended in ``[start, end]``."""
    if not isinstance(results, list):
        return []
    return [s["seconds"] for s in results[0]["syncs"] if start <= s["at"] <= end]


def dropped_at(producers: Any, member_id: str) -> float | None:
    if not isinstance(producers, list):
        return None
    at = [e["at"] for e in producers[0]["events"] if member_id in e["left"] + e["lost"]]
    return min(at) if at else None


def run_case(
    name: str, shapes: Shapes, device: str, comm: str, steady_s: float, out_dir: str
) -> dict[str, Any]:
    """One fleet through the events of the module docstring; its rows."""
    check_file = os.path.join(out_dir, f"elastic-{name}-{os.getpid()}.check")
    driver = FleetDriver(
        num_producers=2,
        capacity=4,
        membership=MEMBERSHIP,
        task=BenchTask,
        launch_timeout=3600,
        share_gpu_nccl=comm == "torch_distributed" and device == "cuda",
        communicator_type=CommunicatorType(comm),
        communicator_options={"timeout": 300.0},
        device=device,
        config=TransferConfig(workers_per_replica=1, stall_timeout=300.0),
        shapes=shapes,
        check_file=check_file,
        pace_s=0.02,
    )
    marks: dict[str, tuple[float, float]] = {}
    joins: dict[str, float] = {}
    try:
        driver.start("producers", "producer", 0, 2)
        driver.start("c0", "consumer", 0, 1)
        driver.start("c1", "consumer", 1, 1)
        driver.wait_ready([0, 1], 900)
        t = time.time()
        time.sleep(steady_s)
        marks["steady (no change)"] = (t, time.time())
        for event, slot, launch in [("join", 2, "c2"), ("kill -9", 2, None), ("rejoin", 2, "c3")]:
            t = time.time()
            if launch is None:
                driver.kill([slot])
                driver.wait_gone([slot], 600)
            else:
                driver.start(launch, "consumer", slot, 1)
                driver.wait_ready([slot], 900)
                joins[event] = time.time() - driver.started[launch]
            marks[event] = (t, time.time())
            time.sleep(steady_s / 2)
        t = time.time()
        driver.leave([1])
        driver.wait_gone([1], 600)
        marks["leave"] = (t, time.time())
        open(check_file, "w").close()  # the last sync of each consumer is checked again
        time.sleep(steady_s / 2)
        results = driver.stop(900)
    finally:
        driver.close()
        if os.path.exists(check_file):
            os.unlink(check_file)
    producers = results.get("producers")
    drops = {
        "kill -9": dropped_at(producers, "consumer/2#1"),
        "leave": dropped_at(producers, "consumer/1#1"),
    }
    verified = [
        o for k, r in results.items() if k != "producers" and isinstance(r, list)
        for x in r for o in x["outputs"] if o
    ]  # fmt: skip
    rows = []
    for event, (start, end) in marks.items():
        times = others(results.get("c0"), start, end)
        if event in joins:
            recover: float | None = joins[event]
        elif event in drops and drops[event] is not None:
            recover = drops[event] - start  # type: ignore[operator]
        else:
            recover = None
        rows.append(
            {
                "case": name,
                "event": event,
                "recover_s": recover,
                "others_median_s": statistics.median(times) if times else None,
                "others_max_s": max(times) if times else None,
                "others_syncs": len(times),
            }
        )
    admitted = 0
    phases: dict[str, float] = {}
    if isinstance(producers, list):
        admitted = sum(len(e["joined"]) for e in producers[0]["events"])
        phases = {k: v for k, v in producers[0]["setup_phases"].items() if k.startswith("admit")}
    return {
        "rows": rows,
        "admissions": admitted,
        "admit_phases_s": phases,  # producer 0, summed over its admissions
        "bytes_verified": sum(o["bytes"] for o in verified if o.get("verified")),
        "all_verified": all(o.get("verified") for o in verified),
        "model_bytes": sum(torch.Size(s).numel() * d.itemsize for s, d in shapes.values()),
        "tensors": len(shapes),
        "errors": {k: str(v)[:200] for k, v in results.items() if isinstance(v, Exception)},
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dense-mb", type=int, default=None)
    ap.add_argument("--moe-tensors", type=int, default=100000)
    ap.add_argument("--cases", default="dense,moe")
    ap.add_argument(
        "--comm",
        default="nixl_rdt",
        choices=["nixl_rdt", "torch_distributed"],
        help="torch_distributed: a gloo group (CPU) or a NCCL communicator (CUDA) per pair",
    )
    ap.add_argument("--steady-s", type=float, default=4.0)
    ap.add_argument("--out", default="bench_results/elastic.json")
    args = ap.parse_args()
    register_by_value(sys.modules[__name__])
    dense_mb = args.dense_mb or (1000 if args.device == "cuda" else 64)
    cases = {"dense": dense_shapes(dense_mb), "moe": moe_shapes(args.moe_tensors)}
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)
    payload: dict[str, Any] = {"device": args.device, "comm": args.comm, "cases": {}}
    table: list[list[Any]] = []
    for name in [c for c in args.cases.split(",") if c]:
        case = run_case(name, cases[name], args.device, args.comm, args.steady_s, out_dir)
        payload["cases"][name] = case
        label = f"{name} ({human(case['model_bytes'])}, {case['tensors']} tensors)"
        for row in case["rows"]:
            table.append(
                [
                    label,
                    row["event"],
                    "-" if row["recover_s"] is None else f"{row['recover_s']:.2f}",
                    "-"
                    if row["others_median_s"] is None
                    else f"{row['others_median_s'] * 1e3:.1f}",
                    "-" if row["others_max_s"] is None else f"{row['others_max_s'] * 1e3:.1f}",
                    row["others_syncs"],
                    human(case["bytes_verified"]) + ("" if case["all_verified"] else " (MISMATCH)"),
                ]
            )
        if case["errors"]:
            print(
                f"{name}: launches that ended in an error (the killed one is expected): {case['errors']}"
            )
        if case["admit_phases_s"]:
            steps = ", ".join(f"{k[7:]} {v:.2f} s" for k, v in case["admit_phases_s"].items())
            print(f"{name}: producer 0 spent, over {case['admissions']} admissions: {steps}")
        # after every case: a later case that runs out of time loses only its own rows
        print_table(
            f"Elastic fleet, 2 producers, {args.device}, {args.comm} (recover: to ready / to dropped)",
            [
                "case",
                "event",
                "recover s",
                "others median ms",
                "others max ms",
                "syncs",
                "verified",
            ],
            table,
        )
        write_outputs(args.out, payload, None)


if __name__ == "__main__":
    main()
