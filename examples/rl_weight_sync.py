"""Trainer to inference engine: push fresh weights after every optimizer step, and check them.

One trainer rank (the producer) trains a small language model with AdamW. Two inference
workers (the consumers) form one tensor-parallel replica of size 2, each keeping only its shard
of every weight, in its own layout: gate and up projections fused into one ``gate_up``
parameter, column-parallel and row-parallel shards. They say how to fill their parameters with
*loaders*, plain functions ``loader(dest, src)`` of the kind an inference engine already has;
the library bakes them once and then moves only the bytes each worker needs, every step.

Runs on the CPU with the base install (torch, cloudpickle, numpy)::

    python3 examples/rl_weight_sync.py --steps 3

Each step, every consumer re-runs the trainer's steps on a private copy (deterministic on the
CPU), applies its own loaders to it, and compares the result with what it received, byte for byte.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
from torch import nn

from vllm_dist import CommunicatorType, CoordinatorType, MPLauncher
from vllm_dist.tasks.weight_transfer import (
    ConsumerSpec,
    StateDictSource,
    TransferConfig,
    WeightSource,
    WeightTransferTask,
)

VOCAB, HIDDEN, INTER, LAYERS, TP = 128, 64, 128, 2, 2


# --------------------------------------------------------------------------- the trainer's model


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.gate = nn.Linear(HIDDEN, INTER, bias=False)
        self.up = nn.Linear(HIDDEN, INTER, bias=False)
        self.down = nn.Linear(INTER, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


class TinyLM(nn.Module):
    """A small residual MLP language model; its parameter names are what the engine routes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class Trainer:
    """The model and its optimizer; ``step(k)`` is one deterministic training step."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = TinyLM()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)

    def step(self, k: int) -> float:
        g = torch.Generator().manual_seed(1000 + k)  # counting sequences: a task it can learn
        tokens = (torch.randint(0, VOCAB, (8, 1), generator=g) + torch.arange(17)) % VOCAB
        logits = self.model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()  # writes the parameters in place: what StateDictSource(in_place=True) promises
        return loss.item()


# --------------------------------------------------------------------------- the engine's loaders


def rows(tp_rank: int, offset: int = 0):  # noqa: ANN201 - a loader factory
    """Column parallel: this rank's rows of ``src``, at ``offset`` rows of ``dest`` (fused)."""

    def load(dest: torch.Tensor, src: torch.Tensor) -> None:
        n = src.shape[0] // TP
        dest.narrow(0, offset, n).copy_(src.narrow(0, tp_rank * n, n))

    return load


def cols(tp_rank: int):  # noqa: ANN201
    """Row parallel: this rank's slice of the input dimension."""

    def load(dest: torch.Tensor, src: torch.Tensor) -> None:
        dest.copy_(src.chunk(TP, dim=1)[tp_rank])

    return load


def whole(dest: torch.Tensor, src: torch.Tensor) -> None:
    """Replicated: norms and the row-parallel bias."""
    dest.copy_(src)


