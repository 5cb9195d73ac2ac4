"""Weight transfer: per-sync time and GB/s against the communicator's own raw point-to-point.

Question: how much of the data path's bandwidth does a weight sync keep, and how long does
set-up take? One producer holds a synthetic bf16 Llama-shaped model (real HF names; the hidden
size of a real model of that size unless ``--hidden`` says otherwise) and ``--consumers`` TP-2
consumers load it the way an inference engine does (fused QKV / gate-up, row-parallel o / down,
vocab-parallel embeddings; ``--layout transposed`` stores down_proj transposed). In the same
launch, after the syncs, every consumer moves the same number of bytes with the communicator's
own transfer of one preallocated tensor (a one-sided READ when the sync used the READ path,
else ``send``/``recv``, all consumers at once): that is the raw p2p baseline. The weights change
before the first and the last sync; both are checked byte for byte unless ``--no-verify``.
From the third sync on, the model's tensors being where they were, each sync is a replay of
the last (one message per consumer; the engine's "Steady state"); ``--no-replay`` measures the
chunk-by-chunk path instead, which a trainer that moves its storage every step would get;
``--in-place`` has the source vouch for in-place writes (``StateDictSource(in_place=True)``),
so the steady-state check compares no tensor; ``--flat`` keeps the producer's weights in one
flat buffer, as Megatron's parameter buffers do (with strided reads, consumers then read small
weights in place too: nothing is packed).
A many-tensors case (``--many``: 100,000 small expert tensors, like a large MoE) measures
set-up (bake + plan) time and per-sync overhead with many names.

Case names give the model size asked for in MB (10^6 bytes; "llama 100 MB" asks for 100 MB,
95.4 MiB). The generated model (the "model" column) has whole layers, at least one, plus the
embeddings and lm_head (32 MiB at hidden 1024), so it can differ, a small one by a lot; "moved"
is what all consumers receive per sync: their TP shards plus the replicated norms.

Targets: per-sync >= 50% of raw p2p; set-up for 100,000 names < 10 s; on one H200
(``--device cuda --comm nixl_rdt``), a 16 GB model in under 50 ms.

    python benchmarks/weight_transfer.py [--sizes 100,400] [--many 100000] [--consumers 2]
        [--syncs 3] [--out bench_results/weight_transfer.json]
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import threading
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks._common import (  # noqa: E402
    CaseProgress,
    human,
    make_parser,
    print_table,
    write_outputs,
)
from vllm_dist import CommunicatorType, CoordinatorType, MPLauncher  # noqa: E402
from vllm_dist.examples.llama_tp import (  # noqa: E402
    column_parallel,
    expected_params,
    llama_tp_layout,
    row_parallel,
    tensor_digest,
)
from vllm_dist.examples.weight_sync_demo import allocate  # noqa: E402
from vllm_dist.implementations.communicators.common import shared_gpu_nccl_env  # noqa: E402
from vllm_dist.memory import shared_empty  # noqa: E402
from vllm_dist.serialization import register_by_value  # noqa: E402
from vllm_dist.tasks.weight_transfer import (  # noqa: E402
    ConsumerSpec,
    StateDictSource,
    TransferConfig,
    WeightSource,
    WeightTransferTask,
)

MB = 1_000_000


def auto_hidden(target_bytes: int) -> int:
    """The hidden size of a real Llama-family model of about this many bf16 bytes (1B: 2048,
    8B: 4096, 70B: 8192), so a "16 GB" case has 8B-like layers, not 700 tiny ones."""
    for limit, hidden in ((1 << 30, 1024), (4 << 30, 2048), (40 << 30, 4096)):
        if target_bytes < limit:
            return hidden
    return 8192


def llama_like_shapes(target_bytes: int, hidden: int = 1024) -> dict[str, Any]:
    """HF-named bf16 Llama shapes with as many layers as reach ``target_bytes``."""
    inter, vocab, kv = hidden * 11 // 4, 8192, hidden // 4
    layer = {
        "self_attn.q_proj.weight": (hidden, hidden),
        "self_attn.k_proj.weight": (kv, hidden),
        "self_attn.v_proj.weight": (kv, hidden),
        "self_attn.o_proj.weight": (hidden, hidden),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
    }
    layer_bytes = 2 * sum(torch.Size(s).numel() for s in layer.values())
    fixed = 2 * (2 * vocab * hidden + hidden)
    n_layers = max(1, round((target_bytes - fixed) / layer_bytes))
    shapes: dict[str, Any] = {"model.embed_tokens.weight": ((vocab, hidden), torch.bfloat16)}
    for i in range(n_layers):
        for leaf, s in layer.items():
            shapes[f"model.layers.{i}.{leaf}"] = (s, torch.bfloat16)
    shapes["model.norm.weight"] = ((hidden,), torch.bfloat16)
    shapes["lm_head.weight"] = ((vocab, hidden), torch.bfloat16)
    return shapes


def moe_shapes(num_tensors: int, layers: int = 32) -> dict[str, Any]:
    """``num_tensors`` small expert weights (w1 / w3: [64, 32], w2: [32, 64]) over ``layers``."""
    experts = max(1, num_tensors // (3 * layers))
    shapes: dict[str, Any] = {}
    for i in range(layers):
        for e in range(experts):
            base = f"model.layers.{i}.mlp.experts.{e}"
            shapes[f"{base}.w1.weight"] = ((64, 32), torch.bfloat16)
            shapes[f"{base}.w3.weight"] = ((64, 32), torch.bfloat16)
            shapes[f"{base}.w2.weight"] = ((32, 64), torch.bfloat16)
    return shapes


def moe_layout(
    shapes: dict[str, Any], tp_rank: int, tp_size: int, device: Any = "cpu", fused: bool = False
) -> tuple[dict, dict]:
    """A TP shard of every expert weight: a tensor each, or (``fused``) views of two tensors
    per layer, as vLLM's FusedMoE keeps them (``w13_weight`` [E, 2 I/tp, H] with gate rows then
    up rows per expert, ``w2_weight`` [E, H, I/tp]), where its loader copies expert e's shard."""
    params: dict[str, torch.Tensor] = {}
    routes: dict[str, Any] = {}
    experts = 1 + max(int(n.split(".")[5]) for n in shapes)
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, (shape, dtype) in shapes.items():
        w2 = name.endswith("w2.weight")
        part = (shape[0], shape[1] // tp_size) if w2 else (shape[0] // tp_size, shape[1])
        if fused:
            layer, expert = name.rsplit(".", 4)[0], int(name.split(".")[5])
            if layer not in layers:
                w1_part = (shape[0] // tp_size, shape[1]) if not w2 else (shape[1], shape[0])
                layers[layer] = (
                    torch.zeros(experts, 2, *w1_part, dtype=dtype, device=device),
                    torch.zeros(experts, w1_part[1], w1_part[0], dtype=dtype, device=device),
                )
            w13_weight, w2_weight = layers[layer]
            which = None if w2 else int(name.endswith("w3.weight"))
            params[name] = w2_weight[expert] if which is None else w13_weight[expert, which]
            assert tuple(params[name].shape) == part, (name, params[name].shape, part)
        else:
            params[name] = torch.zeros(*part, dtype=dtype, device=device)
        loader = row_parallel if w2 else column_parallel
        routes[name] = [(name, loader(tp_rank, tp_size))]
    return params, routes


def fast_fill(state: dict[str, torch.Tensor], step: int) -> None:
    """Cheap deterministic contents (finite bf16) that change every step."""
    for i, t in enumerate(state.values()):
        n = t.numel()
        vals = (
            torch.arange(n, dtype=torch.int32, device=t.device) % 251 + (i * 7 + step * 13) % 97
        ).to(t.dtype)
        t.copy_(vals.view(t.shape))


class BenchTask(WeightTransferTask):
    """Synthetic model; verifies the first and the last sync (the weights change in between,
    and the last sync runs the steady-state path: sources read in place); measures raw p2p
    for the same bytes."""

    def make_source(
        self,
        producer_idx: int,
        num_producers: int,
        shapes: Any = None,
        in_place: bool = False,
        flat: bool = False,
        **_: Any,
    ) -> WeightSource:
        self._state = allocate(shapes, self.device, flat=flat)
        return StateDictSource(self._state, in_place=in_place)

    def before_producer_sync(
        self, step: int, source: WeightSource, syncs: int = 1, **_: Any
    ) -> None:
        if step in (0, syncs - 1):  # new weights for the first and the last (timed) sync
            fast_fill(self._state, step)
        self.coordinator.barrier()

    def make_consumer(
        self,
        consumer_idx: int,
        num_consumers: int,
        shapes: Any = None,
        moe: bool = False,
        transposed_down: bool = False,
        fused_experts: bool = False,
        **_: Any,
    ) -> ConsumerSpec:
        if moe:
            params, routes = moe_layout(
                shapes, consumer_idx % 2, 2, self.device, fused=fused_experts
            )
        else:
            params, routes = llama_tp_layout(
                shapes, consumer_idx % 2, 2, self.device, transposed_down=transposed_down
            )
        self._routes, self._shapes = routes, shapes
        return ConsumerSpec(params=params, route=lambda n: routes.get(n, []))

    def before_consumer_sync(self, step: int, spec: ConsumerSpec, **_: Any) -> None:
        self.coordinator.barrier()

    def after_consumer_sync(
        self, step: int, spec: ConsumerSpec, verify: bool = True, syncs: int = 1, **_: Any
    ) -> Any:
        if step not in (0, syncs - 1) or not verify:
            return None
        full = {n: torch.zeros(s, dtype=d) for n, (s, d) in self._shapes.items()}
        fast_fill(full, step)
        want = expected_params(spec.params, self._routes, full)
        return all(tensor_digest(t) == tensor_digest(want[n]) for n, t in spec.params.items())

    def post_init_distributed(self, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        if kwargs.get("dump_after"):  # where is each rank after that long (a stuck run)
            faulthandler.dump_traceback_later(kwargs["dump_after"], file=sys.stderr)
        result = super().post_init_distributed(**kwargs)
        result["raw"] = self._raw_p2p(result, kwargs["num_producers"], kwargs.get("syncs", 1))
        faulthandler.cancel_dump_traceback_later()
        return result

    def _raw_p2p(self, result: dict[str, Any], num_producers: int, iters: int) -> list[float]:
        """Seconds per round of the communicator's own transfer of the same bytes per consumer:
        one-sided READs when the sync used the READ path, plain send/recv otherwise. The
        producer's buffers are where its fastest READ comes from (on the CPU, shared memory
        that a consumer maps when its communicator can)."""
        nbytes = self.coordinator.all_gather_object(
            result["syncs"][0]["bytes"] if result["role"] == "consumer" else 0
        )
        rank = self.coordinator.get_rank()
        times = []
        dev = self.communicator.device
        bufs = {
            c: shared_empty(nbytes[c], dev).fill_(1)
            for c in range(num_producers, len(nbytes))
            if rank < num_producers or c == rank
        }
        if result["syncs"][0]["path"] == "read":
            return self._raw_read(bufs, num_producers, iters)
        for _ in range(iters):
            self.coordinator.barrier()
            start = time.perf_counter()
            if rank == 0 and dev.type == "cuda":  # NCCL: one thread, queued in stream order
                for c, b in bufs.items():
                    self.communicator.send(b, c)
            elif rank == 0:
                threads = [
                    threading.Thread(target=self.communicator.send, args=(b, c))
                    for c, b in bufs.items()
                ]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
            elif rank >= num_producers:
                self.communicator.recv(bufs[rank], 0)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - start)
        # A sender's stream can be done while its NCCL proxy still holds bytes on their way
        # (socket transport); a sender that left now would strand them in the receivers' recv.
        self.coordinator.barrier()
        return times

    def _raw_read(
        self, bufs: dict[int, torch.Tensor], num_producers: int, iters: int
    ) -> list[float]:
        comm: Any = self.communicator
        rank = self.coordinator.get_rank()
        if rank == 0:
            for c, b in bufs.items():
                comm.expose(b, f"raw-c{c}")
        comm.exchange_exposed()
        times = []
        for _ in range(iters):
            self.coordinator.barrier()
            start = time.perf_counter()
            if rank >= num_producers:
                comm.read_async(0, f"raw-c{rank}", bufs[rank]).wait(300.0)
            self.coordinator.barrier()  # the producer's round ends when every read has
            times.append(time.perf_counter() - start)
        return times


def run_case(
    label: str, shapes: dict[str, Any], args: argparse.Namespace, moe: bool
) -> dict[str, Any]:
    n = 1 + args.consumers
    config = TransferConfig(
        workers_per_replica=2,
        max_chunk_bytes=args.chunk_mib << 20,
        ring_slots=args.slots,
        direct_bytes=args.direct_kib << 10,
        announce_bytes=args.announce_mib << 20,
        strided_reads={"auto": None, "on": True, "off": False}[args.strided],
        mapped_unpack=not args.no_mapped_unpack,
        replay=not args.no_replay,
        gather_cpu_params=not args.no_gather_params,
        atomic=args.atomic,
    )
    # one intra-op thread per worker, as torchrun sets: workers share the cores
    env = {"OMP_NUM_THREADS": str(args.threads)}
    if args.trace:
        env["VLLM_DIST_WT_TRACE"] = "1"
    if args.share_gpu:
        env.update(shared_gpu_nccl_env())
    comm = CommunicatorType(args.comm)
    results = MPLauncher(n, timeout=args.timeout, env=env).launch(
        task_type=BenchTask,
        coordinator_type=CoordinatorType.TORCH_DISTRIBUTED,
        communicator_type=comm,
        device=args.device,
        communicator_options={"timeout": args.timeout}
        if comm == CommunicatorType.NIXL_RDT
        else None,
        coordinator_options={"timeout": args.timeout},
        num_producers=1,
        num_consumers=args.consumers,
        syncs=args.syncs,
        config=config,
        shapes=shapes,
        moe=moe,
        in_place=args.in_place,
        flat=args.flat,
        fused_experts=args.fused_experts,
        transposed_down=args.layout == "transposed",
        verify=not args.no_verify,
        dump_after=args.dump_after,
    )
    consumers = [r for r in results if r["role"] == "consumer"]
    moved = sum(r["syncs"][0]["bytes"] for r in consumers)
    per_sync = [max(r["syncs"][s]["seconds"] for r in results) for s in range(args.syncs)]
    raw = [max(r["raw"][s] for r in results) for s in range(args.syncs)]
    sync_s, raw_s = min(per_sync), min(raw)
    return {
        "case": label,
        "comm": args.comm,
        "layout": args.layout,
        "strided": args.strided,
        "path": consumers[0]["syncs"][0]["path"],
        "model_bytes": sum(torch.Size(s).numel() * d.itemsize for s, d in shapes.values()),
        "tensors": len(shapes),
        "bytes_moved": moved,
        "chunks": sum(r["syncs"][0]["chunks"] for r in consumers),
        "replayed_last_sync": all(r["syncs"][-1]["replayed"] for r in results),
        "packed_last_sync": {
            f"{r['role']} {r['index']}": r["syncs"][-1]["packed"] for r in results
        },
        "sync_s": sync_s,
        "replay": not args.no_replay,
        "mapped_unpack": not args.no_mapped_unpack,
        "gather_params": not args.no_gather_params,
        "atomic": args.atomic,
        "in_place": args.in_place,
        "flat": args.flat,
        "fused_experts": args.fused_experts,
        "sync_all_s": per_sync,
        "gb_s": moved / sync_s / 1e9,
        "raw_s": raw_s,
        "raw_gb_s": moved / raw_s / 1e9,
        "ratio": raw_s / sync_s,
        "setup_s": max(r["setup_seconds"] for r in results),
        "bake_s": max(r.get("bake_seconds", 0.0) for r in results),
        "setup_phases": {f"{r['role']} {r['index']}": r.get("setup_phases") for r in results},
        "verified": all(o is not False for r in consumers for o in r["outputs"]),
        "traces": _traces(results),
        "raw_baseline": raw_baseline(consumers[0]["syncs"][0]["path"]),
    }


def raw_baseline(path: str) -> str:
    """Which raw transfer a case's ``raw`` columns timed (see ``BenchTask._raw_p2p``)."""
    return "READ" if path == "read" else "send/recv"


def _summary(row: dict[str, Any]) -> str:
    return (
        f"{human(row['model_bytes'])} model, {human(row['bytes_moved'])} moved, "
        f"{row['sync_s'] * 1e3:.2f} ms per sync, {row['ratio']:.2f}x raw "
        f"{row['raw_baseline']}, verified {row['verified']}"
    )


def _traces(results: list[dict[str, Any]]) -> dict[str, list[tuple[float, str]]]:
    """The last sync's event timeline of every rank, in µs since the earliest sync start."""
    traced = [r for r in results if r.get("trace")]
    if not traced:
        return {}
    t0 = min(r["trace"][0][0] for r in traced)
    return {
        f"{r['role']} {r['index']}": [(round((t - t0) * 1e6, 1), e) for t, e in r["trace"]]
        for r in traced
    }


def main() -> None:
    ap = make_parser(__doc__, whole=True)
    ap.add_argument(
        "--sizes", default="100,400", help="model sizes in MB (e.g. 100,1000,4000; 0: none)"
    )
    ap.add_argument(
        "--many", type=int, default=100_000, help="tensors of the many-tensors case (0: skip)"
    )
    ap.add_argument("--consumers", type=int, default=2, help="TP-2 consumers (a multiple of 2)")
    ap.add_argument("--syncs", type=int, default=3, help="syncs per case (the last is timed)")
    ap.add_argument("--slots", type=int, default=2, help="serve-ring slots K")
    ap.add_argument("--chunk-mib", type=int, default=64, help="largest chunk a read moves, MiB")
    ap.add_argument(
        "--direct-kib", type=int, default=1024, help="items this large travel alone (in place)"
    )
    ap.add_argument(
        "--announce-mib",
        type=int,
        default=0,
        help="TransferConfig.announce_bytes in MiB (0: announce per gather group)",
    )
    ap.add_argument(
        "--hidden",
        default="auto",
        help="hidden size of the llama cases; auto: that of a real model of the size "
        "(1024 below 1 GiB, 2048 below 4 GiB, 4096 below 40 GiB)",
    )
    ap.add_argument(
        "--strided",
        choices=("auto", "on", "off"),
        default="auto",
        help="TransferConfig.strided_reads (auto: where the communicator maps peer memory)",
    )
    ap.add_argument(
        "--layout",
        choices=("vllm", "transposed"),
        default="vllm",
        help="consumer layout: vllm's (down_proj [out, in/tp]) or down_proj stored transposed",
    )
    ap.add_argument(
        "--fused-experts",
        action="store_true",
        help="many-tensors case: consumers keep each layer's experts in two fused tensors, as "
        "vLLM's FusedMoE does (w13_weight, w2_weight), instead of a tensor per expert weight",
    )
    ap.add_argument("--no-verify", action="store_true", help="skip the byte-for-byte checks")
    ap.add_argument(
        "--no-replay",
        action="store_true",
        help="TransferConfig(replay=False): every sync chunk by chunk, steady state included",
    )
    ap.add_argument(
        "--no-mapped-unpack",
        action="store_true",
        help="TransferConfig(mapped_unpack=False): packed chunks are read into staging, then "
        "unpacked, also where the consumer maps the producer's ring",
    )
    ap.add_argument(
        "--no-gather-params",
        action="store_true",
        help="TransferConfig(gather_cpu_params=False): CPU consumers leave their parameters "
        "where they are (100,000 tensors of their own) instead of moving them into one arena",
    )
    ap.add_argument(
        "--atomic",
        action="store_true",
        help="TransferConfig(atomic=True): consumers receive into a staging copy and commit "
        "it once the whole sync arrived (what never serving a torn model costs)",
    )
    ap.add_argument(
        "--in-place",
        action="store_true",
        help="StateDictSource(in_place=True): the steady-state check compares no tensor",
    )
    ap.add_argument(
        "--flat",
        action="store_true",
        help="the producer keeps its weights in one flat buffer (Megatron's parameter buffers): "
        "with strided reads, small weights are read in place too",
    )
    ap.add_argument(
        "--trace", action="store_true", help="record the last sync's event timeline per rank"
    )
    ap.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each worker")
    ap.add_argument(
        "--comm", default="torch_distributed", help="communicator: torch_distributed, nixl_rdt, ..."
    )
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (every worker on cuda:<local>)")
    ap.add_argument(
        "--share-gpu",
        action="store_true",
        help="NCCL ranks share the GPUs (shared_gpu_nccl_env: NCCL's socket transport)",
    )
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per case's launch")
    ap.add_argument(
        "--dump-after", type=float, default=0.0, help="every rank prints its stacks after S s"
    )
    ap.add_argument(
        "--out", default="bench_results/weight_transfer.json", help="JSON path; PNG beside"
    )
    args = ap.parse_args()
    register_by_value(sys.modules[__name__])
    cases: list[tuple[str, dict[str, Any], bool]] = []
    for mb in [int(s) for s in args.sizes.split(",") if s and int(s) > 0]:  # 0: none
        hidden = auto_hidden(mb * MB) if args.hidden == "auto" else int(args.hidden)
        cases.append((f"llama {mb} MB h{hidden}", llama_like_shapes(mb * MB, hidden), False))
    if args.many:
        cases.append((f"moe {args.many} tensors", moe_shapes(args.many), True))
    progress = CaseProgress(len(cases))
    rows = []
    for label, shapes, moe in cases:
        progress.start(label)
        rows.append(run_case(label, shapes, args, moe=moe))
        if not moe:
            rows[-1]["asked_bytes"] = int(label.split()[1]) * MB
            rows[-1]["layers"] = sum(n.endswith("q_proj.weight") for n in shapes)
        progress.done(label, _summary(rows[-1]))
    cols = [
        "case",
        "path",
        "tensors",
        "model",
        "moved",
        "chunks",
        "sync ms",
        "replay",
        "GB/s",
        "raw GB/s",
        "raw is",
        "ratio",
        "setup s",
        "bake s",
        "ok",
    ]
    table = print_table(
        f"weight transfer, 1 producer -> {args.consumers} TP-2 consumers, {args.comm} "
        f"on {args.device}",
        cols,
        [
            [
                r["case"],
                r["path"],
                r["tensors"],
                human(r["model_bytes"]),
                human(r["bytes_moved"]),
                r["chunks"],
                r["sync_s"] * 1e3,
                r["replayed_last_sync"],
                r["gb_s"],
                r["raw_gb_s"],
                r["raw_baseline"],
                r["ratio"],
                r["setup_s"],
                r["bake_s"],
                r["verified"],
            ]
            for r in rows
        ],
    )

    print(
        "case: model size asked for (MB = 10^6 bytes); model: the generated model (whole "
        "layers); moved: bytes all consumers receive per sync; raw: the communicator's own "
        "transfer (READ or send/recv) of the same bytes"
    )
    for r in rows:
        asked = r.get("asked_bytes")
        if asked and abs(r["model_bytes"] - asked) > asked / 10:
            print(
                f"{r['case']}: asked {asked / MB:g} MB ({human(asked)}), made "
                f"{human(r['model_bytes'])}: {r['layers']} whole layer(s) plus embeddings "
                "and lm_head"
            )

    def plot(png: str) -> None:
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.5))
        xs = range(len(rows))
        ax.bar([x - 0.2 for x in xs], [r["gb_s"] for r in rows], 0.4, label="weight sync")
        colors = {"READ": "tab:orange", "send/recv": "tab:green"}
        for kind, color in colors.items():  # one legend entry per baseline the cases used
            mine = [x for x in xs if rows[x]["raw_baseline"] == kind]
            if mine:
                ax.bar(
                    [x + 0.2 for x in mine],
                    [rows[x]["raw_gb_s"] for x in mine],
                    0.4,
                    color=color,
                    label=f"raw {kind} of the same bytes (baseline)",
                )
        ax.set_xticks(
            list(xs),
            [f"{r['case']}\n{human(r['bytes_moved'])} moved" for r in rows],
            rotation=15,
            fontsize=8,
        )
        ax.set_ylabel("GB/s (bytes received by consumers)")
        ax.set_title(f"weight transfer vs raw p2p, same communicator ({args.comm}, {args.device})")
        ax.margins(y=0.3)  # room for the legend above the bars
        ax.legend(loc="upper left", fontsize=8)
        fig.tight_layout()
        fig.savefig(png)

    write_outputs(args.out, {"args": vars(args), "rows": rows, "table": table}, plot)


if __name__ == "__main__":
    main()
