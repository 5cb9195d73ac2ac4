"""Tensor-parallel loaders the way an inference engine writes them, and a Llama layout.

Consumers of this task give their own ``loader(dest, src)``; these are the common ones
(column / row parallel, vocab parallel, fused QKV and gate-up), used by the demo, the tests
and the benchmark. They run unchanged on real tensors, which is how tests compute the slice a
consumer must end up with.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from vllm_dist.tasks.weight_transfer import Loader


def replicated() -> Loader:
    """The whole weight (norms, biases of row-parallel layers)."""

    def load(dest: Any, src: Any) -> None:
        dest.copy_(src)

    return load


def column_parallel(tp_rank: int, tp_size: int, dim: int = 0) -> Loader:
    """This rank's ``1/tp_size`` of ``dim`` (dim 0: column parallel; dim 1: row parallel)."""

    def load(dest: Any, src: Any) -> None:
        n = src.shape[dim] // tp_size
        dest.copy_(src.narrow(dim, tp_rank * n, n))

    return load


def row_parallel(tp_rank: int, tp_size: int) -> Loader:
    """This rank's slice of the input dimension, taken with ``chunk``."""

    def load(dest: Any, src: Any) -> None:
        dest.copy_(src.chunk(tp_size, dim=1)[tp_rank])

    return load


def transposed_row_parallel(tp_rank: int, tp_size: int) -> Loader:
    """Row parallel into a destination stored transposed (``[in / tp, out]``)."""

    def load(dest: Any, src: Any) -> None:
        n = src.shape[1] // tp_size
        dest.copy_(src.narrow(1, tp_rank * n, n).t())

    return load


def fused_shard(offset: int, tp_rank: int, tp_size: int) -> Loader:
    """This rank's rows of one part of a fused weight, at ``offset`` rows of the destination."""

    def load(dest: Any, src: Any) -> None:
        n = src.shape[0] // tp_size
        dest.narrow(0, offset, n).copy_(src[tp_rank * n : (tp_rank + 1) * n])

    return load


Shapes = Mapping[str, tuple[tuple[int, ...], torch.dtype]]


