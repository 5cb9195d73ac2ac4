"""Fleets to plan on paper: a model, a producer layout, a consumer layout, a link model; and
``plan_fleet``, which dry-runs one and reports what the scale question asks per fleet.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_dist.tasks.weight_transfer.config import TransferConfig
from vllm_dist.tasks.weight_transfer.dryrun.layouts import (
    ProducerLayout,
    consumer_layout,
    producer_facts,
)
from vllm_dist.tasks.weight_transfer.dryrun.linkmodel import (
    PRESETS,
    LinkModel,
    fsdp_gather_s,
    predict,
)
from vllm_dist.tasks.weight_transfer.dryrun.models import MODELS, model_bytes, model_metas
from vllm_dist.tasks.weight_transfer.dryrun.simulate import DryRun, dry_run
from vllm_dist.tasks.weight_transfer.router import ENGINE_BALANCE


@dataclass(frozen=True, kw_only=True)
class FleetSpec:
    """One fleet: ``producers`` trainer GPUs laid out as ``producer_layout`` serving
    ``consumers`` inference GPUs in replicas of ``replica_tp`` workers."""

    name: str
    model: str  # a key of ``MODELS``
    producers: int
    consumers: int
    replica_tp: int
    producer_layout: ProducerLayout = field(default_factory=ProducerLayout)
    expert_parallel: bool = True
    link: str = "h100_rdma"  # a key of ``PRESETS``
    strided: bool = False
    sample: int | None = None  # simulate this many workers of replica 0 (None: every consumer)
    anchor_s: float | None = None  # a published sync time for this model and fleet size
    anchor_note: str = ""
    max_chunk_mib: int = 64

    def config(self) -> TransferConfig:
        return TransferConfig(
            workers_per_replica=self.replica_tp, max_chunk_bytes=self.max_chunk_mib << 20
        )


def plan_fleet(
    spec: FleetSpec,
    *,
    measure_memory: bool = True,
    link: LinkModel | None = None,
    balance: str = ENGINE_BALANCE,
) -> tuple[dict[str, Any], DryRun]:
    """Dry-run ``spec``; a JSON-ready report and the run itself."""
    start = time.perf_counter()
    metas = model_metas(MODELS[spec.model])
    facts = producer_facts(metas, spec.producer_layout, spec.producers)
    build_s = time.perf_counter() - start

    def layout_of(worker: int) -> Any:  # built when the worker is simulated, then dropped
        return consumer_layout(metas, spec.replica_tp, worker, expert_parallel=spec.expert_parallel)

    run = dry_run(
        metas,
        facts,
        spec.consumers,
        spec.replica_tp,
        layout_of,
        config=spec.config(),
        strided=spec.strided,
        sample=spec.sample,
        measure_memory=measure_memory,
        balance=balance,
    )
    link = link or PRESETS[spec.link]
    report = _report(spec, run, link, model_bytes(metas))
    report["metadata_s"] = build_s
    report["balance"] = balance
    if balance != ENGINE_BALANCE:
        report["fleet"] += f" [{balance} router]"
    report["wall_s"] = time.perf_counter() - start
    return report, run


def _report(spec: FleetSpec, run: DryRun, link: LinkModel, total: int) -> dict[str, Any]:
    """What the scale question asks of one fleet, JSON-ready."""
    pred = predict(run, link)
    load = run.producer_load()
    need = {p.consumer: 0 for p in run.pairs}
    for p in run.pairs:
        need[p.consumer] += p.payload
    cons_s = [run.consumers[c].seconds for c in run.simulated]
    prod_s = [c.seconds for c in run.producers.values()]
    pair_bytes = [p.nbytes for p in run.pairs]
    report: dict[str, Any] = {
        "fleet": spec.name,
        "model": spec.model,
        "params_b": total / 2e9,
        "model_bytes": total,
        "names": run.names,
        "producers": spec.producers,
        "producer_layout": f"{spec.producer_layout.kind} tp{spec.producer_layout.tp} "
        f"pp{spec.producer_layout.pp} ep{spec.producer_layout.ep}",
        "consumers": spec.consumers,
        "replica": f"tp{spec.replica_tp}" + (" ep" if spec.expert_parallel else ""),
        "simulated_consumers": len(run.simulated),
        "sampled": len(run.simulated) != spec.consumers,
        "gather_s": run.gather_seconds,
        "gather_mb": _mb(run.gather_bytes),
        "index_s": run.index_seconds,
        "index_peak_mb": _mb(run.index_peak_bytes),
        "consumer_setup_s_max": max(cons_s),
        "consumer_setup_s_mean": float(np.mean(cons_s)),
        "consumer_peak_mb": _mb(run.consumers[run.simulated[0]].peak_bytes),
        "producer_setup_s_max": max(prod_s),
        "producer_peak_mb": _mb(
            max((c.peak_bytes or 0 for c in run.producers.values()), default=0) or None
        ),
        "setup_s_per_rank_max": run.gather_seconds
        + run.index_seconds
        + max(max(cons_s), max(prod_s)),
        "peak_mb_per_rank": _rank_peak(run),
        "pairs": len(run.pairs) * run.scale(),
        "pair_bytes_min": min(pair_bytes),
        "pair_bytes_max": max(pair_bytes),
        "consumer_bytes_max": max(need.values()),
        "consumer_bytes_sum": sum(need.values()) * run.scale(),
        "chunks_per_consumer_max": max(len(run.chunks[c]) for c in run.simulated),
        "producer_load_max_over_mean": run.balance(),
        "producers_idle": int((load == 0).sum()),
        "schedule_consumer0": [list(r) for r in run.schedule(run.simulated[0])],
        "link": spec.link,
        "predicted_s": pred.predicted_s,
        "bound_s": pred.bound_s,
        "predicted_over_bound": pred.over_bound,
        "slowest": pred.slowest,
        "pack_s": pred.pack_s,
        "rounds": pred.rounds,
        "anchor_s": spec.anchor_s,
        "anchor_note": spec.anchor_note,
    }
    if spec.producer_layout.kind == "fsdp":
        report["fsdp_gather_s"] = fsdp_gather_s(total, spec.producers, link)
    return report


def _rank_peak(run: DryRun) -> float | None:
    """The busiest rank's traced peak MB: its gathered facts and index, which it keeps, plus
    the larger of consumer 0's and the busiest producer's own set-up peak (None: not traced)."""
    own = [run.consumers[run.simulated[0]].peak_bytes]
    own += [c.peak_bytes for c in run.producers.values() if c.peak_bytes is not None]
    parts = [run.gather_bytes, run.index_peak_bytes, max((x or 0 for x in own), default=0)]
    if run.gather_bytes is None or run.index_peak_bytes is None or own[0] is None:
        return None
    return sum(x or 0 for x in parts) / 1e6


def _mb(n: int | None) -> float | None:
    return None if n is None else n / 1e6


# Published anchors (what others measured; our numbers beside them are predictions).
KIMI = "Kimi-K2 1T, 256 trainer -> 128 inference GPUs, RDMA (Perplexity): 1.3 s"
QWEN = "Qwen3-235B, 8xH100 -> 8xH100, vLLM sharded RDT backend: 3.2 s"
GLM = "GLM-5-class, 64 -> 32 H200, PRIME-RL: 2.84 s (~44 GB/s per inference GPU)"

FLEETS: list[FleetSpec] = [
    FleetSpec(
        name="kimi-k2 256->128 megatron",
        model="kimi-k2",
        producers=256,
        consumers=128,
        replica_tp=32,
        producer_layout=ProducerLayout(kind="megatron", tp=8, pp=4, ep=8),
        sample=32,
        anchor_s=1.3,
        anchor_note=KIMI,
    ),
    FleetSpec(
        name="kimi-k2 256->128 fsdp",
        model="kimi-k2",
        producers=256,
        consumers=128,
        replica_tp=32,
        producer_layout=ProducerLayout(kind="fsdp"),
        sample=32,
        anchor_s=1.3,
        anchor_note=KIMI,
    ),
    FleetSpec(
        name="qwen3-235b 8->8 fsdp",
        model="qwen3-235b-a22b",
        producers=8,
        consumers=8,
        replica_tp=8,
        producer_layout=ProducerLayout(kind="fsdp"),
        anchor_s=3.2,
        anchor_note=QWEN,
    ),
    FleetSpec(
        name="qwen3-235b 8->8 megatron",
        model="qwen3-235b-a22b",
        producers=8,
        consumers=8,
        replica_tp=8,
        producer_layout=ProducerLayout(kind="megatron", tp=2, pp=2, ep=2),
        anchor_s=3.2,
        anchor_note=QWEN,
    ),
    FleetSpec(
        name="glm5-class 64->32 megatron",
        model="glm5-class",
        producers=64,
        consumers=32,
        replica_tp=16,
        producer_layout=ProducerLayout(kind="megatron", tp=4, pp=4, ep=4),
        link="h200_rdma",
        sample=16,
        anchor_s=2.84,
        anchor_note=GLM,
    ),
    FleetSpec(
        name="llama3-405b 64->32 whole",
        model="llama3-405b",
        producers=64,
        consumers=32,
        replica_tp=16,
        expert_parallel=False,
        sample=16,
    ),
    FleetSpec(
        name="llama3-8b 8->8 whole",
        model="llama3-8b",
        producers=8,
        consumers=8,
        replica_tp=2,
        expert_parallel=False,
    ),
]


# (producers, consumers, replica TP, producer TP, PP, EP): 8 -> 384 ranks, trainers 2:1 at scale
SWEEP = (
    (4, 4, 4, 2, 2, 1),
    (16, 8, 8, 2, 2, 4),
    (48, 16, 16, 4, 2, 2),
    (128, 64, 32, 8, 4, 4),
    (256, 128, 32, 8, 4, 8),
)


def sweep(model: str = "kimi-k2") -> list[FleetSpec]:
    """Fleets of 8 -> 384 ranks of one model (Megatron producers, expert-parallel replicas),
    the workers of replica 0 simulated exactly: how set-up cost and sync grow with the fleet."""
    return [
        FleetSpec(
            name=f"{model} {producers}->{consumers}",
            model=model,
            producers=producers,
            consumers=consumers,
            replica_tp=tp,
            producer_layout=ProducerLayout(kind="megatron", tp=ptp, pp=pp, ep=ep),
            sample=tp,
        )
        for producers, consumers, tp, ptp, pp, ep in SWEEP
    ]
