"""Weight transfer: pure unit tests of router / bake / plan, then real multi-process syncs.

Multi-process tests launch CPU fleets (torch.distributed coordinator and communicator) of a
tiny Llama's real parameter names and shapes, loaded by TP-2 consumers the way an inference
engine would, and compare a hash of every consumer parameter with the slice its loader takes
from the full model, over several syncs with changing weights.
"""

from __future__ import annotations

import dataclasses
import pickle
import re
import threading
import time
from dataclasses import replace
from typing import Any

import pytest
import torch

from tests.utils import cuda_device_count, distributed_test, nccl_env
from vllm_dist import (
    CommunicatorType,
    CoordinatorType,
    GlobalCoordinatorDistributedTask,
    LaunchError,
    MPLauncher,
    register_communicator,
)
from vllm_dist.examples.llama_tp import (
    column_parallel,
    expected_params,
    fill_weights,
    fused_shard,
    llama_shapes,
    llama_tp_layout,
    row_parallel,
    tensor_digest,
    tiny_llama_config,
    transposed_row_parallel,
)
from vllm_dist.examples.weight_sync_demo import LlamaTransferTask, allocate, summarize
from vllm_dist.implementations.communicators.common import shared_gpu_nccl_env
from vllm_dist.implementations.communicators.nixl_rdt import NixlRdtCommunicator
from vllm_dist.implementations.launchers.common import find_free_port
from vllm_dist.tasks.weight_transfer import (
    ALLOWED_OPS,
    RDT_MIN_RAY_VERSION,
    BakeError,
    Fleet,
    FreeBarrier,
    JoinSpec,
    LayoutConfig,
    PlanMismatchError,
    ProducerFacts,
    RdtRouter,
    Request,
    ServeRing,
    StateDictSource,
    TransferConfig,
    TransferStallError,
    UnsafeOpError,
    WeightConsumer,
    WeightMeta,
    WeightProducer,
    WeightTransferSetupError,
    assign_producer_indices,
    bake,
    buffer_alloc_bytes,
    build_chunks,
    build_index,
    check_ray_rdt_version,
    layerwise_groups,
    pair_digest,
    replay,
)
from vllm_dist.tasks.weight_transfer.ops import loader_key
from vllm_dist.tasks.weight_transfer.paths.push import ConsumerPush
from vllm_dist.tasks.weight_transfer.paths.read_consumer import ConsumerRead
from vllm_dist.tasks.weight_transfer.plan import decode_requests, encode_requests, plan_digest
from vllm_dist.tasks.weight_transfer.setup import ShapeCache
from vllm_dist.tasks.weight_transfer.views import ViewCache, slot_views

MiB = 1 << 20


@pytest.fixture(scope="module")
def shapes() -> dict[str, Any]:
    return llama_shapes(tiny_llama_config())


# -- groups and router ---------------------------------------------------------------------------
def test_layerwise_groups() -> None:
    names = [
        "embed.weight",
        "layers.1.a",
        "layers.0.b",
        "layers.10.experts.3.w",
        "layers.1.experts.7.w",
        "norm.weight",
        "lm_head.weight",
    ]
    assert layerwise_groups(names) == [
        ["embed.weight"],
        ["layers.0.b"],
        ["layers.1.a", "layers.1.experts.7.w"],
        ["layers.10.experts.3.w"],
        ["norm.weight", "lm_head.weight"],
    ]
    assert layerwise_groups([]) == []


def test_assign_producer_indices_block_rule() -> None:
    assert assign_producer_indices(4, 2, 0) == [0, 1]
    assert assign_producer_indices(4, 2, 1) == [2, 3]
    assert assign_producer_indices(2, 4, 3) == [1]
    assert assign_producer_indices(3, 2, 1) == [1, 2]
    assert assign_producer_indices(0, 0, 0) == [0]
    for p in range(1, 6):
        for c in range(1, 6):
            got = [assign_producer_indices(p, c, i) for i in range(c)]
            assert all(got), (p, c)
            if p >= c:
                assert sorted(x for b in got for x in b) == list(range(p))


def test_router_routes_groups_over_block_and_replicas() -> None:
    names = ["e", "layers.0.a", "layers.0.b", "layers.1.a", "layers.1.b", "n"]
    r = RdtRouter(4, 4, names=names, group_lens=[1, 2, 2, 1], workers_per_replica=2)
    r.validate()
    # worker 0 of each replica binds producers [0, 1] and spreads groups over them
    for c in (0, 2):
        assert [r.producer_for(c, n) for n in names] == [0, 1, 1, 0, 0, 1]
    for c in (1, 3):
        assert [r.producer_for(c, n) for n in names] == [2, 3, 3, 2, 2, 3]
    assert r.group_owners(1) == [0, 1, 2, 3]
    assert RdtRouter(2, 1).group_owners(0) == [0, 1]


def test_router_owner_classes() -> None:
    names = ["layers.0.x", "layers.0.y", "layers.1.x"]
    r = RdtRouter(
        3,
        2,
        owner_sets=[[1, 0, 1], [2]],
        name_owner_class=[0, 1],  # layers.1.x is missing: class 0
        names=names,
        group_lens=[2, 1],
    )
    r.validate()
    assert r.owner_sets == [[0, 1], [2]]
    assert r.owners("layers.0.y") == [2]
    assert r.class_of("layers.1.x") == 0
    assert r.group_owners(0) == [0, 1, 2]
    assert r.producer_for(0, "layers.0.x") == 0
    assert r.producer_for(1, "layers.0.x") == 1
    assert r.producer_for(1, "layers.0.y") == 2


def test_router_validation_errors() -> None:
    with pytest.raises(ValueError, match="must divide"):
        RdtRouter(2, 4, workers_per_replica=3)
    with pytest.raises(ValueError, match="must divide"):
        RdtRouter(2, 4, workers_per_replica=8)
    with pytest.raises(ValueError, match="is empty"):
        RdtRouter(2, 2, owner_sets=[[]]).validate()
    with pytest.raises(ValueError, match="outside"):
        RdtRouter(2, 2, owner_sets=[[0, 5]]).validate()
    with pytest.raises(ValueError, match="owner class 3"):
        RdtRouter(2, 2, names=["a"], name_owner_class=[3]).validate()
    with pytest.raises(ValueError, match="cut"):
        RdtRouter(2, 2, names=["a", "b"], group_lens=[1])


def test_router_send_side() -> None:
    r = RdtRouter(2, 2, names=["layers.0.a", "layers.1.a"], group_lens=[1, 1])
    with pytest.raises(RuntimeError, match="bind"):
        r.pull(0, ["x"], 0)
    with pytest.raises(RuntimeError, match="bind"):
        r.free_group(0)
    with pytest.raises(RuntimeError, match="bind"):
        r.reserve_serve_buffers({0: 10})
    with pytest.raises(ValueError, match="2 actors but 1"):
        r.bind(["a", "b"], [print], 0)
    calls: list[tuple[Any, ...]] = []
    methods = [lambda *a, p=p: calls.append((p, *a)) for p in range(2)]
    r.bind(["a", "b"], methods, 1)
    r.pull(1, ["k"], 3)
    r.free_group(1)
    r.reserve_serve_buffers({1: 64, 0: 32}, {0: "d0"})
    assert calls == [
        (1, "pull", 1, ["k"], 3),
        (0, "free", 1, 1),
        (1, "free", 1, 1),
        (0, "reserve", 1, 32, "d0"),
        (1, "reserve", 1, 64, None),
    ]


# -- bake and replay -----------------------------------------------------------------------------
def _bake_and_check(loader: Any, src: torch.Tensor, dest_shape: tuple[int, ...]) -> None:
    dest = torch.zeros(dest_shape, dtype=src.dtype)
    want = torch.zeros_like(dest)
    loader(want, src)  # the loader on real tensors
    for copy in bake(loader, src.shape, src.dtype, dest):
        replay(dest, copy.dest_chain).copy_(replay(src, copy.src_chain))
    assert torch.equal(dest, want)


def test_bake_records_tp_loaders() -> None:
    w = torch.randn(8, 6)
    _bake_and_check(column_parallel(1, 2), w, (4, 6))
    _bake_and_check(row_parallel(1, 2), w, (8, 3))
    _bake_and_check(transposed_row_parallel(0, 2), w, (3, 8))
    _bake_and_check(fused_shard(2, 1, 2), w, (12, 6))
    chain = bake(row_parallel(1, 2), (8, 6), torch.float32, torch.zeros(8, 3))[0].src_chain
    assert chain == (("chunk", (2, 1)), ("__getitem__", (1,)))


def test_bake_torch_functions_and_kwargs() -> None:
    def loader(dest: Any, src: Any) -> None:
        dest.copy_(torch.narrow(src, dim=0, start=2, length=2).flatten(start_dim=0))

    _bake_and_check(loader, torch.randn(4, 3), (6,))


@pytest.mark.parametrize(
    "body, match",
    [
        (lambda d, s: d.copy_(s.to(torch.float16)), r"\.to"),
        (lambda d, s: d.copy_(s * 2), "arithmetic"),
        (lambda d, s: d.copy_(s[s.sum()]), r"\.sum"),
        (lambda d, s: s.item(), r"\.item"),
        (lambda d, s: d.copy_(torch.cat([s, s])), "torch.cat"),
        (lambda d, s: s.__setitem__(0, 1.0), "assigned into the source"),
        (lambda d, s: d.copy_(s.narrow(0, 0, 3)), "shapes must match"),
        (lambda d, s: d.copy_(s.narrow(0, 5, 4)), "failed on fake tensors"),
        (lambda d, s: d.fill_(0), r"\.fill_"),
    ],
)
def test_bake_refuses_non_views(body: Any, match: str) -> None:
    with pytest.raises(BakeError, match=match):
        bake(body, (8, 4), torch.float32, torch.zeros(4, 4), "w")


