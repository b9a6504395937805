"""Qwen3 dense (Qwen3ForCausalLM): the Llama layer plus a per-head RMSNorm of q and k after
the projection (megatron-core's `qk_layernorm`), a head_dim of its own (Qwen3-0.6B: hidden
1024, 16 heads, head_dim 128), no qkv bias; tied or untied embeddings."""

from __future__ import annotations

from checkpoint_convert.families.base import ModelSpec, decoder_fields, refuse

ARCHITECTURE = "Qwen3ForCausalLM"
MODEL_TYPE = "qwen3"

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
    "decoder.layers.{layer}.self_attention.q_layernorm.weight": ("replicated", ("model.layers.{layer}.self_attn.q_norm.weight",)),
    "decoder.layers.{layer}.self_attention.k_layernorm.weight": ("replicated", ("model.layers.{layer}.self_attn.k_norm.weight",)),
    "decoder.layers.{layer}.self_attention.linear_proj.weight": ("row", ("model.layers.{layer}.self_attn.o_proj.weight",)),
    "decoder.layers.{layer}.pre_mlp_layernorm.weight": ("replicated", ("model.layers.{layer}.post_attention_layernorm.weight",)),
    "decoder.layers.{layer}.mlp.linear_fc1.weight": (
        "fc1",
        ("model.layers.{layer}.mlp.gate_proj.weight", "model.layers.{layer}.mlp.up_proj.weight"),
    ),
    "decoder.layers.{layer}.mlp.linear_fc2.weight": ("row", ("model.layers.{layer}.mlp.down_proj.weight",)),
}


def spec_from_config(config: dict, *, source: str) -> ModelSpec:
    refuse(config, "attention_bias", source=source, why="Qwen3 attention biases are not supported")
    refuse(config, "use_sliding_window", source=source, why="sliding-window attention is not supported")
    return ModelSpec(
        architecture=ARCHITECTURE, family=MODEL_TYPE, qkv_bias=False, qk_layernorm=True,
        **decoder_fields(config, source=source),
    )  # fmt: skip


def layer_keys(spec: ModelSpec, *, layer: int) -> dict:
    return LAYER_KEYS


def transformer_fields(spec: ModelSpec) -> dict:
    # The q/k norms are RMSNorms with the model's epsilon (layernorm_epsilon), over head_dim.
    return {"add_qkv_bias": False, "qk_layernorm": True}
