"""Qwen3-MoE (Qwen3MoeForCausalLM): the Qwen3 attention (per-head q/k RMSNorm, own head_dim) and,
on its sparse layers, a router over `num_experts` SwiGLU experts of `moe_intermediate_size`,
top `num_experts_per_tok`. `norm_topk_prob` renormalises the top-k probabilities (= a softmax
over the top-k logits); without it they are the full softmax's. A layer is sparse unless it is
in `mlp_only_layers`, and only every `decoder_sparse_step`-th layer is (HF's rule:
(layer + 1) % decoder_sparse_step == 0); the others have a dense MLP of `intermediate_size`.

Hub checkpoints, and transformers 5's save_pretrained, store one tensor per expert and
projection (`mlp.experts.{e}.gate_proj.weight`); transformers 5 holds them in memory fused
(`mlp.experts.gate_up_proj` [E, 2I, h], `mlp.experts.down_proj` [E, h, I]), which is read too.
"""

from __future__ import annotations

from checkpoint_convert.families import qwen3
from checkpoint_convert.families.base import (
    ConversionError, ModelSpec, decoder_fields, expert_keys, field, moe_fields, moe_transformer_fields, refuse,
)  # fmt: skip

ARCHITECTURE = "Qwen3MoeForCausalLM"
MODEL_TYPE = "qwen3_moe"
SCORE_ARCHITECTURE = "Qwen3MoeForSequenceClassification"  # its reward model (families/__init__.py)

# A Qwen3-MoE layer is a Qwen3 layer whose MLP is either dense (as in Qwen3) or the experts.
ATTENTION_KEYS = {name: entry for name, entry in qwen3.LAYER_KEYS.items() if ".mlp." not in name}
DENSE_MLP_KEYS = {name: entry for name, entry in qwen3.LAYER_KEYS.items() if ".mlp." in name}
MOE_KEYS = {
    "decoder.layers.{layer}.mlp.router.weight": ("replicated", ("model.layers.{layer}.mlp.gate.weight",)),
    "decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc1.weight": (
        "fc1",
        ("model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight", "model.layers.{layer}.mlp.experts.{expert}.up_proj.weight"),
    ),
    "decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc2.weight": (
        "row",
        ("model.layers.{layer}.mlp.experts.{expert}.down_proj.weight",),
    ),
}
# transformers 5's in-memory (fused) expert tensors: stored name -> the hub names it holds, in
# order along dim 1 of each expert's slice.
FUSED_EXPERT_KEYS = {
    "model.layers.{layer}.mlp.experts.gate_up_proj": (
        "model.layers.{layer}.mlp.experts.{expert}.gate_proj.weight",
        "model.layers.{layer}.mlp.experts.{expert}.up_proj.weight",
    ),
    "model.layers.{layer}.mlp.experts.down_proj": ("model.layers.{layer}.mlp.experts.{expert}.down_proj.weight",),
}
RENAMED_KEYS: dict[str, str] = {}  # in-memory name -> hub name (none: the router is `mlp.gate` in both)


def moe_layers(config: dict, *, num_layers: int, source: str) -> tuple[int, ...]:
    step = field(config, "decoder_sparse_step", int, source=source, default=1)
    dense = config.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(x, int) and 0 <= x < num_layers for x in dense):
        raise ConversionError(f"{source}: field 'mlp_only_layers' must list layer numbers below {num_layers}, got {dense!r}")
    return tuple(layer for layer in range(num_layers) if layer not in dense and (layer + 1) % step == 0)


def spec_from_config(config: dict, *, source: str) -> ModelSpec:
    refuse(config, "attention_bias", source=source, why="Qwen3 attention biases are not supported")
    refuse(config, "use_sliding_window", source=source, why="sliding-window attention is not supported")
    common = decoder_fields(config, source=source)
    moe = moe_fields(config, source=source, num_experts_field="num_experts", moe_intermediate_field="moe_intermediate_size")
    return ModelSpec(
        architecture=ARCHITECTURE, family=MODEL_TYPE, qkv_bias=False, qk_layernorm=True,
        moe_norm_topk=bool(config.get("norm_topk_prob", False)),
        moe_layers=moe_layers(config, num_layers=common["num_layers"], source=source), **moe, **common,
    )  # fmt: skip


def layer_keys(spec: ModelSpec, *, layer: int) -> dict:
    if spec.is_moe_layer(layer):
        return {**ATTENTION_KEYS, **expert_keys(MOE_KEYS, num_experts=spec.num_experts)}
    return {**ATTENTION_KEYS, **DENSE_MLP_KEYS}


def moe_hf_shapes(spec: ModelSpec, *, layer: int) -> dict[str, tuple[int, ...]]:
    h, f = spec.hidden_size, spec.moe_intermediate_size
    p = f"model.layers.{layer}.mlp."
    shapes = {p + "gate.weight": (spec.num_experts, h)}
    for e in range(spec.num_experts):
        shapes[p + f"experts.{e}.gate_proj.weight"] = (f, h)
        shapes[p + f"experts.{e}.up_proj.weight"] = (f, h)
        shapes[p + f"experts.{e}.down_proj.weight"] = (h, f)
    return shapes


def transformer_fields(spec: ModelSpec) -> dict:
    return {"add_qkv_bias": False, "qk_layernorm": True, **moe_transformer_fields(spec)}
