"""GPT-OSS (GptOssForCausalLM: gpt-oss-20b, gpt-oss-120b): GQA attention with q/k/v/o biases and a
learned sink logit per head (`sinks`: one more column in each row's softmax, dropped after it);
layers that alternate between attending `sliding_window` tokens back and attending to everything
(`layer_types`; HF's default: even layers sliding); YaRN RoPE by halves; on every layer a MoE
block: a router with a bias, top `num_experts_per_tok` of `num_local_experts`, weighted by the
softmax over the top-k logits; experts with biases and the clamped SwiGLU
(gate clamped above at `swiglu_limit`, up clamped to [-limit, limit], gate * sigmoid(alpha gate)
* (up + 1), alpha 1.702).

The HF tensors hold all experts of a layer stacked, as transformers holds them in memory and
saves them: `mlp.experts.gate_up_proj` [E, h, 2I] (the input dim first; gate and up interleaved
on the last dim: even columns gate, odd up), `gate_up_proj_bias` [E, 2I] (interleaved alike),
`down_proj` [E, I, h], `down_proj_bias` [E, h]. The key map names expert e's slice
(`gate_up_proj@{expert}`, mapping.STACKED) with the split kinds `fc1_interleaved` /
`row_transposed` (mapping.canonical_tensors: megatron-core's [gate; up] rows and [h, I]).

The released checkpoints store `gate_up_proj` and `down_proj` in MXFP4 (`quantization_config`
{"quant_method": "mxfp4"}): `<name>_blocks` [E, rows, cols / 32, 16] uint8 (two FP4 e2m1 values a
byte, the low nibble first) and `<name>_scales` [E, rows, cols / 32] uint8 (an e8m0 power of two
per block of 32, biased by 127), the rows being the weight's output dim. They are dequantised on
import (`dequantise_mxfp4`, to the checkpoint's dtype, which holds every such value exactly);
the export writes plain weights (and no quantization_config).

Megatron-core's local spec: biases (`add_bias_linear`, `add_qkv_bias`), the sink as its
`softmax_type="learnable"` offset (`core_attention.softmax_offset`, split over tp by heads),
quick_gelu (x sigmoid(1.702 x)) with `glu_linear_offset` 1 and `activation_func_clamp_value`
(the same clamps), the softmax top-k router with its bias. The window, the YaRN frequencies
and its cos/sin scale are the trainer's spec module's (mcore_dpo/model/gpt_oss.py); the scale
(HF multiplies cos and sin by `attention_factor`) enters as the softmax scale
attention_factor^2 / sqrt(head_dim). What this module cannot reproduce exactly is one line naming
the field.
"""

from __future__ import annotations

import math

import torch

from checkpoint_convert.families import llama, qwen2
from checkpoint_convert.families.base import (
    ConversionError, ModelSpec, decoder_fields, expert_keys, field, moe_fields, moe_transformer_fields, rope_scaling_of,
)  # fmt: skip

ARCHITECTURE = "GptOssForCausalLM"
MODEL_TYPE = "gpt_oss"
SCORE_ARCHITECTURE = "GptOssForSequenceClassification"  # its reward model (families/__init__.py)
QUANT_METHODS = ("mxfp4",)  # quantization_config's method whose experts are dequantised on import

