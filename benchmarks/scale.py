"""Scale: the weight-transfer set-up of trillion-parameter fleets planned on one CPU, and the
sync a link model predicts for them.

Question: does the planner hold at 256 trainer -> 128 inference GPUs, how does its cost grow
with the fleet, and what would our schedule do there? Every fleet is dry-run with the engine's
own set-up code (``vllm_dist.tasks.weight_transfer.dryrun``: real bake, index, router, plan
and the producers' checks, no bytes moved, one process). Large fleets simulate the workers of
one inference replica exactly, which is what every replica plans (the router resolves
``consumer_id % workers_per_replica``); producer loads are scaled by the replica count.

Every sync time printed here is a PREDICTION of the link model, except the columns marked
``anchor`` (published by others for the same model and fleet size) and ``measured`` (our own
runs of ``benchmarks/weight_transfer.py``). The validation table checks the predictor against
those measurements; its calibration points are marked.

    python benchmarks/scale.py [--fleets kimi,qwen] [--no-sweep] [--block]
        [--cpu-json bench_results/weight_transfer.json] [--out bench_results/scale.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchmarks._common import human, print_table, write_outputs  # noqa: E402
from vllm_dist.tasks.weight_transfer import TransferConfig  # noqa: E402
from vllm_dist.tasks.weight_transfer.dryrun import (  # noqa: E402
    FLEETS,
    PRESETS,
    dry_run,
    plan_fleet,
    predict,
    sweep,
)
from vllm_dist.tasks.weight_transfer.index import ProducerFacts  # noqa: E402
from vllm_dist.tasks.weight_transfer.router import ENGINE_BALANCE  # noqa: E402
from vllm_dist.tasks.weight_transfer.source import WeightMeta  # noqa: E402

# Our measurements (1 producer -> 2 TP-2 consumers, nixl_rdt, replayed, --in-place), given
# as (case, sync seconds). GPU: one H100. CPU: this project's 2-core CI-class host; a run of
# benchmarks/weight_transfer.py passed with --cpu-json replaces these.
MEASURED_GPU = {"llama 1000 MB": 1.195e-3, "llama 8000 MB": 6.48e-3, "moe 100000": 0.84e-3}
MEASURED_CPU = {"llama 100 MB": 8.195e-3, "llama 400 MB": 30.59e-3, "moe 100000": 58.53e-3}
MEASURED_CPU_CHUNKS = {"llama 100 MB": 54, "llama 400 MB": 262, "moe 100000": 64}
# which cases fitted the preset's free parameters (the others are held out)
CALIBRATION = {
    "h100_one_gpu": set(),  # fitted to raw READs only: every sync is a prediction
    "cpu_shm": {"llama 100 MB", "llama 400 MB"},
}


def validation(cpu_json: str | None) -> list[dict[str, Any]]:
    """The predictor against our measured syncs, on the same layouts dry-run."""
    import weight_transfer as wt  # the measuring benchmark's shapes and consumer layouts

    from vllm_dist.examples.llama_tp import llama_tp_layout

    cpu, cpu_chunks = dict(MEASURED_CPU), dict(MEASURED_CPU_CHUNKS)
    if cpu_json:
        with open(cpu_json) as f:
            for row in json.load(f)["rows"]:
                key = row["case"].rsplit(" h", 1)[0].replace(" tensors", "")
                cpu[key], cpu_chunks[key] = row["sync_s"], row["chunks"]
    rows = []
    for preset, measured in (("h100_one_gpu", MEASURED_GPU), ("cpu_shm", cpu)):
        for case, seconds in measured.items():
            moe = case.startswith("moe")
            if moe:
                shapes = wt.moe_shapes(int(case.split()[1]))
            else:
                mb = int(case.split()[1])
                shapes = wt.llama_like_shapes(mb * wt.MB, wt.auto_hidden(mb * wt.MB))
            metas = tuple(
                WeightMeta(name=n, dtype=str(d), shape=tuple(s)) for n, (s, d) in shapes.items()
            )

            def layout_of(w: int, shapes: Any = shapes, moe: bool = moe) -> Any:
                if moe:
                    return wt.moe_layout(shapes, w, 2, device="meta")
                return llama_tp_layout(shapes, w, 2, device="meta", transposed_down=False)

            config = TransferConfig(workers_per_replica=2, max_chunk_bytes=64 << 20)
            run = dry_run(
                metas,
                [ProducerFacts(metadata=metas, held=None)],
                2,
                2,
                layout_of,
                config=config,
                strided=True,
            )
            pred = predict(run, PRESETS[preset])
            chunks = sum(len(c) for c in run.chunks.values())
            rows.append(
                {
                    "device": preset,
                    "case": case,
                    "bytes": sum(p.nbytes for p in run.pairs),
                    "chunks_planned": chunks,
                    "chunks_measured": cpu_chunks.get(case) if preset == "cpu_shm" else None,
                    "measured_s": seconds,
                    "predicted_s": pred.predicted_s,
                    "error": pred.predicted_s / seconds - 1,
                    "role": "calibration" if case in CALIBRATION[preset] else "held out",
                }
            )
    return rows


def monotonic_check(report: dict[str, Any], run: Any, preset: str) -> list[float]:
    """Predicted seconds at 0.5x, 1x, 2x bandwidth (must fall)."""
    return [predict(run, PRESETS[preset].with_bandwidth(f)).predicted_s for f in (0.5, 1, 2)]


# published syncs by fleet size in ranks (other teams' runs, other models): plotted beside
ANCHORS = [
    (16, "Qwen3-235B 8->8 H100", 3.2),
    (96, "GLM-5-class 64->32 H200", 2.84),
    (384, "Kimi-K2 256->128", 1.3),
]


def _or_dash(value: Any) -> Any:
    return "-" if value is None else value


def _peaks(r: dict[str, Any]) -> str:
    """Peak traced MB of consumer 0 / the busiest producer / the index, or '-'."""
    keys = ("consumer_peak_mb", "producer_peak_mb", "index_peak_mb")
    return "/".join("-" if r[k] is None else f"{r[k]:.3g}" for k in keys)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fleets", default="", help="comma-separated name filters (default: all)")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--sweep-model", default="kimi-k2")
    ap.add_argument("--no-validate", action="store_true")
    ap.add_argument(
        "--block", action="store_true", help="also plan each fleet with DESIGN's block rule"
    )
    ap.add_argument("--no-memory", action="store_true", help="skip tracemalloc (faster)")
    ap.add_argument("--cpu-json", default=None, help="a weight_transfer.py JSON to validate on")
    ap.add_argument("--out", default="bench_results/scale.json")
    args = ap.parse_args()
    wanted = [w for w in args.fleets.split(",") if w]
    fleets = [f for f in FLEETS if not wanted or any(w in f.name for w in wanted)]
    reports = []
    for spec in fleets:
        for balance in (ENGINE_BALANCE, "block") if args.block else (ENGINE_BALANCE,):
            report, run = plan_fleet(spec, measure_memory=not args.no_memory, balance=balance)
            report["predicted_s_at_bw_x0.5_x1_x2"] = monotonic_check(report, run, spec.link)
            reports.append(report)
            print(f"planned {report['fleet']} in {report['wall_s']:.1f} s", flush=True)
    fleet_table = print_table(
        "fleets (set-up: engine code, measured here; sync: PREDICTED by the link model; "
        "anchor: PUBLISHED by others)",
        [
            "fleet",
            "params",
            "ranks",
            "sim/cons",
            "setup s/rank",
            "gather s",
            "index s",
            "peak MB/rank",
            "peak MB c/p/idx",
            "gather MB",
            "pair bytes",
            "chunks/cons",
            "max/mean",
            "pred s",
            "bound s",
            "pred/bound",
            "anchor s",
        ],
        [
            [
                r["fleet"],
                f"{r['params_b']:.0f}B",
                r["producers"] + r["consumers"],
                f"{r['simulated_consumers']}/{r['consumers']}",
                r["setup_s_per_rank_max"],
                r["gather_s"],
                r["index_s"],
                _or_dash(r["peak_mb_per_rank"]),
                _peaks(r),
                _or_dash(r["gather_mb"]),
                f"{human(r['pair_bytes_min'])}..{human(r['pair_bytes_max'])}",
                r["chunks_per_consumer_max"],
                r["producer_load_max_over_mean"],
                r["predicted_s"],
                r["bound_s"],
                r["predicted_over_bound"],
                _or_dash(r["anchor_s"]),
            ]
            for r in reports
        ],
    )
    for r in reports:
        runs = r["schedule_consumer0"]
        shown = ", ".join(f"p{p} g{g0}-{g1} {human(n)}" for p, g0, g1, n in runs[:6])
        more = f" ... ({len(runs)} runs)" if len(runs) > 6 else ""
        print(f"schedule, {r['fleet']}, consumer 0: {shown}{more}")
    sweep_rows: list[dict[str, Any]] = []
    if not args.no_sweep:
        for spec in sweep(args.sweep_model):
            report, _ = plan_fleet(spec, measure_memory=not args.no_memory)
            report["ranks"] = spec.producers + spec.consumers
            sweep_rows.append(report)
            print(f"planned {report['fleet']} in {report['wall_s']:.1f} s", flush=True)
        print_table(
            f"set-up cost and sync against fleet size ({args.sweep_model}; one replica "
            "simulated; sync PREDICTED; anchors PUBLISHED, other models)",
            [
                "ranks",
                "fleet",
                "setup s/rank",
                "gather s",
                "index s",
                "consumer s",
                "producer s",
                "peak MB/rank",
                "max/mean",
                "pred s",
                "bound s",
                "anchor at this size",
            ],
            [
                [
                    r["ranks"],
                    r["fleet"],
                    r["setup_s_per_rank_max"],
                    r["gather_s"],
                    r["index_s"],
                    r["consumer_setup_s_max"],
                    r["producer_setup_s_max"],
                    _or_dash(r["peak_mb_per_rank"]),
                    r["producer_load_max_over_mean"],
                    r["predicted_s"],
                    r["bound_s"],
                    "; ".join(f"{n} {t} s" for k, n, t in ANCHORS if k == r["ranks"]) or "-",
                ]
                for r in sweep_rows
            ],
        )
    checks: list[dict[str, Any]] = []
    if not args.no_validate:
        checks = validation(args.cpu_json)
        print_table(
            "validation: PREDICTED vs MEASURED sync (1 producer -> 2 TP-2 consumers, nixl_rdt)",
            [
                "device",
                "case",
                "bytes",
                "chunks plan/meas",
                "measured ms",
                "pred ms",
                "error",
                "role",
            ],
            [
                [
                    c["device"],
                    c["case"],
                    human(c["bytes"]),
                    f"{c['chunks_planned']}/{c['chunks_measured'] or '-'}",
                    c["measured_s"] * 1e3,
                    c["predicted_s"] * 1e3,
                    f"{c['error']:+.0%}",
                    c["role"],
                ]
                for c in checks
            ],
        )

    def plot(png: str) -> None:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        ranks = [r["ranks"] for r in sweep_rows]
        ax[0].plot(ranks, [r["setup_s_per_rank_max"] for r in sweep_rows], "o-", label="max")
        ax[0].plot(ranks, [r["gather_s"] for r in sweep_rows], "^:", label="gather facts")
        ax[0].plot(ranks, [r["index_s"] for r in sweep_rows], "s--", label="index")
        ax[0].axhline(10, color="grey", lw=0.8, ls=":", label="target (10 s)")
        ax[0].set(xlabel="ranks", ylabel="set-up s per rank", xscale="log", title="set-up")
        ax[0].legend(fontsize=7, loc="upper left")
        mb = ax[0].twinx()
        peaks = [r["peak_mb_per_rank"] for r in sweep_rows]
        if all(p is not None for p in peaks):
            mb.plot(ranks, peaks, "d-.", color="tab:red", label="peak MB per rank")
            mb.set_ylabel("peak MB per rank (traced)")
            mb.legend(fontsize=7, loc="upper right")
        ax[1].plot(ranks, [r["predicted_s"] for r in sweep_rows], "o-", label="predicted")
        ax[1].plot(ranks, [r["bound_s"] for r in sweep_rows], "s--", label="link bound")
        for k, name, seconds in ANCHORS:
            ax[1].plot([k], [seconds], "*", markersize=10, label=f"published: {name}")
        ax[1].set(xlabel="ranks", ylabel="sync s", xscale="log", title=f"sync ({args.sweep_model})")
        ax[1].legend(fontsize=7)
        ticks = sorted({*ranks, *(k for k, _, _ in ANCHORS)})
        for a in ax:
            a.set_xticks(ticks, [str(n) for n in ticks])
            a.minorticks_off()
        fig.tight_layout()
        fig.savefig(png)

    write_outputs(
        args.out,
        {
            "args": vars(args),
            "fleets": reports,
            "sweep": sweep_rows,
            "validation": checks,
            "table": fleet_table,
        },
        plot if sweep_rows else None,
    )


if __name__ == "__main__":
    main()
