"""Llama (LlamaForCausalLM): RMSNorm, GQA attention with RoPE (llama3 scaling carried over),
SwiGLU MLP, no biases; tied or untied embeddings."""

from __future__ import annotations

from checkpoint_convert.families.base import ModelSpec, decoder_fields, refuse

ARCHITECTURE = "LlamaForCausalLM"
MODEL_TYPE = "llama"
SCORE_ARCHITECTURE = "LlamaForSequenceClassification"  # its reward model (families/__init__.py)

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
    "decoder.layers.{layer}.mlp.linear_fc1.weight": (
        "fc1",
        ("model.layers.{layer}.mlp.gate_proj.weight", "model.layers.{layer}.mlp.up_proj.weight"),
    ),
    "decoder.layers.{layer}.mlp.linear_fc2.weight": ("row", ("model.layers.{layer}.mlp.down_proj.weight",)),
}


def spec_from_config(config: dict, *, source: str) -> ModelSpec:
    refuse(config, "attention_bias", source=source, why="attention biases are only supported for Qwen2")
    return ModelSpec(architecture=ARCHITECTURE, family=MODEL_TYPE, qkv_bias=False, **decoder_fields(config, source=source))


def layer_keys(spec: ModelSpec, *, layer: int) -> dict:
    return LAYER_KEYS


def transformer_fields(spec: ModelSpec) -> dict:
    """TransformerConfig fields of this family (beyond the shape every family shares)."""
    return {"add_qkv_bias": False}
