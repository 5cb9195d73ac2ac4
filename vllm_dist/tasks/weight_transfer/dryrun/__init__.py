"""The weight-transfer set-up on paper: plan a fleet of any size in one process (no bytes, no
processes per rank) with the engine's own code, and predict its sync from a link model."""

from vllm_dist.tasks.weight_transfer.dryrun.fleets import FLEETS, FleetSpec, plan_fleet, sweep
from vllm_dist.tasks.weight_transfer.dryrun.layouts import (
    ProducerLayout,
    consumer_layout,
    producer_facts,
)
from vllm_dist.tasks.weight_transfer.dryrun.linkmodel import (
    PRESETS,
    LinkModel,
    Prediction,
    fsdp_gather_s,
    predict,
)
from vllm_dist.tasks.weight_transfer.dryrun.models import MODELS, model_bytes, model_metas
from vllm_dist.tasks.weight_transfer.dryrun.simulate import DryRun, PairPlan, RankCost, dry_run

__all__ = [
    "FLEETS",
    "MODELS",
    "PRESETS",
    "DryRun",
    "FleetSpec",
    "LinkModel",
    "PairPlan",
    "Prediction",
    "ProducerLayout",
    "RankCost",
    "consumer_layout",
    "dry_run",
    "fsdp_gather_s",
    "model_bytes",
    "model_metas",
    "plan_fleet",
    "predict",
    "producer_facts",
    "sweep",
]
