"""Gemma 3, text (Gemma3ForCausalLM, model_type gemma3_text: Gemma 3 270M and 1B; the text part of
the larger multimodal releases): GQA attention with per-head q/k RMSNorm and a softmax scale of
query_pre_attn_scalar^-0.5; local layers that attend only `sliding_window` tokens back and
global layers (`layer_types`, or every `sliding_window_pattern`-th layer global: 5 local, 1
global), each kind with its own RoPE base (and linear factor); "sandwich" norms (input,
post-attention, pre-feedforward, post-feedforward) that all scale by (1 + w); a GeGLU MLP
(gelu, tanh approximation); the embedding scaled by sqrt(hidden_size); tied embeddings by default;
optionally a tanh cap of the final logits.

The checkpoint's norm weights are stored as they are (w, not 1 + w): the trainer's norm module
adds the 1 (mcore_dpo/model/gemma3.py, which also holds the local and global attention, the
post-norms and the two RoPE tables), so the conversion is a plain copy, bit for bit both ways.
What this module cannot reproduce exactly is one line naming the field.
"""

from __future__ import annotations

import torch

from checkpoint_convert.families import llama
from checkpoint_convert.families.base import ConversionError, ModelSpec, decoder_fields, field, refuse

ARCHITECTURE = "Gemma3ForCausalLM"
MODEL_TYPE = "gemma3_text"
SCORE_ARCHITECTURE = "Gemma3TextForSequenceClassification"  # its reward model (families/__init__.py)

_LAYER = "decoder.layers.{layer}."
_HF = "model.layers.{layer}."
# Llama's tensors (its post_attention_layernorm is the pre-MLP norm there, Gemma's is a post-norm)
# plus the q/k norms and the two post-norms, which live in the attention and MLP modules of ours.
LAYER_KEYS = {
    _LAYER + "input_layernorm.weight": ("replicated", (_HF + "input_layernorm.weight",)),
    _LAYER + "self_attention.linear_qkv.weight": llama.LAYER_KEYS[_LAYER + "self_attention.linear_qkv.weight"],
    _LAYER + "self_attention.q_layernorm.weight": ("replicated", (_HF + "self_attn.q_norm.weight",)),
    _LAYER + "self_attention.k_layernorm.weight": ("replicated", (_HF + "self_attn.k_norm.weight",)),
    _LAYER + "self_attention.linear_proj.weight": ("row", (_HF + "self_attn.o_proj.weight",)),
    _LAYER + "self_attention.post_layernorm.weight": ("replicated", (_HF + "post_attention_layernorm.weight",)),
    _LAYER + "pre_mlp_layernorm.weight": ("replicated", (_HF + "pre_feedforward_layernorm.weight",)),
    _LAYER + "mlp.linear_fc1.weight": llama.LAYER_KEYS[_LAYER + "mlp.linear_fc1.weight"],
    _LAYER + "mlp.linear_fc2.weight": ("row", (_HF + "mlp.down_proj.weight",)),
    _LAYER + "mlp.post_layernorm.weight": ("replicated", (_HF + "post_feedforward_layernorm.weight",)),
}
LAYER_TYPES = ("sliding_attention", "full_attention")


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """HF's gelu_pytorch_tanh."""
    return torch.nn.functional.gelu(x, approximate="tanh")


