"""Qwen2 (Qwen2ForCausalLM): the Llama layer plus q/k/v biases; usually tied embeddings."""

from __future__ import annotations

from checkpoint_convert.families import llama
from checkpoint_convert.families.base import ModelSpec, decoder_fields, refuse

ARCHITECTURE = "Qwen2ForCausalLM"
MODEL_TYPE = "qwen2"
SCORE_ARCHITECTURE = "Qwen2ForSequenceClassification"  # its reward model (families/__init__.py)

# Llama's layer plus the q/k/v biases, fused like the weights.
LAYER_KEYS = {
    **llama.LAYER_KEYS,
    "decoder.layers.{layer}.self_attention.linear_qkv.bias": (
        "qkv",
        (
            "model.layers.{layer}.self_attn.q_proj.bias",
            "model.layers.{layer}.self_attn.k_proj.bias",
            "model.layers.{layer}.self_attn.v_proj.bias",
        ),
    ),
}


def spec_from_config(config: dict, *, source: str) -> ModelSpec:
    refuse(config, "use_sliding_window", source=source, why="sliding-window attention is not supported")
    return ModelSpec(architecture=ARCHITECTURE, family=MODEL_TYPE, qkv_bias=True, **decoder_fields(config, source=source))


def layer_keys(spec: ModelSpec, *, layer: int) -> dict:
    return LAYER_KEYS


def transformer_fields(spec: ModelSpec) -> dict:
    return {"add_qkv_bias": True}
