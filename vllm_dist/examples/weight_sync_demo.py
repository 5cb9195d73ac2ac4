"""A CPU demo: a tiny Hugging Face Llama pushed from P producers into C tensor-parallel consumers.

``run_demo(producers=2, consumers=2)`` launches one fleet with ``MPLauncher``, changes the
weights before every sync, checks every consumer parameter byte for byte against the slice its
loader takes from the full model, and returns a summary (bytes moved, time, GB/s, verified). The
CLI wires it as ``vllm-dist run weight-transfer``.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from vllm_dist.examples.llama_tp import (
    Shapes,
    build_llama,
    expected_params,
    fill_weights,
    llama_tp_layout,
    tensor_digest,
    tiny_llama_config,
    tiny_llama_shapes,
)
from vllm_dist.interfaces import Launcher
from vllm_dist.memory import shared_empty
from vllm_dist.tasks.weight_transfer import (
    ConsumerSpec,
    StateDictSource,
    TransferConfig,
    WeightSource,
    WeightTransferTask,
    stage_names,
)


class LlamaTransferTask(WeightTransferTask):
    """Producers hold a Llama (all of it, or a pipeline stage each with ``stages=True``);
    consumers are TP-``tp_size`` ranks of ``C / tp_size`` replicas and verify every sync.

    Task keywords: ``shapes`` (HF name -> (shape, dtype), see ``tiny_llama_shapes``: no
    transformers needed), ``model_config`` (LlamaConfig overrides; with ``hf_module=True``
    producers build the real ``LlamaForCausalLM``, which needs transformers), ``seed``,
    ``tp_size``, ``stages``, ``flat`` (producers keep the weights in one flat buffer:
    ``allocate``), ``verify``.
    """

    def make_source(
        self,
        producer_idx: int,
        num_producers: int,
        shapes: Shapes | None = None,
        model_config: dict[str, Any] | None = None,
        hf_module: bool = False,
        seed: int = 0,
        stages: bool = False,
        flat: bool = False,
        **_: Any,
    ) -> WeightSource:
        state: torch.nn.Module | dict[str, torch.Tensor]
        if hf_module:
            state = build_llama(tiny_llama_config(**(model_config or {})), seed=seed)
            state.to(self.device)
            self._state = state.state_dict()
        else:
            state = self._state = allocate(shapes or {}, self.device, flat=flat)
        names = list(self._state)
        held = stage_names(names, num_producers, producer_idx) if stages else None
        return StateDictSource(state, held=held)

    def before_producer_sync(
        self, step: int, source: WeightSource, seed: int = 0, **_: Any
    ) -> None:
        fill_weights(self._state, seed, step)

    def make_consumer(
        self,
        consumer_idx: int,
        num_consumers: int,
        shapes: Shapes | None = None,
        model_config: dict[str, Any] | None = None,
        tp_size: int = 2,
        **_: Any,
    ) -> ConsumerSpec:
        if shapes is None:
            shapes = tiny_llama_shapes(**(model_config or {}))
        self._shapes = shapes
        params, routes = llama_tp_layout(shapes, consumer_idx % tp_size, tp_size, self.device)
        self._routes = routes
        return ConsumerSpec(params=params, route=lambda name: routes.get(name, []))

    def after_consumer_sync(
        self, step: int, spec: ConsumerSpec, seed: int = 0, verify: bool = True, **_: Any
    ) -> dict[str, Any]:
        if not verify:
            return {"verified": None}
        full = allocate(self._shapes)
        fill_weights(full, seed, step)
        want = expected_params(spec.params, self._routes, full)
        bad = [n for n, t in spec.params.items() if tensor_digest(t) != tensor_digest(want[n])]
        return {"verified": not bad, "mismatched": bad[:5], "params": len(spec.params)}


def allocate(
    shapes: Shapes, device: torch.device | str = "cpu", *, flat: bool = False
) -> dict[str, torch.Tensor]:
    """Zero tensors for ``shapes`` (HF name -> (shape, dtype)) on ``device``. ``flat``: views of
    one buffer, each at a 256-byte boundary, as a trainer that keeps its parameters in one flat
    buffer holds them (Megatron's parameter buffers, flat FSDP parameters); on the CPU it is in
    shared memory, as ``model.share_memory()`` puts a CPU trainer's weights, so that consumers
    on the node map it (``NixlOptions.shared_memory``) and read each weight in place."""
    if not flat:
        return {n: torch.zeros(s, dtype=d, device=device) for n, (s, d) in shapes.items()}
    starts, end = [], 0
    for shape, dtype in shapes.values():
        starts.append(end)
        end += -(-math.prod(shape) * dtype.itemsize // 256) * 256
    buffer = shared_empty(end, device).zero_()
    return {
        n: buffer[a : a + math.prod(s) * d.itemsize].view(d).view(s)
        for a, (n, (s, d)) in zip(starts, shapes.items(), strict=True)
    }


def run_demo(
    producers: int = 2,
    consumers: int = 2,
    *,
    syncs: int = 3,
    tp_size: int = 2,
    stages: bool = False,
    model_config: dict[str, Any] | None = None,
    config: TransferConfig | None = None,
    timeout: float = 300.0,
    communicator: str = "torch_distributed",
    launcher: Launcher | None = None,
    **launcher_kwargs: Any,
) -> dict[str, Any]:
    """Launch a demo fleet on this machine (CPU) and summarise it.

    ``communicator``: ``"torch_distributed"`` (the send/recv path) or ``"nixl_rdt"`` (one-sided
    READs of the trainer's weights in a shared-memory arena; from the second sync on, whole
    syncs are replayed). Returns ``{"producers",
    "consumers", "syncs", "bytes_per_sync", "seconds_per_sync", "replayed", "gb_per_s",
    "setup_seconds", "verified", "path"}``; bytes are what consumers received. ``launcher``:
    one of ``producers + consumers`` workers to run it on (default: an ``MPLauncher``).
    """
    from vllm_dist import CommunicatorType, CoordinatorType, MPLauncher

    if consumers % tp_size:
        raise ValueError(f"consumers={consumers} must be a multiple of tp_size={tp_size}")
    comm = CommunicatorType(communicator)
    if config is None and comm == CommunicatorType.NIXL_RDT:  # a ring deep enough to replay
        config = TransferConfig(workers_per_replica=tp_size, ring_slots=64, direct_bytes=4096)
    config = config or TransferConfig(workers_per_replica=tp_size)
    if launcher is None:
        launcher = MPLauncher(producers + consumers, timeout=timeout, **launcher_kwargs)
    elif launcher.n_tasks != producers + consumers:
        raise ValueError(
            f"the launcher starts {launcher.n_tasks} workers but the fleet has "
            f"{producers} producers + {consumers} consumers"
        )
    start = time.perf_counter()
    results = launcher.launch(
        task_type=LlamaTransferTask,
        coordinator_type=CoordinatorType.TORCH_DISTRIBUTED,
        communicator_type=comm,
        device="cpu",
        num_producers=producers,
        num_consumers=consumers,
        syncs=syncs,
        config=config,
        tp_size=tp_size,
        stages=stages,
        shapes=tiny_llama_shapes(**(model_config or {})),
    )
    return summarize(results, wall_seconds=time.perf_counter() - start)


def summarize(results: list[dict[str, Any]], wall_seconds: float = 0.0) -> dict[str, Any]:
    """Fold per-rank results of a ``WeightTransferTask`` launch into one summary."""
    cons = [r for r in results if r["role"] == "consumer"]
    prods = [r for r in results if r["role"] == "producer"]
    syncs = len(cons[0]["syncs"]) if cons else 0
    per_sync = [max(r["syncs"][s]["seconds"] for r in results) for s in range(syncs)]
    moved = sum(r["syncs"][0]["bytes"] for r in cons) if syncs else 0
    best = min(per_sync) if per_sync else 0.0
    verified = all(o.get("verified") is not False for r in cons for o in r["outputs"] if o)
    return {
        "producers": len(prods),
        "consumers": len(cons),
        "syncs": syncs,
        "bytes_per_sync": moved,
        "seconds_per_sync": per_sync,
        "replayed": [all(r["syncs"][s].get("replayed") for r in results) for s in range(syncs)],
        "gb_per_s": moved / best / 1e9 if best else 0.0,
        "setup_seconds": max(r["setup_seconds"] for r in results),
        "verified": verified,
        "path": cons[0]["syncs"][0]["path"] if syncs else None,
        "wall_seconds": wall_seconds,
    }