_LAYER = "decoder.layers.{layer}."
_HF = "model.layers.{layer}."
ATTENTION_KEYS = {
    _LAYER + "input_layernorm.weight": ("replicated", (_HF + "input_layernorm.weight",)),
    _LAYER + "self_attention.linear_qkv.weight": llama.LAYER_KEYS[_LAYER + "self_attention.linear_qkv.weight"],
    _LAYER + "self_attention.linear_qkv.bias": qwen2.LAYER_KEYS[_LAYER + "self_attention.linear_qkv.bias"],
    _LAYER + "self_attention.core_attention.softmax_offset": ("column", (_HF + "self_attn.sinks",)),
    _LAYER + "self_attention.linear_proj.weight": ("row", (_HF + "self_attn.o_proj.weight",)),
    _LAYER + "self_attention.linear_proj.bias": ("replicated", (_HF + "self_attn.o_proj.bias",)),
    _LAYER + "pre_mlp_layernorm.weight": ("replicated", (_HF + "post_attention_layernorm.weight",)),
}
_EXPERT = _LAYER + "mlp.experts.local_experts.{expert}."
MOE_KEYS = {
    _LAYER + "mlp.router.weight": ("replicated", (_HF + "mlp.router.weight",)),
    _LAYER + "mlp.router.bias": ("replicated", (_HF + "mlp.router.bias",)),
    _EXPERT + "linear_fc1.weight": ("fc1_interleaved", (_HF + "mlp.experts.gate_up_proj@{expert}",)),
    _EXPERT + "linear_fc1.bias": ("fc1_interleaved", (_HF + "mlp.experts.gate_up_proj_bias@{expert}",)),
    _EXPERT + "linear_fc2.weight": ("row_transposed", (_HF + "mlp.experts.down_proj@{expert}",)),
    _EXPERT + "linear_fc2.bias": ("replicated", (_HF + "mlp.experts.down_proj_bias@{expert}",)),
}
# The released checkpoints' MXFP4 experts: the plain tensor -> its blocks and scales.
QUANTIZED_KEYS = {
    _HF + "mlp.experts.gate_up_proj": (_HF + "mlp.experts.gate_up_proj_blocks", _HF + "mlp.experts.gate_up_proj_scales"),
    _HF + "mlp.experts.down_proj": (_HF + "mlp.experts.down_proj_blocks", _HF + "mlp.experts.down_proj_scales"),
}
LAYER_TYPES = ("sliding_attention", "full_attention")
SWIGLU_ALPHA = 1.702  # megatron-core's quick_gelu: x * sigmoid(1.702 x)
# GptOssConfig's defaults (transformers 5.24) of the fields read here.
HF_DEFAULTS = {
    "num_hidden_layers": 36, "num_local_experts": 128, "vocab_size": 201088, "hidden_size": 2880,
    "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64, "num_key_value_heads": 8,
    "sliding_window": 128, "tie_word_embeddings": False, "hidden_act": "silu", "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "num_experts_per_tok": 4, "swiglu_alpha": SWIGLU_ALPHA, "swiglu_limit": 7.0,
    "attention_bias": True,
}
DEFAULT_THETA = 150000.0
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}

# FP4 e2m1 codes 0..15 (bit 3: sign; 3 bits: the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6).
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def dequantise_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, *, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 -> [..., rows, cols]: `blocks` [..., rows, G, 16] uint8 hold 32 FP4 e2m1 values per
    block (byte j: value 2j in its low nibble, 2j + 1 in its high one), `scales` [..., rows, G]
    uint8 the block's power of two, biased by 127. Every value is a small signed integer multiple
    of a power of two: exact in `dtype` unless the scale leaves its range."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)} (blocks [..., G, 16])")
    magnitude = torch.tensor(_E2M1, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).long()  # [..., G, 32], low nibble first
    values = magnitude[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2).to(dtype)


def _yarn(config: dict, *, source: str, max_positions: int) -> tuple[float, dict | None]:
    """rope_theta and the YaRN parameters of either config form (None: plain RoPE). A config
    without any is HF's default for this model (YaRN, factor 32 over 4096 positions)."""
    if not config.get("rope_parameters") and not config.get("rope_scaling"):
        config = {**config, "rope_parameters": dict(DEFAULT_ROPE)}
    params = config.get("rope_parameters") or config.get("rope_scaling")
    if config.get("rope_theta") is None and not (isinstance(params, dict) and params.get("rope_theta") is not None):
        config = {**config, "rope_theta": DEFAULT_THETA}
    theta, params, name, rope_type = rope_scaling_of(config, source=source)
    if params is None:
        return theta, None
    where = f"{source}: {name}"
    if rope_type != "yarn":
        raise ConversionError(f"{source}: field '{name}.rope_type' is {rope_type!r}; only 'default' and 'yarn' are supported")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConversionError(f"{where}: field 'partial_rotary_factor' is {params['partial_rotary_factor']!r}; only 1.0 is supported")
    original = field(params, "original_max_position_embeddings", int, source=where)
    factor = field(params, "factor", float, source=where, default=max_positions / original)
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConversionError(f"{where}: field 'truncate' must be true or false, got {truncate!r}")
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _mscale(factor, mscale) / _mscale(factor, mscale_all_dim)
        else:
            attention_factor = _mscale(factor, 1.0)
    attention_factor = field({"attention_factor": attention_factor}, "attention_factor", float, source=where)
    return theta, {
        "rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
        "beta_fast": float(params.get("beta_fast") or 32), "beta_slow": float(params.get("beta_slow") or 1),
        "truncate": truncate, "attention_factor": attention_factor,
    }  # fmt: skip