def llama_tp_layout(
    shapes: Shapes,
    tp_rank: int,
    tp_size: int,
    device: torch.device | str = "cpu",
    *,
    transposed_down: bool = True,
) -> tuple[dict[str, torch.Tensor], dict[str, list[tuple[str, Loader]]]]:
    """Parameters and routes of one tensor-parallel rank of a Hugging Face Llama.

    ``shapes`` maps every HF name to (shape, dtype). q/k/v go into a fused column-parallel
    ``qkv_proj``, gate/up into ``gate_up_proj``, o/down are row parallel, embeddings and the LM
    head vocab parallel, Mixtral-style experts (``...experts.<e>.w1/w3/w2.weight``) like the MLP,
    norms replicated. ``transposed_down``: ``down_proj`` is stored transposed (``[in / tp,
    out]``, as kernels that want K-major weights keep it) instead of vLLM's ``[out, in / tp]``.
    Returns (params, routes by HF name).
    """
    params: dict[str, torch.Tensor] = {}
    routes: dict[str, list[tuple[str, Loader]]] = {}

    def alloc(name: str, shape: Iterable[int], dtype: torch.dtype) -> None:
        if name not in params:
            params[name] = torch.zeros(tuple(shape), dtype=dtype, device=device)

    for name, (shape, dtype) in shapes.items():
        prefix, _, leaf = name.rpartition(".")
        module = prefix.rpartition(".")[2]
        parent = prefix.rpartition(".")[0]
        if module in ("q_proj", "k_proj", "v_proj"):
            q, k, v = (shapes[f"{parent}.{m}.{leaf}"][0][0] for m in ("q_proj", "k_proj", "v_proj"))
            offset = {"q_proj": 0, "k_proj": q, "v_proj": q + k}[module] // tp_size
            fused = f"{parent}.qkv_proj.{leaf}"
            alloc(fused, ((q + k + v) // tp_size, *shape[1:]), dtype)
            routes[name] = [(fused, fused_shard(offset, tp_rank, tp_size))]
        elif module in ("gate_proj", "up_proj"):
            inter = shape[0]
            fused = f"{parent}.gate_up_proj.{leaf}"
            alloc(fused, (2 * inter // tp_size, *shape[1:]), dtype)
            offset = 0 if module == "gate_proj" else inter // tp_size
            routes[name] = [(fused, fused_shard(offset, tp_rank, tp_size))]
        elif module == "down_proj" and leaf == "weight" and transposed_down:
            alloc(name, (shape[1] // tp_size, shape[0]), dtype)  # stored transposed
            routes[name] = [(name, transposed_row_parallel(tp_rank, tp_size))]
        elif module in ("o_proj", "down_proj") and leaf == "weight":
            alloc(name, (shape[0], shape[1] // tp_size), dtype)
            routes[name] = [(name, row_parallel(tp_rank, tp_size))]
        elif ".experts." in name and module in ("w1", "w3", "w2") and leaf == "weight":
            # Mixtral-style experts, each sharded like the MLP it is: w1 / w3 (gate / up)
            # column parallel, w2 (down) row parallel
            if module == "w2":
                alloc(name, (shape[0], shape[1] // tp_size), dtype)
                routes[name] = [(name, row_parallel(tp_rank, tp_size))]
            else:
                alloc(name, (shape[0] // tp_size, *shape[1:]), dtype)
                routes[name] = [(name, column_parallel(tp_rank, tp_size))]
        elif module in ("embed_tokens", "lm_head"):
            alloc(name, (shape[0] // tp_size, *shape[1:]), dtype)
            routes[name] = [(name, column_parallel(tp_rank, tp_size))]
        else:
            alloc(name, shape, dtype)
            routes[name] = [(name, replicated())]
    return params, routes


def expected_params(
    params: Mapping[str, torch.Tensor],
    routes: Mapping[str, list[tuple[str, Loader]]],
    full: Mapping[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """What ``params`` must hold after a sync of ``full``: the loaders run on real tensors."""
    out = {n: torch.empty_like(t) for n, t in params.items()}
    for name, targets in routes.items():
        for pname, loader in targets:
            loader(out[pname], full[name])
    return out


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (any dtype)."""
    data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


def fill_weights(state: Mapping[str, torch.Tensor], seed: int, step: int) -> None:
    """Overwrite every tensor with values that depend only on (seed, step, name)."""
    for name, t in state.items():
        g = torch.Generator().manual_seed(_seed(seed, step, name))
        with torch.no_grad():
            t.copy_(torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype))


def _seed(seed: int, step: int, name: str) -> int:
    h = hashlib.blake2b(f"{seed}/{step}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 62) - 1)


TINY_LLAMA: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)


def tiny_llama_config(**overrides: Any) -> Any:
    """A 2-layer Llama config small enough for CPU tests (no download); needs transformers."""
    return _transformers().LlamaConfig(**{**TINY_LLAMA, **overrides})


def _transformers() -> Any:
    """The transformers module, or an ImportError that says what to install instead."""
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            f"the Hugging Face Llama classes need transformers ({exc}): pip install transformers; "
            "tiny_llama_shapes() gives the same shapes without it"
        ) from exc
    return transformers


def tiny_llama_shapes(dtype: torch.dtype = torch.bfloat16, **overrides: Any) -> dict[str, Any]:
    """HF name -> (shape, dtype) of ``LlamaForCausalLM(tiny_llama_config(**overrides))``,
    in its ``state_dict`` order, from the config numbers alone: transformers is not needed."""
    c = {**TINY_LLAMA, **overrides}
    hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    head = c.get("head_dim") or hidden // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head, c["num_key_value_heads"] * head
    layer = {
        "self_attn.q_proj.weight": (q, hidden),
        "self_attn.k_proj.weight": (kv, hidden),
        "self_attn.v_proj.weight": (kv, hidden),
        "self_attn.o_proj.weight": (hidden, q),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
    }
    shapes: dict[str, Any] = {"model.embed_tokens.weight": ((vocab, hidden), dtype)}
    for i in range(c["num_hidden_layers"]):
        for leaf, shape in layer.items():
            shapes[f"model.layers.{i}.{leaf}"] = (shape, dtype)
    shapes["model.norm.weight"] = ((hidden,), dtype)
    shapes["lm_head.weight"] = ((vocab, hidden), dtype)  # listed even when tied, as HF does
    return shapes


def build_llama(config: Any, dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised ``LlamaForCausalLM`` from ``config`` (nothing is downloaded)."""
    torch.manual_seed(seed)
    model: torch.nn.Module = _transformers().LlamaForCausalLM(config)
    model.to(dtype=dtype)
    model.requires_grad_(False)
    return model


def llama_shapes(config: Any, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """HF name -> (shape, dtype) of a Llama from ``config``, built on the meta device."""
    with torch.device("meta"):
        model = _transformers().LlamaForCausalLM(config)
    return {n: (tuple(t.shape), dtype) for n, t in model.state_dict().items()}