@pytest.mark.parametrize(
    "chain, match",
    [
        ((("to", (torch.float16,)),), "'to' is not allowed"),
        ((("__setitem__", (0, 1.0)),), "not allowed"),
        ((("add_", (1,)),), "not allowed"),
        ((("narrow", (0, 0, torch.tensor(1))),), "not plain data"),
        ((("view", ("float16",)),), "not plain data"),
        ((("chunk", (2,)),), "ends in tuple"),
        (["narrow"], "must be a tuple"),
    ],
)
def test_replay_refuses_unsafe_chains(chain: Any, match: str) -> None:
    with pytest.raises(UnsafeOpError, match=match):
        replay(torch.zeros(4, 4), chain)
    assert "to" not in ALLOWED_OPS


# -- plan, rings, misc ---------------------------------------------------------------------------
def test_plan_layout_is_aligned_and_split() -> None:
    names = ["layers.0.a", "layers.0.b", "layers.0.c", "layers.1.a"]
    router = RdtRouter(2, 1, names=names, group_lens=[3, 1])
    reqs = [Request(n, (), (100,), "torch.bfloat16") for n in names]  # 200 B each
    layout = LayoutConfig(align=256, max_chunk_bytes=512)
    chunks = build_chunks(0, reqs, router, layout)
    assert [(c.producer, c.group, c.seq, c.items, c.offsets, c.nbytes) for c in chunks] == [
        (0, 0, 0, (0, 1), (0, 256), 456),
        (0, 0, 1, (2,), (0,), 200),
        (1, 1, 0, (3,), (0,), 200),
    ]
    big = [Request(n, (), (1 << 20,), "torch.bfloat16") for n in names[:3]]  # 2 MiB: alone
    assert [c.items for c in build_chunks(0, big + reqs[:1], router, LayoutConfig())] == [
        (0,),
        (1,),
        (2,),
        (3,),
    ]
    mine = build_chunks(0, [reqs[3]], router, layout, producer=1)
    d_consumer = pair_digest(0, 1, reqs, chunks, router, layout)
    assert pair_digest(0, 1, [reqs[3]], mine, router, layout) == d_consumer
    other = LayoutConfig(align=512, max_chunk_bytes=512)
    assert pair_digest(0, 1, reqs, chunks, router, other) != d_consumer


def test_bake_once_per_loader_kind_and_shapes() -> None:
    """100,000 experts loaded by closures of one code object bake a handful of times."""

    def make(tp_rank: int) -> Any:
        def load(dest: Any, src: Any) -> None:
            dest.copy_(src.narrow(0, tp_rank * 2, 2))

        return load

    assert loader_key(make(0)) == loader_key(make(0)) != loader_key(make(1))
    seen: list[Any] = []
    assert loader_key(lambda d, s: seen.append(s)) is None  # closes over an object: per name
    names = [f"layers.{i // 4}.experts.{i % 4}.w" for i in range(400)]
    params = {n: torch.zeros(2, 3) for n in names}
    engine = WeightConsumer.__new__(WeightConsumer)
    engine.params, engine.route = params, lambda n: [(n, make(1))]
    engine._shapes = ShapeCache()
    calls = []
    bake_one = engine._bake_one
    engine._bake_one = lambda *a: calls.append(1) or bake_one(*a)  # type: ignore[method-assign]
    index = build_index(
        [
            ProducerFacts(
                metadata=tuple(
                    WeightMeta(name=n, dtype="torch.float32", shape=(4, 3)) for n in names
                ),
                held=None,
            )
        ],
        1,
        0,
    )
    requests, dests = engine._bake(index)
    assert len(calls) == 1 and len(requests) == 400
    assert len({id(r.chain) for r in requests}) == 1  # shared: ViewCache keys on it
    assert requests[7].name == names[7] and dests[7][0] == names[7]


def test_plan_encoding_and_digest_agree_with_the_requests() -> None:
    names = ["layers.0.a", "layers.0.b", "layers.1.a", "layers.1.b"]
    router = RdtRouter(2, 1, names=names, group_lens=[2, 2])
    chain = (("narrow", (0, 0, 50)),)
    reqs = [Request(n, chain, (50,), "torch.bfloat16", (50,)) for n in names]
    layout = LayoutConfig(align=256, max_chunk_bytes=512)
    chunks = build_chunks(0, reqs, router, layout)
    mine = [reqs[i] for c in chunks if c.producer == 1 for i in c.items]
    kinds, got_names, ids = decode_requests(pickle.loads(pickle.dumps(encode_requests(mine))))
    assert len(kinds) == 1 and got_names == [r.name for r in mine] and ids.tolist() == [0, 0]
    digest = plan_digest(0, 1, chunks, (kinds, got_names, ids.tobytes()), router, layout)
    assert digest == pair_digest(0, 1, reqs, chunks, router, layout)
    with pytest.raises(ValueError, match="malformed"):
        decode_requests((kinds, got_names, b"\x05\x00\x00\x00" * 2))
    with pytest.raises(ValueError, match="malformed"):
        decode_requests("nonsense")


def test_view_cache_replays_by_geometry() -> None:
    views = ViewCache()
    w = torch.arange(48.0).reshape(6, 8)
    for chain in [
        (("narrow", (1, 2, 4)),),
        (("chunk", (2, 0)), ("__getitem__", (1,)), ("t", ())),
        (("__getitem__", (slice(1, 5),)), ("reshape", (32,))),
    ]:
        for t in (w, w[1:]):  # another base offset, same geometry key shape differs
            got = views(t, chain)
            assert (
                torch.equal(got, replay(t, chain)) and got.data_ptr() == replay(t, chain).data_ptr()
            )
    copying = (("t", ()), ("reshape", (48,)))  # a copy has no geometry: replayed as is
    assert views.geometry((6, 8), (8, 1), torch.float32, copying) is None
    assert torch.equal(views(w, copying), replay(w, copying))