def _rope_kind(params: object, *, where: str) -> tuple[float | None, float]:
    """(rope_theta or None, linear factor) of one layer kind's RoPE parameters."""
    if params is None:
        return None, 1.0
    if not isinstance(params, dict):
        raise ConversionError(f"{where}: must be an object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in (None, "default", "linear"):
        raise ConversionError(f"{where}.rope_type' is {rope_type!r}; only 'default' and 'linear' are supported")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConversionError(f"{where}.partial_rotary_factor' is {params['partial_rotary_factor']!r}; only 1.0 is supported")
    factor = field(params, "factor", float, source=where, default=1.0) if rope_type == "linear" else 1.0
    theta = params.get("rope_theta")
    return (None if theta is None else field(params, "rope_theta", float, source=where)), factor


def rope_fields(config: dict, *, source: str) -> tuple[float, float, tuple[float, float]]:
    """(global base, local base, (global, local) linear factors) of either config form:
    transformers 5's `rope_parameters` per layer kind, or rope_theta + rope_local_base_freq +
    rope_scaling (which HF applies to the global layers only). HF's defaults: 1e6 and 1e4."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and any(kind in params for kind in LAYER_TYPES):
        theta, factor = _rope_kind(params.get("full_attention"), where=f"{source}: field 'rope_parameters.full_attention")
        local, local_factor = _rope_kind(params.get("sliding_attention"),
                                         where=f"{source}: field 'rope_parameters.sliding_attention")
    else:
        if params:  # one set of parameters in the flat form: HF reads it as rope_scaling
            config = {**config, "rope_scaling": params}
        theta, factor = _rope_kind(config.get("rope_scaling"), where=f"{source}: field 'rope_scaling")
        local, local_factor = None, 1.0
    if theta is None:
        theta = field(config, "rope_theta", float, source=source, default=1_000_000.0)
    if local is None:
        local = field(config, "rope_local_base_freq", float, source=source, default=10_000.0)
    return theta, local, (factor, local_factor)


def sliding_layers(config: dict, *, source: str, num_layers: int) -> tuple[int, ...]:
    """The local layers: `layer_types`, else HF's rule from `sliding_window_pattern` (default 6):
    layer i is local unless (i + 1) % pattern == 0."""
    types = config.get("layer_types")
    if types is None:
        pattern = field(config, "sliding_window_pattern", int, source=source, default=6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise ConversionError(f"{source}: field 'layer_types' must list {num_layers} of {', '.join(LAYER_TYPES)}, got {types!r}")
    return tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")


def spec_from_config(config: dict, *, source: str) -> ModelSpec:
    refuse(config, "attention_bias", source=source, why="Gemma 3 attention biases are not supported")
    refuse(config, "use_bidirectional_attention", source=source, why="only causal attention is supported")
    refuse(config, "attn_logit_softcapping", source=source,
           why="transformers' Gemma3ForCausalLM does not apply it (Gemma 3 checkpoints leave it null)")
    activation = config.get("hidden_activation", config.get("hidden_act")) or "gelu_pytorch_tanh"
    if activation != "gelu_pytorch_tanh":
        raise ConversionError(f"{source}: field 'hidden_activation' is {activation!r}; only 'gelu_pytorch_tanh' is supported")
    base = {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_scaling", "hidden_act", "hidden_activation")}
    common = decoder_fields({**base, "tie_word_embeddings": config.get("tie_word_embeddings", True)}, source=source)
    theta, local_theta, factors = rope_fields(config, source=source)
    local = sliding_layers(config, source=source, num_layers=common["num_layers"])
    window = field(config, "sliding_window", int, source=source) if local else None
    cap = field(config, "final_logit_softcapping", float, source=source, default=0.0)
    scalar = field(config, "query_pre_attn_scalar", float, source=source, default=256.0)
    common.update(rope_theta=theta, rope_scaling=None)
    return ModelSpec(
        architecture=ARCHITECTURE, family=MODEL_TYPE, qkv_bias=False, qk_layernorm=True, sliding_window=window,
        sliding_layers=local, rope_local_theta=local_theta, rope_linear_factors=factors, query_pre_attn_scalar=scalar,
        final_logit_softcapping=cap, **common,
    )  # fmt: skip


def layer_keys(spec: ModelSpec, *, layer: int) -> dict:
    return LAYER_KEYS


def attention_hf_shapes(spec: ModelSpec, *, layer: int) -> dict[str, tuple[int, ...]]:
    """A layer's HF tensors but the MLP projections (the shared dense ones): the attention with
    its q/k norms, and the four norms."""
    h, d = spec.hidden_size, spec.head_dim
    q_rows, kv_rows = spec.num_heads * d, spec.num_query_groups * d
    p = f"model.layers.{layer}."
    return {
        p + "input_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (q_rows, h),
        p + "self_attn.k_proj.weight": (kv_rows, h),
        p + "self_attn.v_proj.weight": (kv_rows, h),
        p + "self_attn.o_proj.weight": (h, q_rows),
        p + "self_attn.q_norm.weight": (d,),
        p + "self_attn.k_norm.weight": (d,),
        p + "post_attention_layernorm.weight": (h,),
        p + "pre_feedforward_layernorm.weight": (h,),
        p + "post_feedforward_layernorm.weight": (h,),
    }


def transformer_fields(spec: ModelSpec) -> dict:
    """GeGLU, the q/k norms, the softmax scale and megatron-core's own sliding-window fields
    (window (W - 1, 0): a token sees itself and the W - 1 before it, on the layers the 0/1 list
    marks). The (1 + w) norms, the post-norms, the windowed mask and the two RoPE tables are the
    trainer's spec module's (mcore_dpo/model/gemma3.py)."""
    fields = {"add_qkv_bias": False, "qk_layernorm": True, "activation_func": gelu_tanh,
              "softmax_scale": spec.query_pre_attn_scalar ** -0.5}
    if spec.sliding_layers:
        fields["window_size"] = (spec.sliding_window - 1, 0)
        fields["window_attn_skip_freq"] = [int(layer in spec.sliding_layers) for layer in range(spec.num_layers)]
    return fields
