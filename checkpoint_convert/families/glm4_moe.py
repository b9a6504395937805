"""GLM-4.5 and GLM-4.5-Air (Glm4MoeForCausalLM): GQA attention with q/k/v biases
(`attention_bias`), optional per-head q/k RMSNorm (`use_qk_norm`: GLM-4.5 has it, Air not),
partial RoPE (`partial_rotary_factor`), and the DeepSeek-V3 MoE block: `first_k_dense_replace`
dense layers, then `n_routed_experts` routed experts plus `n_shared_experts` shared ones behind a
sigmoid router whose choice adds a loaded per-expert bias (`e_score_correction_bias`),
group-limited top-k and `routed_scaling_factor` (base.sigmoid_router_fields; the same HF tensors
and key map as DeepSeek-V3's MoE layers, which this module takes from there).

Partial RoPE: HF rotates the first int(head_dim x partial_rotary_factor) dims of each q and k
head, as halves (`rotate_half`, not interleaved pairs), with inverse frequencies over that
rotary dim; the rest passes through. megatron-core's RotaryEmbedding with `rotary_percent` =
the factor (and `rotary_interleaved` false) builds the same frequencies over int(kv_channels x
rotary_percent) dims and `apply_rotary_pos_emb` rotates the same leading dims by halves. The
q/k norms run before RoPE in both. A missing factor is HF's default for this model, 0.5.

Missing config fields take Glm4MoeConfig's defaults (rms_norm_eps 1e-5, first_k_dense_replace 1,
partial_rotary_factor 0.5, ...), as transformers does when it loads the config.
Multi-token-prediction layers (`num_nextn_predict_layers`, stored as
`model.layers.{num_hidden_layers + i}.*`; HF's forward has no such module) are dropped on import
with one line. Anything else this module cannot reproduce exactly is one line naming the field.
"""

from __future__ import annotations

from checkpoint_convert.families import deepseek_v3, llama, qwen2, qwen3
from checkpoint_convert.families.base import (
    ConversionError, ModelSpec, decoder_fields, expert_keys, moe_fields, sigmoid_router_fields,
    sigmoid_router_transformer_fields,
)  # fmt: skip

ARCHITECTURE = "Glm4MoeForCausalLM"
MODEL_TYPE = "glm4_moe"
# No SCORE_ARCHITECTURE: transformers has no Glm4MoeForSequenceClassification.

# The Llama attention and norms; the q/k/v biases as Qwen2's, the q/k norms as Qwen3's.
ATTENTION_KEYS = {name: entry for name, entry in llama.LAYER_KEYS.items() if ".mlp." not in name}
QKV_BIAS_KEYS = {name: entry for name, entry in qwen2.LAYER_KEYS.items() if name.endswith("linear_qkv.bias")}
QK_NORM_KEYS = {name: entry for name, entry in qwen3.LAYER_KEYS.items() if name.endswith(("q_layernorm.weight", "k_layernorm.weight"))}
# The MLP of a layer: dense below first_k_dense_replace, else DeepSeek-V3's MoE block (router
# with its bias, routed experts, shared experts; the same HF names).
DENSE_MLP_KEYS = deepseek_v3.DENSE_MLP_KEYS
MOE_KEYS = deepseek_v3.MOE_KEYS
FUSED_EXPERT_KEYS = deepseek_v3.FUSED_EXPERT_KEYS
RENAMED_KEYS: dict[str, str] = {}
moe_hf_shapes = deepseek_v3.moe_hf_shapes
tp_sizes = deepseek_v3.tp_sizes
ignored_hf_tensor = deepseek_v3.ignored_hf_tensor  # the multi-token-prediction layers

# Glm4MoeConfig's defaults (transformers 5.24) of the fields read here: what a config.json
# without them means.
HF_DEFAULTS = {
    "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944, "num_hidden_layers": 46,
    "num_attention_heads": 96, "num_key_value_heads": 8, "hidden_act": "silu", "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "attention_bias": False, "moe_intermediate_size": 1408,
    "num_experts_per_tok": 8, "n_shared_experts": 1, "n_routed_experts": 128, "routed_scaling_factor": 1.0,
    "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "norm_topk_prob": True, "use_qk_norm": False,
}
PARTIAL_ROTARY_DEFAULT = 0.5


def _partial_rotary_factor(config: dict, *, source: str) -> float:
    """transformers 5's `rope_parameters.partial_rotary_factor`, else the top-level field of
    transformers 4's config.json, else HF's default 0.5; in (0, 1]."""
    params = config.get("rope_parameters")
    value = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    if value is None:
        value = config.get("partial_rotary_factor")
    if value is None:
        return PARTIAL_ROTARY_DEFAULT
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConversionError(f"{source}: field 'partial_rotary_factor' must be a number in (0, 1], got {value!r}")
    return float(value)


def spec_from_config(config: dict, *, source: str) -> ModelSpec:
    config = {**HF_DEFAULTS, **{k: v for k, v in config.items() if v is not None}}
    for name in ("rope_parameters", "rope_scaling"):
        params = config.get(name)
        rope_type = params.get("rope_type", params.get("type")) if isinstance(params, dict) else None
        if rope_type not in (None, "default"):
            raise ConversionError(f"{source}: field '{name}.rope_type' is {rope_type!r}; only 'default' is supported")
    common = decoder_fields(config, source=source)
    rotary_percent = _partial_rotary_factor(config, source=source)
    if int(common["head_dim"] * rotary_percent) < 2:
        raise ConversionError(f"{source}: field 'partial_rotary_factor' ({rotary_percent}) leaves no rotary pair "
                              f"of head_dim {common['head_dim']}")
    moe = moe_fields(config, source=source, num_experts_field="n_routed_experts", moe_intermediate_field="moe_intermediate_size")
    router = sigmoid_router_fields(config, source=source, moe=moe, num_layers=common["num_layers"])
    return ModelSpec(
        architecture=ARCHITECTURE, family=MODEL_TYPE, qkv_bias=bool(config["attention_bias"]),
        qk_layernorm=bool(config["use_qk_norm"]), rotary_percent=rotary_percent, **router, **moe, **common,
    )  # fmt: skip


def layer_keys(spec: ModelSpec, *, layer: int) -> dict:
    attention = {**ATTENTION_KEYS, **(QKV_BIAS_KEYS if spec.qkv_bias else {}), **(QK_NORM_KEYS if spec.qk_layernorm else {})}
    if spec.is_moe_layer(layer):
        return {**attention, **expert_keys(MOE_KEYS, num_experts=spec.num_experts)}
    return {**attention, **DENSE_MLP_KEYS}


def transformer_fields(spec: ModelSpec) -> dict:
    """megatron-core TransformerConfig fields: q/k/v biases, the q/k norms (per head, the model's
    epsilon), RoPE by halves (not interleaved; `rotary_percent` goes to GPTModel), the sigmoid router
    and shared experts."""
    return {"add_qkv_bias": spec.qkv_bias, "qk_layernorm": spec.qk_layernorm, "rotary_interleaved": False,
            **sigmoid_router_transformer_fields(spec)}
