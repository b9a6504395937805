"""Mistral (MistralForCausalLM): the Llama layer; v0.1 configs carry a sliding window, which
only matters for sequences longer than it."""

from __future__ import annotations

from checkpoint_convert.families import llama
from checkpoint_convert.families.base import ModelSpec, decoder_fields, refuse

ARCHITECTURE = "MistralForCausalLM"
MODEL_TYPE = "mistral"
SCORE_ARCHITECTURE = "MistralForSequenceClassification"  # its reward model (families/__init__.py)

# Mistral's layer is Llama's, tensor for tensor.
LAYER_KEYS = llama.LAYER_KEYS


def spec_from_config(config: dict, *, source: str) -> ModelSpec:
    refuse(config, "attention_bias", source=source, why="attention biases are only supported for Qwen2")
    return ModelSpec(
        architecture=ARCHITECTURE, family=MODEL_TYPE, qkv_bias=False, sliding_window=config.get("sliding_window"),
        **decoder_fields(config, source=source),
    )  # fmt: skip


def layer_keys(spec: ModelSpec, *, layer: int) -> dict:
    return LAYER_KEYS


def transformer_fields(spec: ModelSpec) -> dict:
    return {"add_qkv_bias": False}