def engine_layout(tp_rank: int) -> tuple[dict[str, torch.Tensor], dict[str, list[Any]]]:
    """This rank's parameters, and for every trainer name the (parameter, loader) pairs it fills."""
    params: dict[str, torch.Tensor] = {
        "embed": torch.zeros(VOCAB // TP, HIDDEN),
        "lm_head": torch.zeros(VOCAB // TP, HIDDEN),
    }
    routes: dict[str, list[Any]] = {
        "embed.weight": [("embed", rows(tp_rank))],
        "head.weight": [("lm_head", rows(tp_rank))],
    }
    for i in range(LAYERS):
        p, t = f"layers.{i}", f"layers.{i}"
        params[f"{p}.norm.weight"] = torch.zeros(HIDDEN)
        params[f"{p}.norm.bias"] = torch.zeros(HIDDEN)
        params[f"{p}.gate_up"] = torch.zeros(2 * INTER // TP, HIDDEN)  # fused, as engines keep it
        params[f"{p}.down.weight"] = torch.zeros(HIDDEN, INTER // TP)
        params[f"{p}.down.bias"] = torch.zeros(HIDDEN)
        routes[f"{t}.norm.weight"] = [(f"{p}.norm.weight", whole)]
        routes[f"{t}.norm.bias"] = [(f"{p}.norm.bias", whole)]
        routes[f"{t}.gate.weight"] = [(f"{p}.gate_up", rows(tp_rank, 0))]
        routes[f"{t}.up.weight"] = [(f"{p}.gate_up", rows(tp_rank, INTER // TP))]
        routes[f"{t}.down.weight"] = [(f"{p}.down.weight", cols(tp_rank))]
        routes[f"{t}.down.bias"] = [(f"{p}.down.bias", whole)]
    return params, routes


# --------------------------------------------------------------------------- the task


class RLWeightSync(WeightTransferTask):
    """Rank 0 trains and serves its weights; ranks 1-2 are one TP-2 inference replica."""

    def make_source(self, producer_idx: int, num_producers: int, **_: Any) -> WeightSource:
        self.trainer = Trainer()
        return StateDictSource(self.trainer.model, in_place=True)

    def before_producer_sync(self, step: int, source: WeightSource, **_: Any) -> None:
        self.loss = self.trainer.step(step)  # a training step, then the sync pushes its result

    def after_producer_sync(self, step: int, source: WeightSource, **_: Any) -> Any:
        return {"loss": self.loss}

    def make_consumer(self, consumer_idx: int, num_consumers: int, **_: Any) -> ConsumerSpec:
        self.tp_rank = consumer_idx % TP
        params, self.routes = engine_layout(self.tp_rank)
        self.reference = Trainer()  # only to check what arrives
        return ConsumerSpec(params=params, route=lambda name: self.routes.get(name, []))

    def after_consumer_sync(self, step: int, spec: ConsumerSpec, **_: Any) -> Any:
        self.reference.step(step)
        full = self.reference.model.state_dict()
        want = {n: torch.empty_like(t) for n, t in spec.params.items()}
        for name, targets in self.routes.items():
            for pname, loader in targets:
                loader(want[pname], full[name])
        bad = [n for n, t in spec.params.items() if not torch.equal(t, want[n])]
        return {"verified": not bad, "mismatched": bad[:3]}


def _mismatched(consumers: list[dict[str, Any]], k: int) -> list[str]:
    return [n for c in consumers for n in c["outputs"][k]["mismatched"]]


def main() -> int:
    ap = argparse.ArgumentParser(
        description="Train a small model; sync it into a TP-2 replica.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--steps", type=int, default=3, help="optimizer steps, each followed by a sync")
    ap.add_argument(
        "--communicator",
        default="torch_distributed",
        choices=["torch_distributed", "nixl_rdt"],
        help="torch_distributed (send/recv over gloo) or nixl_rdt (one-sided reads; needs nixl)",
    )
    args = ap.parse_args()
    if args.steps < 1:
        ap.error(f"--steps must be at least 1, got {args.steps}")
    start = time.perf_counter()
    results = MPLauncher(1 + TP, timeout=300).launch(
        task_type=RLWeightSync,
        coordinator_type=CoordinatorType.TORCH_DISTRIBUTED,
        communicator_type=CommunicatorType(args.communicator),
        num_producers=1,
        num_consumers=TP,
        syncs=args.steps,
        config=TransferConfig(workers_per_replica=TP),
    )
    trainer = results[0]
    consumers = [r for r in results if r["role"] == "consumer"]
    ok = True
    for k in range(args.steps):
        checks = [c["outputs"][k]["verified"] for c in consumers]
        ok &= all(checks)
        seconds = max(r["syncs"][k]["seconds"] for r in results)
        print(
            f"step {k}: loss {trainer['outputs'][k]['loss']:.4f}  sync {seconds * 1e3:.1f} ms  "
            + (
                "verified on both TP ranks"
                if all(checks)
                else f"MISMATCH {_mismatched(consumers, k)}"
            )
        )
    print(f"{'all steps verified' if ok else 'FAILED'} in {time.perf_counter() - start:.1f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
