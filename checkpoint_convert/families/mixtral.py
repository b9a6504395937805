"""Mixtral (MixtralForCausalLM): the Mistral attention and, on every layer, a router over
`num_local_experts` SwiGLU experts of `intermediate_size`, top `num_experts_per_tok`, weighted
by the softmax over the top-k router logits (HF: softmax over all, top-k, renormalised).

Hub checkpoints, and transformers 5's save_pretrained, store `block_sparse_moe.gate` and one
tensor per expert and projection (`block_sparse_moe.experts.{e}.w1/w3/w2` = gate/up/down);
transformers 5 holds them in memory as `mlp.gate` and fused `mlp.experts.gate_up_proj`
[E, 2I, h] / `mlp.experts.down_proj` [E, h, I], which is read too.
"""

from __future__ import annotations

from checkpoint_convert.families.base import ModelSpec, decoder_fields, expert_keys, moe_fields, moe_transformer_fields, refuse

ARCHITECTURE = "MixtralForCausalLM"
MODEL_TYPE = "mixtral"
SCORE_ARCHITECTURE = "MixtralForSequenceClassification"  # its reward model (families/__init__.py)

LAYER_KEYS = {
    "decoder.layers.{layer}.input_layernorm.weight": ("replicated", ("model.layers.{layer}.input_layernorm.weight",)),
    "decoder.layers.{layer}.self_attention.linear_qkv.weight": (
        "qkv",
        (
            "model.layers.{layer}.self_attn.q_proj.weight",
            "model.layers.{layer}.self_attn.k_proj.weight",
            "model.layers.{layer}.self_attn.v_proj.weight",
        ),
    ),
    "decoder.layers.{layer}.self_attention.linear_proj.weight": ("row", ("model.layers.{layer}.self_attn.o_proj.weight",)),
    "decoder.layers.{layer}.pre_mlp_layernorm.weight": ("replicated", ("model.layers.{layer}.post_attention_layernorm.weight",)),
    "decoder.layers.{layer}.mlp.router.weight": ("replicated", ("model.layers.{layer}.block_sparse_moe.gate.weight",)),
    "decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc1.weight": (
        "fc1",
        (
            "model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight",
            "model.layers.{layer}.block_sparse_moe.experts.{expert}.w3.weight",
        ),
    ),
    "decoder.layers.{layer}.mlp.experts.local_experts.{expert}.linear_fc2.weight": (
        "row",
        ("model.layers.{layer}.block_sparse_moe.experts.{expert}.w2.weight",),
    ),
}
FUSED_EXPERT_KEYS = {
    "model.layers.{layer}.mlp.experts.gate_up_proj": (
        "model.layers.{layer}.block_sparse_moe.experts.{expert}.w1.weight",
        "model.layers.{layer}.block_sparse_moe.experts.{expert}.w3.weight",
    ),
    "model.layers.{layer}.mlp.experts.down_proj": ("model.layers.{layer}.block_sparse_moe.experts.{expert}.w2.weight",),
}
RENAMED_KEYS = {"model.layers.{layer}.mlp.gate.weight": "model.layers.{layer}.block_sparse_moe.gate.weight"}


def spec_from_config(config: dict, *, source: str) -> ModelSpec:
    refuse(config, "attention_bias", source=source, why="attention biases are only supported for Qwen2")
    common = decoder_fields(config, source=source)
    moe = moe_fields(config, source=source, num_experts_field="num_local_experts", moe_intermediate_field="intermediate_size")
    return ModelSpec(
        architecture=ARCHITECTURE, family=MODEL_TYPE, qkv_bias=False, sliding_window=config.get("sliding_window"),
        moe_norm_topk=True, moe_layers=tuple(range(common["num_layers"])), **moe, **common,
    )  # fmt: skip


def layer_keys(spec: ModelSpec, *, layer: int) -> dict:
    return expert_keys(LAYER_KEYS, num_experts=spec.num_experts)


def moe_hf_shapes(spec: ModelSpec, *, layer: int) -> dict[str, tuple[int, ...]]:
    h, f = spec.hidden_size, spec.moe_intermediate_size
    p = f"model.layers.{layer}.block_sparse_moe."
    shapes = {p + "gate.weight": (spec.num_experts, h)}
    for e in range(spec.num_experts):
        # In the key map's order (gate w1, up w3, then down w2): the HF writer streams each
        # entry's tensors one after the other.
        shapes[p + f"experts.{e}.w1.weight"] = (f, h)
        shapes[p + f"experts.{e}.w3.weight"] = (f, h)
        shapes[p + f"experts.{e}.w2.weight"] = (h, f)
    return shapes


def transformer_fields(spec: ModelSpec) -> dict:
    return {"add_qkv_bias": False, **moe_transformer_fields(spec)}