def _mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """RoPE inverse frequencies [head_dim / 2]: plain, or YaRN's blend of the interpolated and
    extrapolated ones (HF's rule, `truncate` included)."""
    d, base = spec.head_dim, spec.rope_theta
    pos_freqs = base ** (torch.arange(0, d, 2).to(dtype=torch.float) / d)
    if spec.rope_scaling is None:
        return 1.0 / pos_freqs
    yarn = spec.rope_scaling

    def correction_dim(rotations: float) -> float:
        return (d * math.log(yarn["original_max_position_embeddings"] / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(yarn["beta_fast"]), correction_dim(yarn["beta_slow"])
    if yarn["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (yarn["factor"] * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def attention_factor(spec: ModelSpec) -> float:
    """The scale HF applies to RoPE's cos and sin (1 without YaRN)."""
    return 1.0 if spec.rope_scaling is None else spec.rope_scaling["attention_factor"]


def sliding_layers(config: dict, *, source: str, num_layers: int) -> tuple[int, ...]:
    """The sliding-window layers: `layer_types`, else HF's default (layer i slides when i is even)."""
    types = config.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
        raise ConversionError(f"{source}: field 'layer_types' must list {num_layers} of {', '.join(LAYER_TYPES)}, got {types!r}")
    return tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")


def spec_from_config(config: dict, *, source: str) -> ModelSpec:
    config = {**HF_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    if config["attention_bias"] is not True:
        raise ConversionError(f"{source}: field 'attention_bias' is {config['attention_bias']!r}; megatron-core's "
                              "add_bias_linear gives the attention biases whenever the experts have theirs")
    alpha = field(config, "swiglu_alpha", float, source=source)
    if alpha != SWIGLU_ALPHA:
        raise ConversionError(f"{source}: field 'swiglu_alpha' is {alpha!r}; megatron-core's quick_gelu has {SWIGLU_ALPHA}")
    limit = field(config, "swiglu_limit", float, source=source)
    base = {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_scaling")}
    common = decoder_fields({**base, "rope_theta": DEFAULT_THETA}, source=source)
    theta, yarn = _yarn(config, source=source, max_positions=common["max_position_embeddings"])
    moe = moe_fields(config, source=source, num_experts_field="num_local_experts", moe_intermediate_field="intermediate_size")
    local = sliding_layers(config, source=source, num_layers=common["num_layers"])
    window = field(config, "sliding_window", int, source=source) if local else None
    common.update(rope_theta=theta, rope_scaling=yarn)
    return ModelSpec(
        architecture=ARCHITECTURE, family=MODEL_TYPE, qkv_bias=True, sliding_window=window, sliding_layers=local,
        moe_norm_topk=True, moe_layers=tuple(range(common["num_layers"])), swiglu_limit=limit, **moe, **common,
    )  # fmt: skip


def layer_keys(spec: ModelSpec, *, layer: int) -> dict:
    return {**ATTENTION_KEYS, **expert_keys(MOE_KEYS, num_experts=spec.num_experts)}


def attention_hf_shapes(spec: ModelSpec, *, layer: int) -> dict[str, tuple[int, ...]]:
    """A layer's attention tensors (biases and sinks) and its two norms, in the key map's order."""
    h, d = spec.hidden_size, spec.head_dim
    q_rows, kv_rows = spec.num_heads * d, spec.num_query_groups * d
    p = f"model.layers.{layer}."
    return {
        p + "input_layernorm.weight": (h,),
        p + "self_attn.q_proj.weight": (q_rows, h), p + "self_attn.k_proj.weight": (kv_rows, h),
        p + "self_attn.v_proj.weight": (kv_rows, h),
        p + "self_attn.q_proj.bias": (q_rows,), p + "self_attn.k_proj.bias": (kv_rows,), p + "self_attn.v_proj.bias": (kv_rows,),
        p + "self_attn.sinks": (spec.num_heads,),
        p + "self_attn.o_proj.weight": (h, q_rows), p + "self_attn.o_proj.bias": (h,),
        p + "post_attention_layernorm.weight": (h,),
    }  # fmt: skip


def moe_hf_shapes(spec: ModelSpec, *, layer: int) -> dict[str, tuple[int, ...]]:
    h, f, e = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
    p = f"model.layers.{layer}.mlp."
    return {
        p + "router.weight": (e, h), p + "router.bias": (e,),
        p + "experts.gate_up_proj": (e, h, 2 * f), p + "experts.gate_up_proj_bias": (e, 2 * f),
        p + "experts.down_proj": (e, f, h), p + "experts.down_proj_bias": (e, h),
    }  # fmt: skip


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x): HF's glu = gate * sigmoid(gate * alpha), as megatron-core's quick_gelu
    (not imported: its module compiles fused kernels on import)."""
    return x * torch.sigmoid(SWIGLU_ALPHA * x)


def export_config(config: dict) -> dict:
    """The exported config.json: the weights are written dequantised, so no quantization_config."""
    return {k: v for k, v in config.items() if k != "quantization_config"}


def megatron_lm_args(spec: ModelSpec) -> dict:
    """What Megatron-LM's args say otherwise than `transformer_fields`: YaRN as GPTModel's own
    position embedding (`position_embedding_type` yarn and the `yarn_*` values megatron-core's
    GPTModel and attention read from the config), which scales cos and sin by the attention
    factor itself, so the softmax scale is the plain 1/sqrt(d). The factor is HF's: megatron-core
    makes it mscale(factor, yarn_mscale) / mscale(factor, yarn_mscale_all_dim), here with
    mscale_all_dim 0 (a ratio's denominator of 1) and yarn_mscale solving 0.1 m ln(factor) + 1 =
    attention_factor. The trainer does not take this path (model/gpt_oss.py sets HF's
    frequencies on the local spec); megatron-core's YaRN frequencies are HF's, `truncate` being
    its `yarn_correction_range_round_to_int`."""
    yarn = spec.rope_scaling
    if yarn is None:
        return {"softmax_scale": None}
    factor = yarn["factor"]
    mscale = (yarn["attention_factor"] - 1.0) / (0.1 * math.log(factor)) if factor > 1 else 1.0
    return {
        "softmax_scale": None, "position_embedding_type": "yarn", "yarn_rotary_scaling_factor": factor,
        "yarn_original_max_position_embeddings": yarn["original_max_position_embeddings"],
        "yarn_beta_fast": yarn["beta_fast"], "yarn_beta_slow": yarn["beta_slow"], "yarn_mscale": mscale,
        "yarn_mscale_all_dim": 0.0, "yarn_correction_range_round_to_int": yarn["truncate"],
    }  # fmt: skip


def transformer_fields(spec: ModelSpec) -> dict:
    """megatron-core TransformerConfig fields: biases, the sink (learnable softmax offset), the
    clamped SwiGLU with its offset, YaRN's cos/sin scale as the softmax scale, the windowed
    layers (window (W - 1, 0): a token sees itself and the W - 1 before it; the 0/1 list marks
    them) and the softmax top-k router with its bias."""
    fields = {
        "add_qkv_bias": True, "add_bias_linear": True, "softmax_type": "learnable", "activation_func": quick_gelu,
        "glu_linear_offset": 1.0, "activation_func_clamp_value": spec.swiglu_limit,
        "softmax_scale": attention_factor(spec) ** 2 / math.sqrt(spec.head_dim),
        **moe_transformer_fields(spec),
    }  # fmt: skip
    if spec.sliding_layers:
        fields["window_size"] = (spec.sliding_window - 1, 0)
        fields["window_attn_skip_freq"] = [int(layer in spec.sliding_layers) for layer in range(spec.num_layers)]
    return fields