def test_slot_views_match_item_by_item_views() -> None:
    """``slot_views`` gives what ``slot[off:off+n].view(dtype).view(shape)`` gives per item
    (address, shape, strides, dtype, contents, and writes land in the slot), for runs of one
    spec at one spacing, a spacing that changes in a run, runs too short to batch, other
    dtypes and shapes (3-D, 0-d) and an odd-sized tail."""
    slot = torch.arange(1 << 14, dtype=torch.int32).view(torch.uint8)[4:]  # slot at an offset
    bf, f32 = torch.bfloat16, torch.float32
    specs = [(bf, (4, 8), 64)] * 6 + [(f32, (2, 3, 2), 48)] * 5 + [(bf, (), 2)] * 4
    specs += [(torch.uint8, (3,), 3)] * 2 + [(bf, (4, 8), 64)] * 3
    offsets, at = [], 0
    for k, (_, _, nbytes) in enumerate(specs):
        offsets.append(at)
        at += nbytes + (64 if k == 3 else 0)  # one gap in the first run: two runs
        at = -(-at // 16) * 16
    got = slot_views(slot, specs, offsets)
    assert len(got) == len(specs)
    for view, (dtype, shape, nbytes), off in zip(got, specs, offsets, strict=True):
        want = slot[off : off + nbytes].view(dtype).view(shape)
        assert (view.data_ptr(), view.shape, view.stride(), view.dtype) == (
            want.data_ptr(),
            want.shape,
            want.stride(),
            want.dtype,
        ), (off, shape)
        as_bytes = view.reshape(-1).view(torch.uint8)
        assert view.is_contiguous() and torch.equal(as_bytes, want.reshape(-1).view(torch.uint8))
    got[7].fill_(1.5)  # a view of the slot, not a copy
    assert torch.equal(slot[offsets[7] : offsets[7] + 48].view(f32), torch.full((12,), 1.5))


def test_buffer_alloc_bytes() -> None:
    assert buffer_alloc_bytes(1) == 256 * MiB
    assert buffer_alloc_bytes(256 * MiB) == 256 * MiB
    assert buffer_alloc_bytes(256 * MiB + 1) == 512 * MiB
    assert buffer_alloc_bytes(10, presize=1024 * MiB) == 1024 * MiB
    assert buffer_alloc_bytes(0) == 0


class _Handle:
    def __init__(self) -> None:
        self.event = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        return self.event.wait(timeout)


def test_serve_ring_never_repacks_an_in_flight_slot() -> None:
    ring = ServeRing(torch.zeros(4 * 16, dtype=torch.uint8), 4, 16)
    handles = [_Handle() for _ in range(6)]
    for seq in range(4):
        slot = ring.acquire(seq, 16, 1.0, "t")
        assert slot.data_ptr() == ring.buffer.data_ptr() + seq * 16
        ring.in_flight(seq, handles[seq])
    with pytest.raises(TransferStallError, match="slot 0 still holds chunk 0"):
        ring.acquire(4, 16, 0.05, "t")
    handles[0].event.set()
    assert ring.acquire(4, 8, 0.05, "t").numel() == 8


def test_free_barrier() -> None:
    b = FreeBarrier({0: 2, 1: 1, 2: 0})
    assert b.pop_free() == [2]
    b.arrive(1)
    b.arrive(0)
    assert b.pop_free() == [1]
    with pytest.raises(TransferStallError, match="groups \\[0\\]"):
        b.wait_all(0.01)
    b.arrive(0)
    b.wait_all(0.01)
    with pytest.raises(RuntimeError, match="unexpected"):
        b.arrive(0)


def _experts_module(layers: int, experts: int) -> torch.nn.Module:
    root = torch.nn.Module()
    for i in range(layers):
        layer = torch.nn.Module()
        for e in range(experts):
            expert = torch.nn.Linear(4, 4, bias=False)
            layer.add_module(str(e), expert)
        layer.register_buffer("scale", torch.ones(2))
        root.add_module(f"l{i}", layer)
    return root


def test_module_source_walks_the_tree_and_sees_every_swap() -> None:
    """A plain module's tensors are re-read along the module tree, not through state_dict();
    what it hands out must still be what state_dict() would, after any kind of swap."""
    model = _experts_module(3, 5)
    source = StateDictSource(model)
    names = list(model.state_dict())

    def check() -> None:
        source.begin_sync()
        now = model.state_dict(keep_vars=True)
        assert all(a is now[n] for a, n in zip(source.current(names), names, strict=True))
        opened = source.open_group(names)
        assert all(opened[n].data_ptr() == now[n].data_ptr() for n in names)

    check()
    check()
    assert source._paths_ok  # the walk is in use
    model.l1.get_submodule("3").weight = torch.nn.Parameter(torch.ones(4, 4))  # a new parameter
    check()
    model.l2.get_submodule("0").weight.data = torch.full((4, 4), 2.0)  # new storage, same object
    check()
    model.l0._modules["4"] = torch.nn.Linear(4, 4, bias=False)  # a new submodule
    check()
    model.l2.scale = torch.zeros(2)  # a new buffer
    check()
    del model.l0._modules["4"]  # a path that no longer resolves: state_dict() decides
    source.begin_sync()
    with pytest.raises(KeyError):
        source.current(names)


@pytest.mark.parametrize("in_place", [False, True])
def test_source_hands_back_the_same_group_only_while_nothing_moved(in_place: bool) -> None:
    """``open_group`` returns the very mapping of last time (the engine then looks at no
    name) only while every tensor is where it was; any swap gives a fresh mapping of the new
    tensors. With ``in_place`` the trainer vouches instead, until ``changed()``."""
    state = {f"w{i}": torch.full((4, 4), float(i)) for i in range(6)}
    source = StateDictSource(state, in_place=in_place)
    names = list(state)

    def opened() -> Any:
        source.begin_sync()
        return source.open_group(names)

    first = opened()
    assert opened() is first
    swaps = [
        lambda: state.__setitem__("w1", torch.zeros(4, 4)),  # another tensor
        lambda: state["w2"].set_(torch.zeros(4, 4)),  # the same object, new storage
        lambda: state["w3"].set_(state["w3"].untyped_storage(), 0, (2, 8)),  # same storage
    ]
    for swap in swaps:
        before = opened()
        swap()
        got = opened()
        if in_place:  # the promise holds the old mapping until changed() is called
            assert got is before
            source.changed()
            got = opened()
        assert got is not before
        assert all(got[n].data_ptr() == state[n].data_ptr() for n in names)
        assert all(got[n].shape == state[n].shape for n in names)
        assert opened() is got
    if in_place:  # a changed() that changed nothing: the promise holds again after one look
        source.changed()
        kept = opened()
        state["w4"].set_(torch.zeros(4, 4))
        assert opened() is kept


def test_module_source_with_state_dict_hooks_keeps_state_dict() -> None:
    """A module whose state_dict() is shaped by a hook (as FSDP-like wrappers do) is never
    walked: the source hands out what state_dict() gives."""
    model = _experts_module(2, 3)
    doubled: dict[str, torch.Tensor] = {}

    def hook(module: Any, state: dict[str, Any], prefix: str, local: Any) -> None:
        for k in list(state):
            doubled[k] = state[k] = state[k] * 2  # a different tensor than the parameter

    model._register_state_dict_hook(hook)
    source = StateDictSource(model)
    names = list(model.state_dict())
    for _ in range(2):
        source.begin_sync()
        got = source.current(names)
        assert all(torch.equal(g, doubled[n]) for g, n in zip(got, names, strict=True))
    assert not source._paths_ok


def test_check_ray_rdt_version() -> None:
    assert RDT_MIN_RAY_VERSION == "2.56.0"
    assert check_ray_rdt_version("2.60.0") == "2.60.0"
    with pytest.raises(RuntimeError, match="pip install -U"):
        check_ray_rdt_version("2.55.1")


def test_llama_tp_layout_is_what_an_engine_holds(shapes: dict[str, Any]) -> None:
    params, routes = llama_tp_layout(shapes, 1, 2)
    layer = "model.layers.0"
    assert params[f"{layer}.self_attn.qkv_proj.weight"].shape == (64, 64)  # (64 + 2*32) / 2
    assert params[f"{layer}.mlp.gate_up_proj.weight"].shape == (128, 64)
    assert params[f"{layer}.self_attn.o_proj.weight"].shape == (64, 32)
    assert params[f"{layer}.mlp.down_proj.weight"].shape == (64, 64)
    assert params["model.embed_tokens.weight"].shape == (128, 64)
    full = {n: torch.randn(s).to(d) for n, (s, d) in shapes.items()}
    want = expected_params(params, routes, full)
    q = full[f"{layer}.self_attn.q_proj.weight"]
    assert torch.equal(want[f"{layer}.self_attn.qkv_proj.weight"][:32], q[32:])
    for name, targets in routes.items():  # the bake reproduces the real loaders
        for pname, loader in targets:
            dest = torch.zeros_like(params[pname])
            for copy in bake(loader, shapes[name][0], shapes[name][1], dest):
                replay(dest, copy.dest_chain).copy_(replay(full[name], copy.src_chain))
            if pname.endswith(("qkv_proj.weight", "gate_up_proj.weight")):
                continue  # fused: filled by several names
            assert tensor_digest(dest) == tensor_digest(want[pname]), name


# -- multi-process syncs -------------------------------------------------------------------------
_ONE_GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(cuda_device_count() < 1, reason="needs 1 CUDA device"),
]


def _launch(
    n: int,
    timeout: float = 90.0,
    task: type = LlamaTransferTask,
    comm: CommunicatorType = CommunicatorType.TORCH_DISTRIBUTED,
    device: str = "cpu",
    env: dict[str, str] | None = None,
    **kw: Any,
) -> list[dict[str, Any]]:
    if comm == CommunicatorType.NIXL_RDT:
        kw.setdefault("communicator_options", {"timeout": 30.0})
    return MPLauncher(n, timeout=timeout, env=env).launch(
        task_type=task,
        coordinator_type=CoordinatorType.TORCH_DISTRIBUTED,
        communicator_type=comm,
        device=device,
        **{"coordinator_options": {"timeout": 60.0}, **kw},
    )


def _assert_verified(results: list[dict[str, Any]], syncs: int) -> None:
    consumers = [r for r in results if r["role"] == "consumer"]
    assert consumers
    for r in consumers:
        assert len(r["outputs"]) == syncs
        assert all(o["verified"] for o in r["outputs"]), r["outputs"]


@pytest.mark.parametrize("threads", [True, False], ids=["pair_threads", "fleet_order"])
@distributed_test(timeout=120)
def test_sync_llama_tp2_two_replicas(shapes: dict[str, Any], threads: bool) -> None:
    """Push path, both ways to drive it: a thread per pair (gloo's default) and every rank
    issuing its transfers from one thread in the fleet order (NCCL's)."""
    results = _launch(
        6,
        num_producers=2,
        num_consumers=4,
        syncs=3,
        shapes=shapes,
        # items of 4 KiB and up travel alone, zero-copy where the views are contiguous
        config=TransferConfig(workers_per_replica=2, direct_bytes=4096, push_threads=threads),
    )
    _assert_verified(results, 3)
    summary = summarize(results)
    # every consumer receives only its shard: about half the model per TP rank
    model_bytes = sum(torch.Size(s).numel() * d.itemsize for s, d in shapes.values())
    per_consumer = summary["bytes_per_sync"] / 4
    assert 0.45 * model_bytes < per_consumer < 0.6 * model_bytes
    assert summary["verified"] and summary["path"] == "send_recv"


@pytest.mark.parametrize("threads", [True, False], ids=["pair_threads", "fleet_order"])
@distributed_test(timeout=120)
def test_sync_pipeline_stage_producers_deep_ring_many_chunks(
    shapes: dict[str, Any], threads: bool
) -> None:
    config = TransferConfig(ring_slots=8, max_chunk_bytes=4096, align=512, push_threads=threads)
    results = _launch(
        4, num_producers=2, num_consumers=2, syncs=3, shapes=shapes, stages=True, config=config
    )
    _assert_verified(results, 3)
    producers = [r for r in results if r["role"] == "producer"]
    assert all(r["syncs"][0]["chunks"] > 8 for r in producers)  # ring deeper than groups, wraps


def _with_experts(shapes: dict[str, Any], experts: int) -> dict[str, Any]:
    """``shapes`` plus Mixtral-style experts per layer: many small tensors whose row-parallel
    shards (w2) are strided, so packs and unpacks take ``CopyProgram`` gathers."""
    out = dict(shapes)
    layers = sorted({n.split(".")[2] for n in shapes if n.startswith("model.layers.")})
    for i in layers:
        for e in range(experts):
            base = f"model.layers.{i}.block_sparse_moe.experts.{e}"
            out[f"{base}.w1.weight"] = ((16, 8), torch.bfloat16)
            out[f"{base}.w3.weight"] = ((16, 8), torch.bfloat16)
            out[f"{base}.w2.weight"] = ((8, 16), torch.bfloat16)
    return out


class SplitExpertsTask(LlamaTransferTask):
    """Every producer holds the dense weights; the experts are dealt out between them, so a
    consumer's chunks of one layer come from several producers, interleaved in its plan."""

    def make_source(
        self, producer_idx: int, num_producers: int, shapes: Any = None, **_: Any
    ) -> StateDictSource:
        state = self._state = allocate(shapes or {}, self.device)
        held = [
            n
            for n in state
            if ".experts." not in n
            or int(n.split(".experts.")[1].split(".")[0]) % num_producers == producer_idx
        ]
        return StateDictSource(state, held=held)


@pytest.mark.parametrize("threads", [True, False], ids=["pair_threads", "fleet_order"])
@pytest.mark.parametrize("split", ["stages", "experts"])
@distributed_test(timeout=120)
def test_sync_many_small_experts_push_path(
    shapes: dict[str, Any], threads: bool, split: str
) -> None:
    """Two producers (pipeline stages, or the experts dealt out between them), two TP-2
    consumers, 48 experts a layer: byte-exact over syncs, through the packing and unpacking
    programs and their gathers, and, in fleet order, without a send/recv order cycle."""
    config = TransferConfig(push_threads=threads, ring_slots=2, stall_timeout=20.0)
    results = _launch(
        4,
        task=SplitExpertsTask if split == "experts" else LlamaTransferTask,
        num_producers=2,
        num_consumers=2,
        syncs=3,
        shapes=_with_experts(shapes, 48),
        stages=split == "stages",
        config=config,
    )
    _assert_verified(results, 3)
    consumers = [r for r in results if r["role"] == "consumer"]
    assert all(r["syncs"][-1]["packed"] > 0 for r in consumers)  # staged chunks were unpacked


