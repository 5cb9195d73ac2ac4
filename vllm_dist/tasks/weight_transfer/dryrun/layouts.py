"""Simulated ranks' layouts: what each producer holds and how each consumer loads.

Producers: ``whole`` (every producer holds every weight), ``fsdp`` (every producer a flat slice
of every weight; the source all-gathers a layer before serving it, so to the planner it holds
every name, and the gather is the trainer's cost) and ``megatron`` (TP x PP x EP x DP: a rank
holds its pipeline stage's weights and its expert shard's experts; TP ranks gather their slices
into whole weights, so they hold the same names).

Consumers: one worker of a TP (x EP) inference replica with vLLM-style parameters on the meta
device and loaders written as vLLM writes them (fused QKV and gate-up, row-parallel o/down,
vocab-parallel embeddings, MLA's fused replicated ``fused_qkv_a_proj``, FusedMoE ``w13_weight`` /
``w2_weight`` with expert parallelism). Loaders close over ints only, so ``loader_key`` lets
the engine bake each kind once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vllm_dist.tasks.weight_transfer.groups import layerwise_groups
from vllm_dist.tasks.weight_transfer.index import ProducerFacts
from vllm_dist.tasks.weight_transfer.ops import Loader
from vllm_dist.tasks.weight_transfer.source import WeightMeta, dtype_from_str


@dataclass(frozen=True, kw_only=True, slots=True)
class ProducerLayout:
    """How the trainer shards the model over ``producers`` ranks."""

    kind: str = "whole"  # "whole", "fsdp" or "megatron"
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        if self.kind not in ("whole", "fsdp", "megatron"):
            raise ValueError(f"producer layout {self.kind!r}: use whole, fsdp or megatron")


def expert_of(name: str) -> int | None:
    """The routed expert index in ``...mlp.experts.<e>...``, or None."""
    _, found, rest = name.partition(".experts.")
    if not found:
        return None
    head = rest.partition(".")[0]
    return int(head) if head.isdigit() else None


def producer_facts(
    metas: Sequence[WeightMeta], layout: ProducerLayout, producers: int
) -> list[ProducerFacts]:
    """Every producer's (metadata, held names) under ``layout``; one metadata tuple shared, and
    shipped by producer 0 only, as the engine's producers ship it."""
    meta = tuple(metas)
    if layout.kind != "megatron":
        return [
            ProducerFacts(metadata=meta, held=None, ships_metadata=r == 0) for r in range(producers)
        ]
    tp, pp, ep = layout.tp, layout.pp, layout.ep
    if producers % (tp * pp * ep):
        raise ValueError(f"{producers} producers are not a multiple of tp*pp*ep={tp * pp * ep}")
    names = [m.name for m in metas]
    groups = layerwise_groups(names)
    experts = 1 + max((e for n in names if (e := expert_of(n)) is not None), default=0)
    held: dict[tuple[int, int], frozenset[str]] = {}
    for s in range(pp):
        lo, hi = s * len(groups) // pp, (s + 1) * len(groups) // pp
        stage = [n for g in groups[lo:hi] for n in g]
        for e in range(ep):
            shard = range(e * experts // ep, (e + 1) * experts // ep)
            held[(s, e)] = frozenset(n for n in stage if (x := expert_of(n)) is None or x in shard)
    out = []
    for r in range(producers):  # rank = ((dp * pp + stage) * ep + expert shard) * tp + tp rank
        e = (r // tp) % ep
        s = (r // (tp * ep)) % pp
        out.append(ProducerFacts(metadata=meta, held=held[(s, e)], ships_metadata=r == 0))
    return out


# -- loaders (closures over ints: ``loader_key`` bakes each kind once) ---------------------------
def replicated() -> Loader:
    def load(dest: Any, src: Any) -> None:
        dest.copy_(src)

    return load


def shard(dim: int, start: int, n: int) -> Loader:
    """Rows (dim 0: column / vocab parallel) or columns (dim 1: row parallel) [start, start+n)."""

    def load(dest: Any, src: Any) -> None:
        dest.copy_(src.narrow(dim, start, n))

    return load


def fused(offset: int, start: int, n: int) -> Loader:
    """Source rows [start, start+n) into destination rows [offset, offset+n) (fused QKV,
    gate-up, MLA's fused_qkv_a_proj, a padded vocab shard)."""

    def load(dest: Any, src: Any) -> None:
        dest.narrow(0, offset, n).copy_(src.narrow(0, start, n))

    return load


def expert_w13(local: int, offset: int, start: int, n: int) -> Loader:
    """FusedMoE ``w13_weight[local]`` rows [offset, offset+n) from gate or up rows [start, +n)."""

    def load(dest: Any, src: Any) -> None:
        dest[local].narrow(0, offset, n).copy_(src.narrow(0, start, n))

    return load


def expert_w2(local: int, start: int, n: int) -> Loader:
    """FusedMoE ``w2_weight[local]`` from down_proj columns [start, start+n)."""

    def load(dest: Any, src: Any) -> None:
        dest[local].copy_(src.narrow(1, start, n))

    return load


Routes = dict[str, list[tuple[str, Loader]]]


def consumer_layout(
    metas: Sequence[WeightMeta],
    tp: int,
    rank: int,
    *,
    expert_parallel: bool = False,
    head_dim: int = 128,
    device: str = "meta",
) -> tuple[dict[str, torch.Tensor], Routes]:
    """Meta-device parameters and routes of worker ``rank`` of a ``tp``-wide replica.

    With ``expert_parallel`` the routed experts are split whole over the replica's workers
    (vLLM's EP: expert e lives on worker ``e * tp // E``); else every worker holds a TP slice
    of every expert. Attention, dense and shared-expert MLPs are tensor parallel either way.
    ``device="cpu"`` gives real parameters (a small fleet's real launch).
    """
    by_name = {m.name: m for m in metas}
    params: dict[str, torch.Tensor] = {}
    routes: Routes = {}
    experts = 1 + max((e for m in metas if (e := expert_of(m.name)) is not None), default=-1)

    def param(name: str, shape: tuple[int, ...], dtype: str) -> str:
        if name not in params:
            params[name] = torch.zeros(shape, dtype=dtype_from_str(dtype), device=device)
        return name

    def part(rows: int) -> tuple[int, int]:
        n = -(-rows // tp)
        return rank * n, n

    for m in metas:
        name, shape, dt = m.name, m.shape, m.dtype
        prefix, _, leaf = name.rpartition(".")
        parent, _, module = prefix.rpartition(".")
        e = expert_of(name)
        route: list[tuple[str, Loader]]
        if e is not None:
            route = _expert_route(
                param, parent, module, shape, dt, e, experts, tp, rank, expert_parallel
            )
        elif module in ("q_proj", "k_proj", "v_proj"):
            q, k, v = (
                by_name[f"{parent}.{x}.{leaf}"].shape[0] for x in ("q_proj", "k_proj", "v_proj")
            )
            kv_heads = k // head_dim
            kv_rows = k // tp if kv_heads >= tp else head_dim  # else KV heads are replicated
            kv_start = rank * kv_rows if kv_heads >= tp else rank * kv_heads // tp * head_dim
            fused_name = param(f"{parent}.qkv_proj.{leaf}", (q // tp + 2 * kv_rows, shape[1]), dt)
            if module == "q_proj":
                route = [(fused_name, fused(0, rank * (q // tp), q // tp))]
            else:
                offset = q // tp + (0 if module == "k_proj" else kv_rows)
                route = [(fused_name, fused(offset, kv_start, kv_rows))]
        elif module in ("q_a_proj", "kv_a_proj_with_mqa"):
            qa = by_name[f"{parent}.q_a_proj.{leaf}"].shape[0]
            kva = by_name[f"{parent}.kv_a_proj_with_mqa.{leaf}"].shape[0]
            fused_name = param(f"{parent}.fused_qkv_a_proj.{leaf}", (qa + kva, shape[1]), dt)
            route = [(fused_name, fused(0 if module == "q_a_proj" else qa, 0, shape[0]))]
        elif module in ("gate_proj", "up_proj"):
            start, n = part(shape[0])
            fused_name = param(f"{parent}.gate_up_proj.{leaf}", (2 * n, shape[1]), dt)
            route = [(fused_name, fused(0 if module == "gate_proj" else n, start, n))]
        elif module in ("o_proj", "down_proj"):
            start, n = part(shape[1])
            route = [(param(name, (shape[0], n), dt), shard(1, start, n))]
        elif module in ("q_b_proj", "kv_b_proj"):
            start, n = part(shape[0])
            route = [(param(name, (n, shape[1]), dt), shard(0, start, n))]
        elif module in ("embed_tokens", "lm_head"):  # vocab parallel, the last shard padded
            start, n = part(shape[0])
            m_rows = max(0, min(n, shape[0] - start))
            route = [(param(name, (n, shape[1]), dt), fused(0, start, m_rows))] if m_rows else []
        else:  # norms, the MoE router
            route = [(param(name, shape, dt), replicated())]
        routes[name] = route
    return params, routes


def _expert_route(
    param: Callable[[str, tuple[int, ...], str], str],
    parent: str,
    module: str,
    shape: tuple[int, ...],
    dtype: str,
    e: int,
    experts: int,
    tp: int,
    rank: int,
    expert_parallel: bool,
) -> list[tuple[str, Loader]]:
    """FusedMoE: expert ``e``'s gate / up / down into the layer's ``w13_weight`` / ``w2_weight``."""
    layer = parent.rsplit(".experts.", 1)[0]
    if expert_parallel:
        lo, hi = rank * experts // tp, (rank + 1) * experts // tp
        if not lo <= e < hi:
            return []
        local, count, start, n = e - lo, hi - lo, 0, shape[0] if module != "down_proj" else shape[1]
    else:
        local, count = e, experts
        rows = shape[0] if module != "down_proj" else shape[1]
        n = rows // tp
        start = rank * n
    if module == "down_proj":
        w2 = param(f"{layer}.experts.w2_weight", (count, shape[0], n), dtype)
        return [(w2, expert_w2(local, start, n))]
    w13 = param(f"{layer}.experts.w13_weight", (count, 2 * n, shape[1]), dtype)
    return [(w13, expert_w13(local, 0 if module == "gate_proj" else n, start, n))]
