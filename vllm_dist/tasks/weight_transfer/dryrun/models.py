"""Hugging Face parameter names, shapes and dtypes of large models, from their configs' numbers.

A config is a small dict of the numbers that fix the state dict (hidden size, layers, heads,
experts, ...); ``model_metas`` writes the names in ``state_dict`` order, so the dry run plans
a trillion-parameter model without a byte of weights, a download or transformers. Rejected:
building the model with transformers on the meta device, which needs the remote code of
DeepSeek-style models and minutes of Python for 100,000 parameters.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

from vllm_dist.tasks.weight_transfer.source import WeightMeta

BF16 = "torch.bfloat16"
FP32 = "torch.float32"

LLAMA3_8B: dict[str, Any] = dict(
    family="llama",
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
)
LLAMA3_405B: dict[str, Any] = dict(
    family="llama",
    hidden_size=16384,
    intermediate_size=53248,
    num_hidden_layers=126,
    num_attention_heads=128,
    num_key_value_heads=8,
    head_dim=128,
    vocab_size=128256,
)
QWEN3_235B_A22B: dict[str, Any] = dict(
    family="qwen3_moe",
    hidden_size=4096,
    moe_intermediate_size=1536,
    num_hidden_layers=94,
    num_attention_heads=64,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    vocab_size=151936,
)
DEEPSEEK_V3: dict[str, Any] = dict(
    family="deepseek_v3",
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    first_k_dense_replace=3,
    num_attention_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=256,
    n_shared_experts=1,
    vocab_size=129280,
)
KIMI_K2: dict[str, Any] = {
    **DEEPSEEK_V3,
    "num_attention_heads": 64,
    "n_routed_experts": 384,
    "first_k_dense_replace": 1,
    "vocab_size": 163840,
}
GLM5_CLASS: dict[str, Any] = {
    # DeepSeek-V3-style MLA + MoE at GLM-5's scale (about 750B parameters); the numbers are
    # this project's assumption, not a published config
    **DEEPSEEK_V3,
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "num_hidden_layers": 78,
    "num_attention_heads": 64,
    "q_lora_rank": 2048,
    "vocab_size": 154880,
}

MODELS: dict[str, dict[str, Any]] = {
    "llama3-8b": LLAMA3_8B,
    "llama3-405b": LLAMA3_405B,
    "qwen3-235b-a22b": QWEN3_235B_A22B,
    "deepseek-v3": DEEPSEEK_V3,
    "kimi-k2": KIMI_K2,
    "glm5-class": GLM5_CLASS,
}


def model_metas(config: dict[str, Any], dtype: str = BF16) -> list[WeightMeta]:
    """Every weight of the model ``config`` describes, in its ``state_dict`` order."""
    family = config["family"]
    layer = {"llama": _llama_layer, "qwen3_moe": _qwen3_moe_layer, "deepseek_v3": _deepseek_layer}
    if family not in layer:
        raise ValueError(f"unknown model family {family!r}; known: {sorted(layer)}")
    h, vocab = config["hidden_size"], config["vocab_size"]
    interned: dict[tuple[int, ...], tuple[int, ...]] = {}
    out = [WeightMeta(name="model.embed_tokens.weight", dtype=dtype, shape=(vocab, h))]
    for i in range(config["num_hidden_layers"]):
        for leaf, shape, dt in layer[family](config, i):
            shape = interned.setdefault(shape, shape)  # one tuple per distinct shape
            out.append(WeightMeta(name=f"model.layers.{i}.{leaf}", dtype=dt or dtype, shape=shape))
    out.append(WeightMeta(name="model.norm.weight", dtype=dtype, shape=(h,)))
    out.append(WeightMeta(name="lm_head.weight", dtype=dtype, shape=(vocab, h)))
    return out


def model_bytes(metas: list[WeightMeta]) -> int:
    """Total bytes of ``metas``."""
    size = {BF16: 2, FP32: 4, "torch.float16": 2, "torch.float8_e4m3fn": 1}
    return sum(math.prod(m.shape) * size[m.dtype] for m in metas)


Leaf = tuple[str, tuple[int, ...], "str | None"]


def _mlp(prefix: str, inter: int, h: int) -> Iterator[Leaf]:
    yield f"{prefix}.gate_proj.weight", (inter, h), None
    yield f"{prefix}.up_proj.weight", (inter, h), None
    yield f"{prefix}.down_proj.weight", (h, inter), None


def _norms(h: int) -> Iterator[Leaf]:
    yield "input_layernorm.weight", (h,), None
    yield "post_attention_layernorm.weight", (h,), None


def _gqa(c: dict[str, Any], qk_norm: bool) -> Iterator[Leaf]:
    h, hd = c["hidden_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    yield "self_attn.q_proj.weight", (q, h), None
    yield "self_attn.k_proj.weight", (kv, h), None
    yield "self_attn.v_proj.weight", (kv, h), None
    yield "self_attn.o_proj.weight", (h, q), None
    if qk_norm:
        yield "self_attn.q_norm.weight", (hd,), None
        yield "self_attn.k_norm.weight", (hd,), None


def _llama_layer(c: dict[str, Any], i: int) -> Iterator[Leaf]:
    yield from _gqa(c, qk_norm=False)
    yield from _mlp("mlp", c["intermediate_size"], c["hidden_size"])
    yield from _norms(c["hidden_size"])


def _qwen3_moe_layer(c: dict[str, Any], i: int) -> Iterator[Leaf]:
    h = c["hidden_size"]
    yield from _gqa(c, qk_norm=True)
    yield "mlp.gate.weight", (c["num_experts"], h), None
    for e in range(c["num_experts"]):
        yield from _mlp(f"mlp.experts.{e}", c["moe_intermediate_size"], h)
    yield from _norms(h)


def _deepseek_layer(c: dict[str, Any], i: int) -> Iterator[Leaf]:
    h, heads = c["hidden_size"], c["num_attention_heads"]
    rope, nope, v = c["qk_rope_head_dim"], c["qk_nope_head_dim"], c["v_head_dim"]
    q_lora, kv_lora = c["q_lora_rank"], c["kv_lora_rank"]
    yield "self_attn.q_a_proj.weight", (q_lora, h), None
    yield "self_attn.q_a_layernorm.weight", (q_lora,), None
    yield "self_attn.q_b_proj.weight", (heads * (nope + rope), q_lora), None
    yield "self_attn.kv_a_proj_with_mqa.weight", (kv_lora + rope, h), None
    yield "self_attn.kv_a_layernorm.weight", (kv_lora,), None
    yield "self_attn.kv_b_proj.weight", (heads * (nope + v), kv_lora), None
    yield "self_attn.o_proj.weight", (h, heads * v), None
    if i < c["first_k_dense_replace"]:
        yield from _mlp("mlp", c["intermediate_size"], h)
    else:
        experts, inter = c["n_routed_experts"], c["moe_intermediate_size"]
        for e in range(experts):
            yield from _mlp(f"mlp.experts.{e}", inter, h)
        yield "mlp.gate.weight", (experts, h), None
        yield "mlp.gate.e_score_correction_bias", (experts,), FP32
        yield from _mlp("mlp.shared_experts", inter * c["n_shared_experts"], h)
    yield from _norms(h)