@distributed_test(timeout=150)
def test_sync_real_hf_llama_module() -> None:
    results = _launch(
        3,
        timeout=140,
        num_producers=1,
        num_consumers=2,
        syncs=2,
        hf_module=True,
        shapes=None,
    )
    _assert_verified(results, 2)


class SpoofingConsumer(WeightConsumer):
    """Consumer 0 asks for a cast (``to``); consumer 1 for a name the producer does not serve."""

    def _bake(self, index: Any) -> Any:
        requests, dests = super()._bake(index)
        if self.consumer_id == 0:
            r = requests[0]
            requests[0] = Request(r.name, (("to", ("cpu",)),), r.shape, r.dtype)
        else:
            requests[0] = Request("model.secret", (), requests[0].shape, requests[0].dtype)
        return requests, dests


class SpoofTask(LlamaTransferTask):
    consumer_class = SpoofingConsumer


@distributed_test(timeout=120)
def test_producer_refuses_spoofed_chains_and_unserved_names(shapes: dict[str, Any]) -> None:
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        _launch(3, task=SpoofTask, num_producers=1, num_consumers=2, shapes=shapes)
    text = str(info.value)
    assert "op 'to' is not allowed" in text
    assert "'model.secret', which it does not hold; refusing" in text
    assert time.monotonic() - start < 60


class MisconfiguredConsumer(WeightConsumer):
    """This consumer was deployed with another chunk size than the producers."""

    def __init__(self, *args: Any, config: TransferConfig, **kw: Any) -> None:
        super().__init__(*args, config=TransferConfig(max_chunk_bytes=1024), **kw)


class MismatchTask(LlamaTransferTask):
    consumer_class = MisconfiguredConsumer


@distributed_test(timeout=120)
def test_differing_plans_fail_at_setup(shapes: dict[str, Any]) -> None:
    with pytest.raises(LaunchError, match="derived different plans"):
        _launch(2, task=MismatchTask, num_producers=1, num_consumers=1, shapes=shapes)


def _free_port() -> int:
    return find_free_port("127.0.0.1")  # below the ephemeral range: no outgoing socket takes it


def _launch_halves(
    port: int, producer_task: type, consumer_task: type, timeout: float, **kw: Any
) -> tuple[Any, Any]:
    """A trainer launch and an inference launch that meet at 127.0.0.1:port."""
    return _launch_halves_sized(port, producer_task, consumer_task, timeout, 2, **kw)


