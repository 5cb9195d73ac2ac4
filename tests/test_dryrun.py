"""The weight-transfer dry run: its plan is the engine's plan, its numbers add up, and its link
model behaves. Small fleets only; no timing is asserted."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.utils import distributed_test
from vllm_dist import CommunicatorType, CoordinatorType, MPLauncher
from vllm_dist.tasks.weight_transfer import (
    ConsumerSpec,
    StateDictSource,
    TransferConfig,
    WeightSource,
    WeightTransferTask,
)
from vllm_dist.tasks.weight_transfer.dryrun import (
    PRESETS,
    FleetSpec,
    ProducerLayout,
    consumer_layout,
    dry_run,
    model_bytes,
    model_metas,
    plan_fleet,
    predict,
    producer_facts,
)
from vllm_dist.tasks.weight_transfer.dryrun.models import DEEPSEEK_V3, LLAMA3_8B, QWEN3_235B_A22B
from vllm_dist.tasks.weight_transfer.ops import replay
from vllm_dist.tasks.weight_transfer.plan import build_chunks
from vllm_dist.tasks.weight_transfer.router import ENGINE_BALANCE, RdtRouter
from vllm_dist.tasks.weight_transfer.source import dtype_from_str

# DeepSeek-V3 in miniature: MLA names, a dense first layer, 8 routed experts, a shared expert
TINY_DSV3: dict[str, Any] = {
    **DEEPSEEK_V3,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "q_lora_rank": 48,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "vocab_size": 256,
}
TINY_QWEN3: dict[str, Any] = {
    **QWEN3_235B_A22B,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "num_experts": 4,
    "vocab_size": 128,
}


def _layout_of(metas: Any, tp: int, ep: bool, head_dim: int = 128) -> Any:
    return lambda w: consumer_layout(metas, tp, w, expert_parallel=ep, head_dim=head_dim)


def test_real_configs_give_the_published_parameter_counts() -> None:
    assert model_bytes(model_metas(LLAMA3_8B)) // 2 == 8_030_261_248
    assert round(model_bytes(model_metas(QWEN3_235B_A22B)) / 2e9) == 235
    names = [m.name for m in model_metas(DEEPSEEK_V3)]
    assert "model.layers.3.mlp.experts.255.down_proj.weight" in names
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in names


@pytest.mark.parametrize("ep", [True, False], ids=["ep", "tp_experts"])
def test_loaders_copy_the_right_slices(ep: bool) -> None:
    """The consumer loaders, replayed on real tensors, fill every parameter exactly once."""
    metas = model_metas(TINY_DSV3)
    full = {m.name: torch.randn(m.shape).to(dtype_from_str(m.dtype)) for m in metas}
    from vllm_dist.tasks.weight_transfer.ops import bake

    for w in range(2):
        params, routes = consumer_layout(metas, 2, w, expert_parallel=ep, device="cpu")
        covered = {n: torch.zeros(p.shape, dtype=torch.int32) for n, p in params.items()}
        for m in metas:
            for pname, loader in routes[m.name]:
                for c in bake(loader, m.shape, m.torch_dtype, params[pname]):
                    replay(params[pname], c.dest_chain).copy_(replay(full[m.name], c.src_chain))
                    replay(covered[pname], c.dest_chain).add_(1)
        for n, cov in covered.items():
            assert cov.eq(1).all(), n
        q = full["model.layers.0.self_attn.q_b_proj.weight"]
        assert torch.equal(params["model.layers.0.self_attn.q_b_proj.weight"], q.chunk(2)[w])


@pytest.mark.parametrize("kind", ["whole", "fsdp", "megatron"])
def test_plan_is_the_engines_plan_and_bytes_add_up(kind: str) -> None:
    metas = model_metas(TINY_DSV3)
    layout = ProducerLayout(kind=kind, tp=1, pp=2, ep=2)
    facts = producer_facts(metas, layout, 4)
    run = dry_run(metas, facts, 4, 2, _layout_of(metas, 2, True), measure_memory=True)
    from vllm_dist.tasks.weight_transfer.index import build_index

    index = build_index(facts, 4, 2, balance=ENGINE_BALANCE)
    config = TransferConfig(workers_per_replica=2)
    for cid in range(4):
        consumer_requests = _requests(metas, cid % 2)
        # the plan module's own entry point, called directly, gives the same chunks
        direct = build_chunks(cid, consumer_requests, index.router, config.layout())
        assert [(c.producer, c.group, c.nbytes, c.items) for c in direct] == [
            (c.producer, c.group, c.nbytes, c.items) for c in run.chunks[cid]
        ]
        need = sum(r.nbytes for r in consumer_requests)
        mine = [p for p in run.pairs if p.consumer == cid]
        assert sum(p.payload for p in mine) == need  # what the consumer needs, exactly
        assert all(p.nbytes >= p.payload for p in mine)  # plus alignment padding
    assert run.producer_load().sum() == sum(p.nbytes for p in run.pairs)
    assert run.balance() >= 1.0
    assert run.consumers[0].peak_bytes and run.index_peak_bytes


def _requests(metas: Any, worker: int) -> list[Any]:
    """The requests a consumer derives, from bake() and ShapeCache directly."""
    from vllm_dist.tasks.weight_transfer.groups import layerwise_groups
    from vllm_dist.tasks.weight_transfer.ops import bake, loader_key
    from vllm_dist.tasks.weight_transfer.plan import Request
    from vllm_dist.tasks.weight_transfer.setup import ShapeCache

    params, routes = consumer_layout(metas, 2, worker, expert_parallel=True)
    by_name = {m.name: m for m in metas}
    shapes = ShapeCache()
    out = []
    baked: dict[Any, Any] = {}  # loaders that bake alike share their copies, as the engine's
    for name in [n for g in layerwise_groups([m.name for m in metas]) for n in g]:
        m = by_name[name]
        for pname, loader in routes[name]:
            key = (m.shape, m.dtype, params[pname].shape, loader_key(loader))
            if key not in baked:
                baked[key] = bake(loader, m.shape, m.torch_dtype, params[pname])
            for c in baked[key]:
                wire = shapes(m.shape, m.torch_dtype, c.src_chain)[1]
                out.append(Request(name, c.src_chain, c.shape, m.dtype, wire))
    return out


def test_one_replica_stands_for_every_replica() -> None:
    metas = model_metas(TINY_QWEN3)
    facts = producer_facts(metas, ProducerLayout(kind="megatron", tp=2, pp=2), 8)
    layout_of = _layout_of(metas, 2, True, head_dim=16)
    full = dry_run(metas, facts, 6, 2, layout_of)
    sampled = dry_run(metas, facts, 6, 2, layout_of, sample=2)
    shared = dry_run(metas, facts, 6, 2, layout_of, wire=False)  # facts not through pickle
    assert shared.pairs == full.pairs
    assert sampled.scale() == 3 and full.scale() == 1
    assert (full.producer_load() == sampled.producer_load()).all()
    assert sampled.schedule(1) == full.schedule(5)


def test_prediction_falls_with_bandwidth_and_stays_above_the_bound() -> None:
    spec = FleetSpec(
        name="tiny",
        model="llama3-8b",
        producers=4,
        consumers=4,
        replica_tp=2,
        expert_parallel=False,
    )
    report, run = plan_fleet(spec, measure_memory=False)
    assert report["consumer_bytes_sum"] == sum(p.payload for p in run.pairs)
    assert report["predicted_over_bound"] >= 1.0
    for preset in ("h100_rdma", "h100_one_gpu", "cpu_shm"):
        times = [predict(run, PRESETS[preset].with_bandwidth(f)).predicted_s for f in (0.5, 1, 4)]
        assert times[0] > times[1] > times[2]


class DryRunCheckTask(WeightTransferTask):
    """A real launch of a tiny DeepSeek-style fleet laid out as the dry run lays it out."""

    def make_source(self, producer_idx: int, num_producers: int, **kw: Any) -> WeightSource:
        metas = model_metas(TINY_DSV3)
        facts = producer_facts(metas, ProducerLayout(kind="megatron", pp=2), num_producers)
        state = {m.name: torch.randn(m.shape).to(m.torch_dtype) for m in metas}
        return StateDictSource(state, held=facts[producer_idx].held)

    def make_consumer(self, consumer_idx: int, num_consumers: int, **kw: Any) -> ConsumerSpec:
        params, routes = consumer_layout(
            model_metas(TINY_DSV3), 2, consumer_idx % 2, expert_parallel=True, device="cpu"
        )
        return ConsumerSpec(params=params, route=lambda n: routes.get(n, ()))


@distributed_test(timeout=120)
def test_dry_run_plans_what_a_real_launch_moves() -> None:
    config = TransferConfig(workers_per_replica=2, direct_bytes=4096)
    results = MPLauncher(4, timeout=90).launch(
        task_type=DryRunCheckTask,
        coordinator_type=CoordinatorType.TORCH_DISTRIBUTED,
        communicator_type=CommunicatorType.TORCH_DISTRIBUTED,
        device="cpu",
        coordinator_options={"timeout": 60.0},
        num_producers=2,
        num_consumers=2,
        syncs=1,
        config=config,
    )
    metas = model_metas(TINY_DSV3)
    facts = producer_facts(metas, ProducerLayout(kind="megatron", pp=2), 2)
    run = dry_run(metas, facts, 2, 2, _layout_of(metas, 2, True), config=config)
    for r in results:
        if r["role"] == "consumer":
            cid = r["index"]
            assert r["syncs"][0]["chunks"] == len(run.chunks[cid])
            assert r["syncs"][0]["bytes"] == sum(c.nbytes for c in run.chunks[cid])


# -- the router's two rules ---------------------------------------------------------------------
def _expert_router(balance: str) -> RdtRouter:
    """8 producers: 2 expert shards x 4 owners each; replicas of 8 workers, 2 replicas."""
    names = [f"layers.{g}.experts.{e}.w" for g in range(6) for e in range(4)]
    return RdtRouter(
        8,
        16,
        owner_sets=[[0, 1, 2, 3], [4, 5, 6, 7]],
        name_owner_class=[int(n.split(".")[3] >= "2") for n in names],
        names=names,
        group_lens=[4] * 6,
        workers_per_replica=8,
        balance=balance,
    )


@pytest.mark.parametrize("balance", ["block", "rotate"])
def test_both_rules_keep_groups_whole_and_replicas_alike(balance: str) -> None:
    r = _expert_router(balance)
    r.validate()
    for c in range(16):
        for names in r.group_names:
            for k in (0, 1):
                of_class = [n for n in names if r.class_of(n) == k]
                got = {r.producer_for(c, n) for n in of_class}
                assert len(got) == 1 and got <= set(r.owner_sets[k])  # one owner per group
                assert got == {r.producer_for(c % 8, n) for n in of_class}  # every replica alike


def test_block_rule_is_the_default_and_rotate_spreads_neighbours() -> None:
    block, rotate = _expert_router("block"), _expert_router("rotate")
    assert RdtRouter(2, 2).balance == "block"
    name = "layers.0.experts.0.w"
    # DESIGN's rule: owners[block[g % len(block)]], block = assign_producer_indices(4, 8, w)
    assert [block.producer_for(w, name) for w in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [rotate.producer_for(w, name) for w in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    # the next group turns by the workers likely to need the class: 8 workers over 2 disjoint
    # classes of 4 owners, so 4 (a full turn here: workers 0-3 tile the owners already)
    later = "layers.1.experts.0.w"
    assert [rotate.producer_for(w, later) for w in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    one = RdtRouter(3, 4, names=["layers.0.a", "layers.1.a"], group_lens=[1, 1], balance="rotate")
    assert [[one.producer_for(w, n) for w in range(4)] for n in one.names] == [
        [0, 1, 2, 0],
        [1, 2, 0, 1],  # a lone class: all 4 workers need it, so a turn of 4 = 1 mod 3
    ]
    assert block.fingerprint() != rotate.fingerprint()  # a mixed fleet fails at set-up
    # owners at least as many as workers: each worker's groups, by bytes, cut into equal pieces
    names = [f"layers.{g}.a" for g in range(6)]

    def wide(n: int, b: int, balance: str) -> list[list[int]]:
        r = RdtRouter(n, b, names=names, group_lens=[1] * 6, balance=balance, name_bytes=[9] * 6)
        return [[r.producer_for(w, x) for x in names] for w in range(b)]

    assert wide(4, 2, "rotate") == [[0, 0, 0, 1, 1, 1], [2, 2, 2, 3, 3, 3]]  # block's owners
    assert wide(4, 2, "block") == [[0, 1, 0, 1, 0, 1], [2, 3, 2, 3, 2, 3]]
    loads = [sum(row.count(p) for row in wide(3, 2, "rotate")) for p in range(3)]
    assert loads == [4, 4, 4]  # where the block rule gives blocks of 1 and 2 producers
    with pytest.raises(ValueError, match="balance='even'"):
        RdtRouter(2, 2, balance="even")


def test_rotating_rule_balances_expert_parallel_consumers() -> None:
    """Megatron producers (2 expert shards x TP 2) into TP-4 expert-parallel replicas: the
    block rule sends neighbours to one owner, the engine's rule keeps max / mean load within
    1.1 (one stage: a stage's bytes can only come from its own producers)."""
    metas = model_metas({**TINY_DSV3, "num_hidden_layers": 9})
    facts = producer_facts(metas, ProducerLayout(kind="megatron", tp=2, ep=2), 4)
    layout_of = _layout_of(metas, 4, True)
    block = dry_run(metas, facts, 8, 4, layout_of, balance="block")
    rotate = dry_run(metas, facts, 8, 4, layout_of)  # the engine's rule
    assert block.balance() > 1.3
    assert rotate.balance() <= 1.1
    assert sum(p.payload for p in block.pairs) == sum(p.payload for p in rotate.pairs)


@pytest.mark.parametrize("kind", ["whole", "megatron"])
def test_a_rank_receives_the_model_once(kind: str) -> None:
    """What all_gather_object hands each rank: one copy of the metadata (producer 0's) and a
    digest plus held weights from every other producer, not P copies of the model."""
    import pickle

    metas = model_metas(TINY_DSV3)
    layout = ProducerLayout(kind=kind, tp=2, pp=2, ep=2)
    facts = producer_facts(metas, layout, 16)
    sizes = [len(pickle.dumps(f)) for f in facts]
    assert facts[0].ships_metadata and not any(f.ships_metadata for f in facts[1:])
    if kind == "whole":
        assert max(sizes[1:]) < 200  # a digest, whatever the model's size
    else:  # each holds a quarter of the model; compressed
        assert max(sizes[1:]) < sizes[0] / 4
    gathered = [pickle.loads(pickle.dumps(f)) for f in facts]
    run = dry_run(metas, facts, 4, 2, _layout_of(metas, 2, True))
    assert gathered[1].metadata is None and run.gather_bytes is None
    assert run.pairs == dry_run(metas, facts, 4, 2, _layout_of(metas, 2, True), wire=False).pairs
