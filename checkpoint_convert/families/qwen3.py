"""Qwen3 dense (Qwen3ForCausalLM): the Llama layer plus a per-head RMSNorm of q and k after
the projection (megatron-core's `qk_layernorm`), a head_dim of its own (Qwen3-0.6B: hidden
1024, 16 heads, head_dim 128), no qkv bias; tied or untied embeddings."""

from __future__ import annotations

from checkpoint_convert.families import llama
from checkpoint_convert.families.base import ModelSpec, decoder_fields, refuse

ARCHITECTURE = "Qwen3ForCausalLM"
MODEL_TYPE = "qwen3"
SCORE_ARCHITECTURE = "Qwen3ForSequenceClassification"  # its reward model (families/__init__.py)

# Llama's layer plus the per-head q/k RMSNorms.
LAYER_KEYS = {
    **llama.LAYER_KEYS,
    "decoder.layers.{layer}.self_attention.q_layernorm.weight": ("replicated", ("model.layers.{layer}.self_attn.q_norm.weight",)),
    "decoder.layers.{layer}.self_attention.k_layernorm.weight": ("replicated", ("model.layers.{layer}.self_attn.k_norm.weight",)),
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