def _launch_halves_sized(
    port: int, producer_task: type, consumer_task: type, timeout: float, consumers: int, **kw: Any
) -> tuple[Any, Any]:
    out: dict[str, Any] = {}
    token = JoinSpec.new_token()  # the fleet's secret, given to both launches

    def run(role: str, n: int, task: type) -> None:
        join = JoinSpec(
            host="127.0.0.1",
            port=port,
            role=role,
            num_producers=1,
            num_consumers=consumers,
            token=token,
        )
        # each launch puts its rank 0 on cuda:0: always shared, however many GPUs
        env = shared_gpu_nccl_env(role) if kw.get("device") == "cuda" else None
        try:
            out[role] = _launch(n, timeout=timeout, task=task, join=join, env=env, **kw)
        except Exception as exc:  # handed to the test
            out[role] = exc

    threads = [
        # daemons: a launch that outlives its join (the test then fails) must not hold pytest
        threading.Thread(target=run, args=("producer", 1, producer_task), daemon=True),
        threading.Thread(target=run, args=("consumer", consumers, consumer_task), daemon=True),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    return out.get("producer"), out.get("consumer")


@distributed_test(timeout=120)
def test_two_launches_meet_at_host_port(shapes: dict[str, Any]) -> None:
    producers, consumers = _launch_halves(
        _free_port(), LlamaTransferTask, LlamaTransferTask, 90, syncs=2, shapes=shapes
    )
    assert isinstance(producers, list) and isinstance(consumers, list), (producers, consumers)
    _assert_verified(consumers, 2)
    assert producers[0]["role"] == "producer" and len(consumers) == 2


class DyingConsumer(LlamaTransferTask):
    """Consumer 1 dies in the middle of its second sync."""

    def after_consumer_sync(self, step: int, spec: Any, **kw: Any) -> Any:
        if step == 0 and self.coordinator.get_rank() == 2:
            import os

            os._exit(7)
        return super().after_consumer_sync(step, spec, **kw)


@pytest.mark.parametrize("threads", [True, False], ids=["pair_threads", "fleet_order"])
@distributed_test(timeout=120)
def test_consumer_death_ends_the_producers_sync(shapes: dict[str, Any], threads: bool) -> None:
    start = time.monotonic()
    producers, consumers = _launch_halves(
        _free_port(),
        LlamaTransferTask,
        DyingConsumer,
        90,
        syncs=3,
        shapes=shapes,
        config=TransferConfig(stall_timeout=5.0, push_threads=threads),
        coordinator_options={"timeout": 20.0},
    )
    # the dead consumer's launch ends its other rank too; that one shows up as failed when it
    # noticed the producers going away before the launcher stopped it
    assert isinstance(consumers, LaunchError) and 1 in consumers.ranks
    assert "exited with code 7" in str(consumers)
    assert isinstance(producers, LaunchError), producers
    # the trainer side ended on its own, naming the consumer (or the stall)
    assert "consumer(s) [1] failed" in str(producers) or "stall" in str(producers), producers
    assert time.monotonic() - start < 60


class UnconfirmingConsumer(WeightConsumer):
    """Dies in its second sync after its last chunk landed, before it confirms the sync."""

    def _make_rings(self) -> Any:
        path = super()._make_rings()
        assert isinstance(path, ConsumerPush)
        send_receipts = path._send_receipts

        def dying() -> None:
            if self._syncs == 2:
                import os

                os._exit(7)
            send_receipts()

        path._send_receipts = dying  # type: ignore[method-assign]
        return path


class UnconfirmingTask(LlamaTransferTask):
    consumer_class = UnconfirmingConsumer


@distributed_test(timeout=120)
def test_producer_sync_fails_without_the_consumers_receipt(shapes: dict[str, Any]) -> None:
    """Every byte of the sync reached the consumer, which then died: the trainer must not be
    told the sync went well (NCCL, and socket buffers, take sends nobody receives)."""
    producers, consumers = _launch_halves(
        _free_port(),
        LlamaTransferTask,
        UnconfirmingTask,
        90,
        syncs=3,
        shapes=shapes,
        config=TransferConfig(stall_timeout=5.0),
        coordinator_options={"timeout": 20.0},
    )
    assert isinstance(consumers, LaunchError) and "exited with code 7" in str(consumers)
    assert isinstance(producers, LaunchError), producers
    last = str(producers).strip().splitlines()[-1]
    assert "failed in sync 2" in last and "receipt of sync 2" in last, last


class DyingProducer(LlamaTransferTask):
    """The producer dies before its second sync."""

    def before_producer_sync(self, step: int, source: Any, **kw: Any) -> None:
        if step == 1:
            import os

            os._exit(9)
        super().before_producer_sync(step, source, **kw)


class RetryingConsumer(WeightConsumer):
    """Syncs again straight after a failed sync, and reports how that second try went."""

    def sync(self) -> Any:
        try:
            return super().sync()
        except Exception as first:
            try:
                super().sync()
            except RuntimeError as again:
                raise RuntimeError(f"RETRY REFUSED: {again}") from first
            raise RuntimeError(
                "RETRY RAN: a consumer synced on after a failed push sync"
            ) from first


class RetryingTask(LlamaTransferTask):
    consumer_class = RetryingConsumer


@distributed_test(timeout=120)
def test_consumer_refuses_to_sync_after_a_failed_push_sync(shapes: dict[str, Any]) -> None:
    """Receives a failed sync posted ahead may still be pending (gloo cannot cancel them), so
    they could take the next sync's bytes: the consumer refuses to go on and says to restart."""
    producers, consumers = _launch_halves(
        _free_port(),
        DyingProducer,
        RetryingTask,
        90,
        syncs=3,
        shapes=shapes,
        config=TransferConfig(stall_timeout=5.0),
        coordinator_options={"timeout": 20.0},
    )
    assert isinstance(producers, LaunchError) and "exited with code 9" in str(producers)
    assert isinstance(consumers, LaunchError), consumers
    assert "RETRY REFUSED" in str(consumers) and "restart it" in str(consumers), consumers


# -- one-sided READ path (NIXL_RDT) ---------------------------------------------------------------
def _needs_nixl() -> None:
    pytest.importorskip("nixl", reason="needs the nixl package (pip install 'vllm_dist[nixl]')")


@distributed_test(timeout=150)
def test_read_path_nixl_stages_two_replicas_one_slot(shapes: dict[str, Any]) -> None:
    """Producers expose their rings and stable sources, consumers READ, 3 syncs byte-exact.

    Pipeline-stage owners, two TP-2 replicas (the second replica reads the sources the first
    one got exposed), K = 1 (every packed chunk of a pair reuses one slot) and items of 4 KiB
    and up alone (read in place from the source, straight into the parameter).
    """
    _needs_nixl()
    config = TransferConfig(
        workers_per_replica=2, ring_slots=1, max_chunk_bytes=8192, direct_bytes=4096
    )
    results = _launch(
        6,
        comm=CommunicatorType.NIXL_RDT,
        num_producers=2,
        num_consumers=4,
        syncs=3,
        shapes=shapes,
        stages=True,
        config=config,
    )
    _assert_verified(results, 3)
    summary = summarize(results)
    assert summary["path"] == "read" and summary["verified"]
    assert all(r["syncs"][0]["chunks"] > 8 for r in results if r["role"] == "producer")


class OpenOnlySource(StateDictSource):
    """A resident source that cannot list its tensors cheaply (``current`` says None): the
    steady-state check opens every group instead."""

    def current(self, names: Any) -> None:
        return None


class SwappingStorageTask(LlamaTransferTask):
    """A trainer that swaps its parameters' storage (``p.data = ...``) before sync 2: the
    tensor objects stay, so only their data pointers tell that the bytes moved."""

    def make_source(self, *args: Any, check: str = "current", **kw: Any) -> Any:
        """``check``: how the source lets the producer see that nothing moved: "current"
        (every tensor compared), "open_only" (every group opened and compared) or "in_place"
        (the trainer vouches for in-place writes and says ``changed()`` after its swap)."""
        source = super().make_source(*args, **kw)
        if check == "open_only":
            return OpenOnlySource(self._state)
        if check == "in_place":
            return StateDictSource(self._state, in_place=True)
        return source

    def before_producer_sync(self, step: int, source: Any, **kw: Any) -> None:
        if step == 2:  # fresh storage; the old one keeps sync 1's bytes
            for t in self._state.values():
                t.data = torch.empty_like(t.data)
            if kw.get("check") == "in_place":
                source.changed()
        super().before_producer_sync(step, source, **kw)


@pytest.mark.parametrize(
    "comm, device, strided",
    [
        ("torch_distributed", "cpu", None),
        ("nixl_rdt", "cpu", None),
        ("nixl_rdt", "cpu", True),  # in-place strided reads follow the swap too
        pytest.param("nixl_rdt", "cuda", None, marks=_ONE_GPU),  # CUDA IPC mappings
    ],
)
@distributed_test(timeout=240)
def test_sync_follows_a_storage_swap(
    shapes: dict[str, Any], comm: str, device: str, strided: bool | None
) -> None:
    if comm == "nixl_rdt":
        _needs_nixl()
    results = _launch(
        3,
        timeout=200,
        task=SwappingStorageTask,
        comm=CommunicatorType(comm),
        device=device,
        num_producers=1,
        num_consumers=2,
        syncs=4,
        shapes=shapes,
        config=TransferConfig(workers_per_replica=2, direct_bytes=4096, strided_reads=strided),
    )
    _assert_verified(results, 4)


class RejoinTask(GlobalCoordinatorDistributedTask):
    """1 producer, 2 TP-2 consumers. Consumer 1 defers set-up and joins after sync 0;
    consumer 0 restarts (a new engine over fresh parameters) after sync 1. Every consumer
    that holds weights checks them byte for byte after every sync it takes part in."""

    def post_init_distributed(
        self,
        shapes: Any = None,
        config: Any = None,
        bad_restart: bool = False,
        ahead: str = "",
        **_: Any,
    ) -> Any:
        """``ahead``: "" (admit ships the facts), "facts" (each joining consumer plans ahead
        against facts the producer sent it, ``prepare_join``) or "stale" (consumer 0's restart
        plans against facts in another order)."""
        fleet = Fleet.split(1, 2)
        rank = self.coordinator.get_rank()
        coord, comm = self.coordinator, self.communicator
        if rank == 0:
            state = allocate(shapes, self.device)
            refused = ""
            producer = WeightProducer(
                coord, comm, fleet=fleet, source=StateDictSource(state), config=config
            )
            producer.setup()
            producer.ship_facts = not ahead
            try:
                for step in range(4):
                    if step == 1:
                        if ahead:
                            coord.send_object(producer.producer_facts, 2)
                        producer.admit(1)  # the late consumer
                    if step == 2:
                        if ahead:
                            coord.send_object(producer.producer_facts, 1)
                        try:
                            producer.admit(0)  # the restarted one
                        except (WeightTransferSetupError, PlanMismatchError) as exc:
                            if not (bad_restart or ahead == "stale"):
                                raise
                            refused = str(exc)
                    fill_weights(state, 0, step)
                    producer.sync()
            finally:
                producer.close()
            return refused
        cid = rank - 1
        full = allocate(shapes)

        def engine(broken: bool = False) -> tuple[WeightConsumer, dict[str, torch.Tensor], Any]:
            params, routes = llama_tp_layout(shapes, cid, 2, self.device)
            # broken: a route naming a parameter the engine does not have
            route = (lambda n: [("no.such.param", routes[n][0][1])]) if broken else None
            consumer = WeightConsumer(
                coord,
                comm,
                fleet=fleet,
                params=params,
                route=route or (lambda n: routes.get(n, [])),
                config=config,
            )
            return consumer, params, routes

        consumer, params, routes = engine()
        consumer.setup(defer=cid == 1)
        checked = []
        try:
            for step in range(4):
                if cid == 1 and step == 0:
                    continue  # not in the fleet yet: sync 0 goes to consumer 0 alone
                if cid == 1 and step == 1:
                    if ahead:
                        consumer.prepare_join(coord.recv_object(0))
                    consumer.join()
                if cid == 0 and step == 2:
                    consumer.close()
                    consumer, params, routes = engine(broken=bad_restart)
                    if ahead:
                        facts = coord.recv_object(0)
                        if ahead == "stale":  # the same weights, another model order
                            meta = tuple(reversed(facts[0].metadata))
                            facts = [dataclasses.replace(facts[0], metadata=meta)]
                        consumer.prepare_join(facts)
                    try:
                        consumer.join()
                    except (KeyError, WeightTransferSetupError) as exc:
                        checked.append((step, f"refused: {exc}"))
                        break
                consumer.sync()
                fill_weights(full, 0, step)
                want = expected_params(params, routes, full)
                ok = all(tensor_digest(t) == tensor_digest(want[n]) for n, t in params.items())
                checked.append((step, ok))
        finally:
            consumer.close()
        return checked


@pytest.mark.parametrize(
    "comm, device",
    [
        ("torch_distributed", "cpu"),
        ("nixl_rdt", "cpu"),
        # all three workers on cuda:0: CUDA IPC reads of the re-exposed rings
        pytest.param("nixl_rdt", "cuda", marks=_ONE_GPU),
    ],
)
@distributed_test(timeout=240)
def test_consumer_joins_late_and_restarts(shapes: dict[str, Any], comm: str, device: str) -> None:
    if comm == "nixl_rdt":
        _needs_nixl()
    results = _launch(
        3,
        timeout=200,
        task=RejoinTask,
        comm=CommunicatorType(comm),
        device=device,
        shapes=shapes,
        config=TransferConfig(workers_per_replica=2, direct_bytes=4096),
    )
    assert results[0] == ""
    assert results[1] == [(0, True), (1, True), (2, True), (3, True)]
    assert results[2] == [(1, True), (2, True), (3, True)]


@pytest.mark.parametrize("ahead", ["facts", "stale"])
@distributed_test(timeout=120)
def test_a_consumer_that_planned_ahead_joins_and_a_stale_plan_is_refused(
    shapes: dict[str, Any], ahead: str
) -> None:
    """``prepare_join``: consumers that bake and plan before the producers' ``admit`` (which
    then ships no facts) join and sync byte-exact; a plan made against facts that differ from
    the producer's is refused at admission, and the other consumer never notices."""
    results = _launch(
        3,
        task=RejoinTask,
        shapes=shapes,
        ahead=ahead,
        config=TransferConfig(workers_per_replica=2, direct_bytes=4096),
    )
    assert results[2] == [(1, True), (2, True), (3, True)]  # joined after planning ahead
    if ahead == "facts":
        assert results[0] == ""
        assert results[1] == [(0, True), (1, True), (2, True), (3, True)]
    else:
        assert "different plans" in results[0], results[0]
        assert results[1][:2] == [(0, True), (1, True)]
        assert results[1][2][0] == 2 and "refused" in results[1][2][1], results[1]


@distributed_test(timeout=120)
def test_refused_restart_leaves_the_other_consumers_syncing(shapes: dict[str, Any]) -> None:
    results = _launch(
        3,
        task=RejoinTask,
        shapes=shapes,
        bad_restart=True,
        config=TransferConfig(workers_per_replica=2, direct_bytes=4096),
    )
    assert "consumer 0" in results[0] and "no.such.param" in results[0], results[0]
    assert results[1][:2] == [(0, True), (1, True)]
    assert results[1][2][0] == 2 and "no.such.param" in results[1][2][1]
    assert results[2] == [(1, True), (2, True), (3, True)]  # consumer 1 never noticed


@distributed_test(timeout=150)
def test_read_path_one_announcement_per_sync(shapes: dict[str, Any]) -> None:
    """announce_bytes above the model and a ring deep enough for a whole sync: a sync read
    chunk by chunk is one announcement and one batched read per consumer, still byte-exact
    (the trace is of sync 2; from sync 3 on the whole sync is replayed, tested below)."""
    _needs_nixl()
    config = TransferConfig(
        workers_per_replica=2,
        ring_slots=512,  # 8 KiB slots: more than twice a sync's packed chunks
        max_chunk_bytes=8192,
        direct_bytes=4096,
        announce_bytes=1 << 40,
        share_cpu_weights=False,  # else every chunk is read in place from the trainer's arena
    )
    results = _launch(
        3,
        comm=CommunicatorType.NIXL_RDT,
        num_producers=1,
        num_consumers=2,
        syncs=2,
        shapes=shapes,
        config=config,
        env={"VLLM_DIST_WT_TRACE": "1"},
    )
    _assert_verified(results, 2)
    assert summarize(results)["path"] == "read"
    events = [e for _, e in results[0]["trace"]]  # the producer's last sync
    assert sum(e.startswith("announce") for e in events) == 2, " ".join(events)  # one per consumer
    for consumer in results[1:]:
        assert sum(e.startswith("pull") for _, e in consumer["trace"]) == 1


class FlatRowParallelTask(LlamaTransferTask):
    """Consumers keep ``o_proj`` flattened: their loader reshapes a column slice, so the op
    chain the producer replays makes a copy, which must hold fresh bytes every sync."""

    def make_consumer(self, consumer_idx: int, num_consumers: int, **kw: Any) -> Any:
        spec = super().make_consumer(consumer_idx, num_consumers, **kw)
        rank = consumer_idx % 2
        for name, param in list(spec.params.items()):
            if name.endswith("o_proj.weight"):
                flat = torch.zeros(param.numel(), dtype=param.dtype, device=param.device)
                spec.params[name] = flat

                def load(dest: Any, src: Any, rank: int = rank) -> None:
                    dest.copy_(src.chunk(2, dim=1)[rank].reshape(-1))

                self._routes[name] = [(name, load)]
        return spec


@pytest.mark.parametrize("comm", ["torch_distributed", "nixl_rdt"])
@distributed_test(timeout=150)
def test_chains_that_copy_are_replayed_every_sync(shapes: dict[str, Any], comm: str) -> None:
    if comm == "nixl_rdt":
        _needs_nixl()
    config = TransferConfig(workers_per_replica=2, direct_bytes=4096, strided_reads=None)
    results = _launch(
        3,
        task=FlatRowParallelTask,
        comm=CommunicatorType(comm),
        num_producers=1,
        num_consumers=2,
        syncs=3,
        shapes=shapes,
        config=config,
    )
    _assert_verified(results, 3)


def _one_to_two(device: str, **kw: Any) -> list[dict[str, Any]]:
    """One producer and two TP-2 consumers over NIXL_RDT on ``device`` (every worker on
    cuda:0 with one GPU)."""
    return _launch(
        3,
        timeout=240,
        comm=CommunicatorType.NIXL_RDT,
        device=device,
        num_producers=1,
        num_consumers=2,
        **kw,
    )


_STEADY = TransferConfig(workers_per_replica=2, direct_bytes=4096, ring_slots=64)


def _strided_vs_packed(shapes: dict[str, Any], device: str, strided: bool | None) -> list[Any]:
    """The same fleet with strided reads off and then ``strided``; both byte-exact."""
    runs = []
    for mode in (False, strided):
        config = TransferConfig(
            workers_per_replica=2, direct_bytes=4096, announce_bytes=1 << 40, ring_slots=64,
            strided_reads=mode,
        )  # fmt: skip
        results = _one_to_two(
            device,
            syncs=3,
            shapes=shapes,
            config=config,
            # DRAM: through NIXL, no mapping (a consumer that maps its producers' memory
            # gets the strided views of a storage it cannot map packed instead)
            communicator_options={"timeout": 30.0, "shared_memory": False},
        )
        _assert_verified(results, 3)
        assert summarize(results)["path"] == "read"
        runs.append(results)
    return runs


@distributed_test(timeout=150)
def test_read_path_strided_reads_skip_the_producer_pack_cpu(shapes: dict[str, Any]) -> None:
    """strided_reads=True through NIXL on DRAM: row-parallel slices are read in place (one
    descriptor per row) instead of packed; the producer packs fewer chunks, bytes are exact."""
    _needs_nixl()
    packed, strided = _strided_vs_packed(shapes, "cpu", True)
    first, last = packed[0]["syncs"], strided[0]["syncs"]
    assert first[0]["packed"] == last[0]["packed"]  # sync 1: no source is exposed yet
    assert last[-1]["packed"] < first[-1]["packed"], (first, last)


@distributed_test(timeout=120)
def test_read_path_consumer_death_ends_the_producers_sync(shapes: dict[str, Any]) -> None:
    _needs_nixl()
    start = time.monotonic()
    producers, consumers = _launch_halves(
        _free_port(),
        LlamaTransferTask,
        DyingConsumer,
        90,
        syncs=3,
        shapes=shapes,
        comm=CommunicatorType.NIXL_RDT,
        config=TransferConfig(stall_timeout=5.0),
        coordinator_options={"timeout": 20.0},
    )
    # the dead consumer's launch ends its other rank too; that one shows up as failed when it
    # noticed the producers going away before the launcher stopped it
    assert isinstance(consumers, LaunchError) and 1 in consumers.ranks
    assert "exited with code 7" in str(consumers)
    assert isinstance(producers, LaunchError), producers
    # the producer either waits out the stall timeout for the dead consumer's 'done' or, where
    # UCX has seen the peer go by then, fails at once telling it (both name the consumer)
    said = str(producers)
    assert "stall" in said or "telling consumer" in said, said
    assert time.monotonic() - start < 60


@distributed_test(gpus=1, timeout=300)
def test_read_path_nixl_one_gpu_producer_and_two_tp2_consumers(shapes: dict[str, Any]) -> None:
    """All three workers on cuda:0 (the same-GPU path); bytes checked like on CPU."""
    _needs_nixl()
    results = _launch(
        3,
        timeout=240,
        comm=CommunicatorType.NIXL_RDT,
        device="cuda",  # cuda:<local rank % GPUs>: every worker on cuda:0 with one GPU
        num_producers=1,
        num_consumers=2,
        syncs=3,
        shapes=shapes,
        config=TransferConfig(workers_per_replica=2, direct_bytes=4096),
    )
    _assert_verified(results, 3)
    assert summarize(results)["path"] == "read"


@distributed_test(gpus=1, timeout=400)
def test_read_path_strided_reads_one_gpu(shapes: dict[str, Any]) -> None:
    """Auto strided reads on one GPU (CUDA IPC): after the first sync nothing one-item is
    packed or unpacked — each weight is one copy from the producer's tensor into the
    consumer's parameter, transposed layouts included — and every byte is exact."""
    _needs_nixl()
    packed, strided = _strided_vs_packed(shapes, "cuda", None)
    for role in range(3):
        assert strided[role]["syncs"][-1]["packed"] < packed[role]["syncs"][-1]["packed"]


@distributed_test(gpus=1, timeout=400)
def test_read_path_mapped_unpack_one_gpu(shapes: dict[str, Any]) -> None:
    """On one GPU (CUDA IPC) consumers copy packed items straight from the producer's ring
    into their parameters: nothing is unpacked from staging, chunk by chunk or replayed, while
    the producer still packs (its weights left where they are: ``share_gpu_weights=False``).
    With ``mapped_unpack=False`` the same chunks are read into staging and unpacked. Every
    byte is exact either way."""
    _needs_nixl()
    runs = {}
    for mapped in (False, True):
        results = _one_to_two(
            "cuda",
            syncs=4,
            shapes=shapes,
            config=replace(_STEADY, mapped_unpack=mapped, share_gpu_weights=False),
        )
        _assert_verified(results, 4)
        assert _replayed(results) == [[False, False, True, True]] * 3
        runs[mapped] = [[s["packed"] for s in r["syncs"]] for r in results]
    for syncs in runs[False][1:] + runs[True][:1]:
        assert all(packed > 0 for packed in syncs), runs
    for syncs in runs[True][1:]:
        assert syncs == [0, 0, 0, 0], runs


def _flat_experts(
    shapes: dict[str, Any], device: str, strided: bool | None, **options: Any
) -> list[Any]:
    """One producer whose weights, 48 small experts a layer among them, are views of one flat
    buffer; two TP-2 consumers; four syncs, byte-exact."""
    results = _one_to_two(
        device,
        syncs=4,
        shapes=_with_experts(shapes, 48),
        flat=True,
        config=replace(_STEADY, strided_reads=strided),
        communicator_options={"timeout": 30.0, **options},
    )
    _assert_verified(results, 4)
    assert [r["role"] for r in results] == ["producer", "consumer", "consumer"]
    assert _replayed(results) == [[False, False, True, True]] * 3
    return [[s["packed"] for s in r["syncs"]] for r in results]


@distributed_test(timeout=150)
def test_read_path_flat_buffer_through_nixl_is_packed_cpu(shapes: dict[str, Any]) -> None:
    """A trainer that keeps its weights in one flat buffer, strided reads through NIXL (no
    mapping of the producer's memory): small experts are still packed, every sync — read in
    place they would cost a descriptor per 16-byte row — and unpacked; bytes are exact."""
    _needs_nixl()
    producer, *consumers = _flat_experts(shapes, "cpu", True, shared_memory=False)
    assert all(n > 0 for n in producer), producer
    assert all(all(n > 0 for n in packed) for packed in consumers), consumers


@distributed_test(timeout=150)
def test_read_path_consumers_unpack_from_a_shared_memory_ring_cpu(shapes: dict[str, Any]) -> None:
    """On the CPU the consumers map the producer's ring (shared memory): what the producer
    packs (weights too small to travel alone, and all of sync 1) they copy straight into their
    parameters, nothing is unpacked from staging; from the third sync on, replayed; bytes
    exact. (The trainer's weights stay where they are: in an arena, nothing would be packed.)"""
    _needs_nixl()
    config = replace(_STEADY, share_cpu_weights=False)
    results = _one_to_two("cpu", syncs=4, shapes=shapes, config=config)
    _assert_verified(results, 4)
    assert _replayed(results) == [[False, False, True, True]] * 3
    producer, *consumers = [[s["packed"] for s in r["syncs"]] for r in results]
    assert all(n > 0 for n in producer), producer
    assert consumers == [[0, 0, 0, 0]] * 2, consumers


@distributed_test(timeout=200)
def test_read_path_trainer_weights_move_to_shared_memory_cpu(shapes: dict[str, Any]) -> None:
    """``share_cpu_weights`` (the default): at set-up the producer moves the trainer's storages
    into one shared-memory arena, in place, and the consumers map it: every chunk, small
    weights' included, is read in place and nothing is packed. The weights, rewritten in
    place every sync through the trainer's own tensors, stay byte-exact. Off: nothing moves
    and the producer packs."""
    on = _weights_moved_or_not(shapes, "cpu", "share_cpu_weights")
    assert [s["packed"] for s in on["syncs"]] == [0] * 4, on["syncs"]


@distributed_test(gpus=1, timeout=400)
def test_read_path_trainer_weights_move_to_vram_arenas_one_gpu(shapes: dict[str, Any]) -> None:
    """``share_gpu_weights`` (the default) on one GPU: at set-up the producer moves the
    storages of the weights that travel in chunks of several into VRAM arenas, in place, and
    the consumers map them (CUDA IPC), so those chunks are read in place, not packed; the
    larger weights are read in place one by one from sync 2 on, so nothing is packed from then
    on. Weights rewritten in place every sync stay byte-exact. Off: nothing moves and the
    producer packs the small weights every sync."""
    on = _weights_moved_or_not(shapes, "cuda", "share_gpu_weights")
    assert [s["packed"] for s in on["syncs"]][1:] == [0] * 3, on["syncs"]


def _weights_moved_or_not(shapes: dict[str, Any], device: str, flag: str) -> dict[str, Any]:
    """The same fleet with the producer's ``flag`` on and off, 4 syncs each, byte-exact; the
    producer's result with it on (it moved bytes; off, nothing moved and it packed)."""
    _needs_nixl()
    producers = {}
    for share in (True, False):
        config = replace(_STEADY, **{flag: share})
        results = _one_to_two(device, syncs=4, shapes=shapes, config=config)
        _assert_verified(results, 4)
        producers[share] = results[0]
    on, off = producers[True], producers[False]
    assert on["shared_bytes"] > 0 and off["shared_bytes"] == 0, (on, off)
    assert off["syncs"][-1]["packed"] > 0, off["syncs"]
    return on


@pytest.mark.parametrize("comm", ["nixl_rdt", "torch_distributed"])
@distributed_test(timeout=200)
def test_consumer_parameters_move_into_an_arena_cpu(shapes: dict[str, Any], comm: str) -> None:
    """``gather_cpu_params`` (the default): at set-up each CPU consumer moves the parameters
    that receive items in chunks of several into one arena of its own (the one-sided READ
    path and the send/recv path alike); every later sync, with the weights changing, lands
    byte-exact in the moved parameters. Off: nothing moves, the same bytes land."""
    if comm == "nixl_rdt":
        _needs_nixl()
    gathered = {}
    for gather in (True, False):
        results = _launch(
            3,
            timeout=150,
            comm=CommunicatorType(comm),
            num_producers=1,
            num_consumers=2,
            syncs=3,
            shapes=shapes,
            config=replace(_STEADY, gather_cpu_params=gather),
        )
        _assert_verified(results, 3)
        gathered[gather] = [r["gathered_bytes"] for r in results if r["role"] == "consumer"]
    assert all(n > 0 for n in gathered[True]) and gathered[False] == [0, 0], gathered


@distributed_test(timeout=150)
def test_read_path_flat_buffer_is_read_in_place_through_shared_memory_cpu(
    shapes: dict[str, Any],
) -> None:
    """The same flat buffer in shared memory, mapped by the consumers (strided reads on by
    default there): from the second sync on, each item is one copy from the trainer's buffer
    into the consumer's parameter; nothing is packed or unpacked; bytes are exact."""
    _needs_nixl()
    producer, *consumers = _flat_experts(shapes, "cpu", None)
    assert producer[0] > 0 and producer[1:] == [0, 0, 0], producer
    assert consumers == [[0, 0, 0, 0]] * 2, consumers


@distributed_test(gpus=1, timeout=400)
def test_read_path_flat_buffer_is_read_in_place_one_gpu(shapes: dict[str, Any]) -> None:
    """The same on one GPU (CUDA IPC): from the second sync on, each item is one copy from the
    trainer's flat buffer into the consumer's parameter; nothing is packed or unpacked."""
    _needs_nixl()
    producer, *consumers = _flat_experts(shapes, "cuda", None)
    assert producer[0] > 0 and producer[1:] == [0, 0, 0], producer
    assert consumers == [[0, 0, 0, 0]] * 2, consumers


# -- the steady state: whole syncs replayed -----------------------------------------------------


def _replayed(results: list[dict[str, Any]]) -> list[list[bool]]:
    return [[s["replayed"] for s in r["syncs"]] for r in results]


@pytest.mark.parametrize("replay", [True, False])
@distributed_test(timeout=150)
def test_read_path_steady_state_replays_whole_syncs(shapes: dict[str, Any], replay: bool) -> None:
    """A resident source written in place, its weights moved into a shared-memory arena at
    set-up (``share_cpu_weights``): sync 1 reads every chunk in place from the arena, and from
    sync 2 on every sync runs as sync 1 did (one message per consumer and one answer) — the
    weights still change every sync and every byte is checked. With ``replay=False`` every
    sync goes chunk by chunk."""
    _needs_nixl()
    results = _launch(
        3,
        comm=CommunicatorType.NIXL_RDT,
        num_producers=1,
        num_consumers=2,
        syncs=5,
        shapes=shapes,
        config=replace(_STEADY, replay=replay),
        env={"VLLM_DIST_WT_TRACE": "1"},
    )
    _assert_verified(results, 5)
    assert _replayed(results) == [[False, replay, replay, replay, replay]] * 3
    if not replay:
        return
    events = [e for _, e in results[0]["trace"]]  # the producer's last sync: no per-chunk work
    assert "replay" in events and not any(e.startswith(("open ", "announce")) for e in events)
    assert results[0]["syncs"][-1]["packed"] == results[0]["syncs"][1]["packed"]


@pytest.mark.parametrize("check", ["current", "open_only", "in_place"])
@distributed_test(timeout=150)
def test_replay_stops_at_a_storage_swap_and_resumes(shapes: dict[str, Any], check: str) -> None:
    """``p.data = ...`` before sync 3: that sync and the next are read chunk by chunk (the new
    storage, out of the arena the trainer's weights were moved to at set-up, is packed, then
    exposed and read in place); replays resume at sync 5. Whether the source lists its tensors
    (``current``: the check opens nothing, and the arena makes sync 1 read in place, replayed
    by sync 2), or not (every group is opened and compared; no arena, as the source cannot
    list its tensors at set-up: sync 2 reads in place what sync 1 packed), or vouches for
    in-place writes and says when it swapped: then a storage is exposed the first time a sync
    meets it, so the swap's sync 3 is read in place already and replayed by sync 4."""
    _needs_nixl()
    results = _launch(
        3,
        task=SwappingStorageTask,
        comm=CommunicatorType.NIXL_RDT,
        num_producers=1,
        num_consumers=2,
        syncs=6,
        shapes=shapes,
        config=_STEADY,
        check=check,
        env={"VLLM_DIST_WT_TRACE": "1"},
    )
    _assert_verified(results, 6)
    expected = {
        "current": [False, True, False, False, True, True],
        "open_only": [False, False, False, False, True, True],
        "in_place": [False, True, False, True, True, True],
    }
    assert _replayed(results) == [expected[check]] * 3
    events = [e for _, e in results[0]["trace"]]  # the producer's last sync, a replay
    opened = check == "open_only"
    assert ("opened" in events, "checked" in events) == (opened, not opened)


class ChunkwiseConsumer(WeightConsumer):
    """A consumer that never runs a replay as a whole: it reads the announcements a replay
    message stands for one by one (what a consumer does when its record cannot be replayed)."""

    def _make_rings(self) -> Any:
        path = super()._make_rings()
        assert isinstance(path, ConsumerRead)
        path.replay.start = lambda p, msg, what: False  # type: ignore[method-assign]
        return path


class ChunkwiseTask(LlamaTransferTask):
    consumer_class = ChunkwiseConsumer


@distributed_test(timeout=150)
def test_replay_read_chunk_by_chunk_is_byte_exact(shapes: dict[str, Any]) -> None:
    _needs_nixl()
    results = _launch(
        3,
        task=ChunkwiseTask,
        comm=CommunicatorType.NIXL_RDT,
        num_producers=1,
        num_consumers=2,
        syncs=4,
        shapes=shapes,
        config=_STEADY,
    )
    _assert_verified(results, 4)
    assert _replayed(results) == [[False, True, True, True]] + [[False] * 4] * 2


class SlowSwapTask(SwappingStorageTask):
    """Two pipeline-stage producers; before sync 3 producer ``slow`` swaps its storage (so it
    goes chunk by chunk) and takes 1.2 s to open each group it serves, 2.4 s or more in all:
    longer than the stall timeout, while every single wait stays within it."""

    def before_producer_sync(self, step: int, source: Any, slow: int = 0, **kw: Any) -> None:
        if self.coordinator.get_rank() != slow:
            LlamaTransferTask.before_producer_sync(self, step, source, **kw)
            return
        if step == 3:
            for t in self._state.values():
                t.data = torch.empty_like(t.data)
            opener = source.open_group

            def open_slowly(names: Any) -> Any:
                time.sleep(1.2)
                return opener(names)

            source.open_group = open_slowly
        LlamaTransferTask.before_producer_sync(self, step, source, **kw)


@pytest.mark.parametrize("slow", [0, 1])
@distributed_test(timeout=150)
def test_replay_beside_a_slow_chunkwise_producer(shapes: dict[str, Any], slow: int) -> None:
    """Producer ``1 - slow`` replays sync 4 (the last: a producer runs ahead into its next
    sync) while the consumers read producer ``slow`` chunk by chunk for longer than the stall
    timeout: the replayed producer hears 'done' as soon as its reads land, not after the slow
    one, whichever comes first in plan order."""
    _needs_nixl()
    results = _launch(
        4,
        task=SlowSwapTask,
        comm=CommunicatorType.NIXL_RDT,
        num_producers=2,
        num_consumers=2,
        syncs=4,
        shapes=shapes,
        stages=True,
        slow=slow,
        config=replace(_STEADY, stall_timeout=2.0, announce_bytes=0),
    )
    _assert_verified(results, 4)
    replayed = _replayed(results)
    assert replayed[1 - slow][2:] == [True, True] and replayed[slow][2:] == [True, False]
    assert [r[3] for r in replayed[2:]] == [False, False], replayed  # mixed: not whole
    seconds = [r["syncs"][3]["seconds"] for r in results]
    # the slow producer held its consumer past the stall timeout; the other did not wait
    assert seconds[slow] > 2.0 and seconds[1 - slow] < seconds[slow], seconds


class SlowStageTask(LlamaTransferTask):
    """Two pipeline-stage producers read chunk by chunk; from sync 1 on, producer 0 (the
    first stage: first in every consumer's plan) takes 1.8 s to open each group it serves."""

    def before_producer_sync(self, step: int, source: Any, **kw: Any) -> None:
        if self.coordinator.get_rank() == 0 and step == 1:
            opener = source.open_group

            def open_slowly(names: Any) -> Any:
                time.sleep(1.8)
                return opener(names)

            source.open_group = open_slowly
        super().before_producer_sync(step, source, **kw)


@distributed_test(timeout=150)
def test_read_path_slow_stage_does_not_stall_the_other(shapes: dict[str, Any]) -> None:
    """Consumers read in plan order: while they take the slow first stage's chunks, for longer
    than the stall timeout in all, the second stage waits for their 'done' with its slot full.
    Their 'alive' messages keep it waiting instead of failing the sync on a consumer that is
    only busy; every sync is byte-exact."""
    _needs_nixl()
    results = _launch(
        4,
        task=SlowStageTask,
        comm=CommunicatorType.NIXL_RDT,
        num_producers=2,
        num_consumers=2,
        syncs=3,
        shapes=shapes,
        stages=True,
        config=TransferConfig(
            workers_per_replica=2, ring_slots=1, replay=False, stall_timeout=3.0, announce_bytes=0
        ),
        env={"VLLM_DIST_WT_TRACE": "1"},
    )
    _assert_verified(results, 3)
    seconds = [r["syncs"][2]["seconds"] for r in results]
    assert min(seconds) > 3.0, seconds  # the whole sync outlasted the stall timeout
    heard = {e for _, e in results[1]["trace"] if e.startswith("alive")}  # the last sync
    assert heard == {"alive 2", "alive 3"}, heard  # the second stage heard both consumers


class DyingInReplayConsumer(LlamaTransferTask):
    """Consumer 1 dies after the first replayed sync."""

    def after_consumer_sync(self, step: int, spec: Any, **kw: Any) -> Any:
        if step == 2 and self.coordinator.get_rank() == 2:
            import os

            os._exit(7)
        return super().after_consumer_sync(step, spec, **kw)


@distributed_test(timeout=120)
def test_consumer_death_ends_a_replayed_sync(shapes: dict[str, Any]) -> None:
    _needs_nixl()
    start = time.monotonic()
    producers, consumers = _launch_halves(
        _free_port(),
        LlamaTransferTask,
        DyingInReplayConsumer,
        90,
        syncs=5,
        shapes=shapes,
        comm=CommunicatorType.NIXL_RDT,
        config=replace(_STEADY, stall_timeout=5.0),
        coordinator_options={"timeout": 20.0},
    )
    # the dead consumer's launch ends its other rank too; that one shows up as failed when it
    # noticed the producers going away before the launcher stopped it
    assert isinstance(consumers, LaunchError) and 1 in consumers.ranks
    assert "exited with code 7" in str(consumers)
    assert isinstance(producers, LaunchError), producers
    assert "replayed sync" in str(producers), producers
    assert time.monotonic() - start < 60


@distributed_test(gpus=1, timeout=300)
def test_read_path_steady_state_replays_one_gpu(shapes: dict[str, Any]) -> None:
    """On one GPU the replayed reads are one CUDA graph per producer (strided reads into the
    consumers' parameters, staged bytes unpacked after); still byte-exact as weights change."""
    _needs_nixl()
    results = _one_to_two(
        "cuda",
        syncs=5,
        shapes=shapes,
        config=_STEADY,
    )
    _assert_verified(results, 5)
    assert _replayed(results) == [[False, False, True, True, True]] * 3


class PlainOneSided(NixlRdtCommunicator):
    """A one-sided plugin without ``prepare_reads``: replays post the recorded reads through
    ``read_batch_async`` / ``read_strided_async`` every sync."""

    prepare_reads = None  # type: ignore[assignment]


register_communicator("test_plain_one_sided", PlainOneSided, override=True)


@distributed_test(timeout=150)
def test_replay_without_prepared_reads(shapes: dict[str, Any]) -> None:
    _needs_nixl()
    results = _launch(
        3,
        comm="test_plain_one_sided",  # type: ignore[arg-type]
        communicator_options={"timeout": 30.0},
        num_producers=1,
        num_consumers=2,
        syncs=4,
        shapes=shapes,
        config=_STEADY,
    )
    _assert_verified(results, 4)
    assert _replayed(results) == [[False, True, True, True]] * 3  # the arena: sync 1 in place


# -- the push path on NCCL -----------------------------------------------------------------------
# PYNCCL and torch.distributed's NCCL backend: sends and receives in the fleet order, queued on
# the stream. With fewer GPUs than ranks the ranks share them (``nccl_env``: NCCL's socket
# transport on loopback), so these run on one GPU as well.
_NCCL = ["pynccl", "torch_distributed"]


def _launch_nccl(n: int, comm: str, **kw: Any) -> list[dict[str, Any]]:
    return _launch(
        n, timeout=240, comm=CommunicatorType(comm), device="cuda", env=nccl_env(n), **kw
    )


@pytest.mark.parametrize("comm", _NCCL)
@distributed_test(gpus=6, timeout=300, share=True)
def test_push_path_nccl_llama_tp2_two_replicas(shapes: dict[str, Any], comm: str) -> None:
    results = _launch_nccl(
        6,
        comm,
        num_producers=2,
        num_consumers=4,
        syncs=3,
        shapes=shapes,
        config=TransferConfig(workers_per_replica=2, direct_bytes=4096),
    )
    _assert_verified(results, 3)
    assert summarize(results)["path"] == "send_recv"


@pytest.mark.parametrize("split", ["stages", "experts"])
@distributed_test(gpus=4, timeout=300, share=True)
def test_push_path_nccl_experts_and_deep_rings(shapes: dict[str, Any], split: str) -> None:
    """The fleet order on NCCL, where an order cycle would hang the GPU: experts dealt out
    between two producers (a consumer's chunks of one layer interleave producers), and
    pipeline stages with rings deeper than the groups."""
    config = TransferConfig(ring_slots=8, max_chunk_bytes=4096, align=512, stall_timeout=30.0)
    results = _launch_nccl(
        4,
        "pynccl",
        task=SplitExpertsTask if split == "experts" else LlamaTransferTask,
        num_producers=2,
        num_consumers=2,
        syncs=3,
        shapes=_with_experts(shapes, 16),
        stages=split == "stages",
        config=config,
    )
    _assert_verified(results, 3)
    producers = [r for r in results if r["role"] == "producer"]
    assert all(r["syncs"][0]["chunks"] > 8 for r in producers)


@distributed_test(gpus=3, timeout=300, share=True)
def test_push_path_nccl_storage_swap_and_restart(shapes: dict[str, Any]) -> None:
    swapped = _launch_nccl(
        3,
        "pynccl",
        task=SwappingStorageTask,
        num_producers=1,
        num_consumers=2,
        syncs=4,
        shapes=shapes,
        config=TransferConfig(workers_per_replica=2, direct_bytes=4096),
    )
    _assert_verified(swapped, 4)
    rejoined = _launch_nccl(
        3, "pynccl", task=RejoinTask, shapes=shapes, config=TransferConfig(workers_per_replica=2)
    )
    assert rejoined[0] == ""
    assert rejoined[1] == [(0, True), (1, True), (2, True), (3, True)]
    assert rejoined[2] == [(1, True), (2, True), (3, True)]


@distributed_test(gpus=3, timeout=300, share=True)
def test_push_path_nccl_consumer_death_ends_the_producers_sync(shapes: dict[str, Any]) -> None:
    start = time.monotonic()
    producers, consumers = _launch_halves(
        _free_port(),
        LlamaTransferTask,
        DyingConsumer,
        150,
        comm=CommunicatorType.PYNCCL,
        device="cuda",
        syncs=3,
        shapes=shapes,
        config=TransferConfig(stall_timeout=10.0),
        coordinator_options={"timeout": 30.0},
    )
    assert isinstance(consumers, LaunchError) and 1 in consumers.ranks
    assert isinstance(producers, LaunchError), producers
    # NCCL may take the live consumer's pair down with the dead one's: the dead one is named
    named = re.search(r"consumer\(s\) \[([\d, ]+)\] failed", str(producers))
    assert (named and "1" in named.group(1).split(", ")) or "stall" in str(producers), producers
    assert time.monotonic() - start < 120


def test_vram_arena_bundles_follow_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """``share_gpu_weights`` moves the weights that travel in chunks of several, in chunk
    order, each weight once, into arenas cut between chunks (a chunk that spanned two arenas
    would be packed); single-item chunks, consumers that do not map, and weights that share a
    storage (a flat buffer) stay out."""
    from types import SimpleNamespace

    from vllm_dist.tasks.weight_transfer import exposure

    monkeypatch.setattr(exposure, "DEVICE_ARENA_BYTES", 9 * 1024 + 512)
    tensors = {f"w{i}": torch.zeros(256) for i in range(12)}  # 1 KiB each
    flat = torch.zeros(512)
    tensors |= {"f0": flat[:256], "f1": flat[256:]}  # a flat buffer: one home already

    def pair(maps: bool, chunks: list[list[str]]) -> SimpleNamespace:
        made = [SimpleNamespace(index=k, items=tuple(range(len(c)))) for k, c in enumerate(chunks)]
        views = {k: SimpleNamespace(names=c) for k, c in enumerate(chunks)}
        return SimpleNamespace(maps=maps, chunks=made, views=views)

    fake = SimpleNamespace(
        _pairs={
            2: pair(True, [["w0", "w1", "w2", "w3"], ["w4"], ["w5", "f0", "w6", "w7", "w8"]]),
            3: pair(True, [["w1", "w0", "w9"], ["w10", "w5", "f1"]]),  # seen ones: moved once
            4: pair(False, [["w11", "w3"]]),  # reads through NIXL: its chunks do not count
        }
    )
    bundles = exposure.chunk_bundles(fake._pairs.values(), tensors)  # type: ignore[arg-type]
    names = {id(t): n for n, t in tensors.items()}
    assert [[names[id(t)] for t in b] for b in bundles] == [
        ["w0", "w1", "w2", "w3", "w5", "w6", "w7", "w8", "w9"],
        ["w10"],
    ]
