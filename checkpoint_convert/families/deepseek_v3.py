"""DeepSeek-V3 (DeepseekV3ForCausalLM: DeepSeek-V3/R1, Kimi-K2 and distillations that keep the
architecture): multi-latent attention, `first_k_dense_replace` dense layers, then MoE layers of
`n_routed_experts` routed experts plus `n_shared_experts` shared ones, a sigmoid router whose
choice adds a loaded per-expert bias (`e_score_correction_bias`), group-limited top-k and a scale.

Multi-latent attention (megatron-core's MLASelfAttention, local spec): q is `q_b_proj(norm(
q_a_proj(x)))` (or `q_proj(x)` when `q_lora_rank` is null); `kv_a_proj_with_mqa` gives the kv
latent (normed, then `kv_b_proj` makes each head's k "nope" part and v) and one shared rotary
key part. Rows are head-major on both sides, so the up projections split over tp by rows; the
down projections and the latent norms are whole on every tp rank (as megatron-core's Transformer
Engine spec keeps them; the trainer builds its local spec so too: mcore_dpo/model/mla.py).
RoPE is interleaved (HF `rope_interleave`, megatron-core's MLA rotary), with YaRN scaling as
the config gives it (`rope_parameters` / `rope_scaling` of type "yarn"), including the
attention softmax scale HF multiplies by mscale(factor, mscale_all_dim)^2.

The router's bias is a buffer in both models: it is loaded, never trained (megatron-core's
bias update rate is set to 0). Multi-token-prediction layers (`num_nextn_predict_layers` > 0,
stored as `model.layers.{num_hidden_layers + i}.*`) are not part of HF's forward either: they
are dropped on import, with one line. Anything else this module cannot reproduce exactly is
one line naming the field.
"""

from __future__ import annotations

from checkpoint_convert.families.base import (
    ConversionError, ModelSpec, decoder_fields, expert_keys, field, moe_fields, refuse, rope_scaling_of,
    sigmoid_router_fields, sigmoid_router_transformer_fields,
)  # fmt: skip

ARCHITECTURE = "DeepseekV3ForCausalLM"
MODEL_TYPE = "deepseek_v3"
SCORE_ARCHITECTURE = "DeepseekV3ForSequenceClassification"  # its reward model (families/__init__.py)

_LAYER = "decoder.layers.{layer}."
_HF = "model.layers.{layer}."
NORM_KEYS = {
    _LAYER + "input_layernorm.weight": ("replicated", (_HF + "input_layernorm.weight",)),
    _LAYER + "pre_mlp_layernorm.weight": ("replicated", (_HF + "post_attention_layernorm.weight",)),
}
Q_LORA_KEYS = {
    _LAYER + "self_attention.linear_q_down_proj.weight": ("replicated", (_HF + "self_attn.q_a_proj.weight",)),
    _LAYER + "self_attention.q_layernorm.weight": ("replicated", (_HF + "self_attn.q_a_layernorm.weight",)),
    _LAYER + "self_attention.linear_q_up_proj.weight": ("column", (_HF + "self_attn.q_b_proj.weight",)),
}
Q_PLAIN_KEYS = {_LAYER + "self_attention.linear_q_proj.weight": ("column", (_HF + "self_attn.q_proj.weight",))}
KV_KEYS = {
    _LAYER + "self_attention.linear_kv_down_proj.weight": ("replicated", (_HF + "self_attn.kv_a_proj_with_mqa.weight",)),
    _LAYER + "self_attention.kv_layernorm.weight": ("replicated", (_HF + "self_attn.kv_a_layernorm.weight",)),
    _LAYER + "self_attention.linear_kv_up_proj.weight": ("column", (_HF + "self_attn.kv_b_proj.weight",)),
    _LAYER + "self_attention.linear_proj.weight": ("row", (_HF + "self_attn.o_proj.weight",)),
}
DENSE_MLP_KEYS = {
    _LAYER + "mlp.linear_fc1.weight": ("fc1", (_HF + "mlp.gate_proj.weight", _HF + "mlp.up_proj.weight")),
    _LAYER + "mlp.linear_fc2.weight": ("row", (_HF + "mlp.down_proj.weight",)),
}
MOE_KEYS = {
    _LAYER + "mlp.router.weight": ("replicated", (_HF + "mlp.gate.weight",)),
    _LAYER + "mlp.router.expert_bias": ("replicated", (_HF + "mlp.gate.e_score_correction_bias",)),
    _LAYER + "mlp.experts.local_experts.{expert}.linear_fc1.weight": (
        "fc1",
        (_HF + "mlp.experts.{expert}.gate_proj.weight", _HF + "mlp.experts.{expert}.up_proj.weight"),
    ),
    _LAYER + "mlp.experts.local_experts.{expert}.linear_fc2.weight": ("row", (_HF + "mlp.experts.{expert}.down_proj.weight",)),
    _LAYER + "mlp.shared_experts.linear_fc1.weight": (
        "fc1",
        (_HF + "mlp.shared_experts.gate_proj.weight", _HF + "mlp.shared_experts.up_proj.weight"),
    ),
    _LAYER + "mlp.shared_experts.linear_fc2.weight": ("row", (_HF + "mlp.shared_experts.down_proj.weight",)),
}
# transformers 5's in-memory (fused) expert tensors, read too (as Qwen3-MoE's).
FUSED_EXPERT_KEYS = {
    _HF + "mlp.experts.gate_up_proj": (_HF + "mlp.experts.{expert}.gate_proj.weight", _HF + "mlp.experts.{expert}.up_proj.weight"),
    _HF + "mlp.experts.down_proj": (_HF + "mlp.experts.{expert}.down_proj.weight",),
}
RENAMED_KEYS: dict[str, str] = {}

# HF's q_a_layernorm and kv_a_layernorm use RMSNorm's default epsilon whatever the config says;
# megatron-core's use the model's (layernorm_epsilon).
_LATENT_NORM_EPS = 1e-6


def ignored_hf_tensor(spec: ModelSpec, name: str) -> bool:
    """A multi-token-prediction layer's tensor: model.layers.{n}.* with n >= num_hidden_layers."""
    prefix = "model.layers."
    if not name.startswith(prefix):
        return False
    number = name[len(prefix):].split(".", 1)[0]
    return number.isdigit() and int(number) >= spec.num_layers


def _yarn(config: dict, *, source: str, max_positions: int) -> tuple[float, dict | None]:
    """rope_theta and the YaRN parameters (None: plain RoPE) of either config form."""
    theta, params, name, rope_type = rope_scaling_of(config, source=source)
    if params is None:
        return theta, None
    if rope_type != "yarn":
        raise ConversionError(f"{source}: field '{name}.rope_type' is {rope_type!r}; only 'default' and 'yarn' are supported")
    where = f"{source}: {name}"
    if params.get("attention_factor") is not None:
        raise ConversionError(f"{where}: field 'attention_factor' is set; megatron-core derives it from factor, mscale and mscale_all_dim")
    if params.get("truncate", True) is not True:
        raise ConversionError(f"{where}: field 'truncate' is {params['truncate']!r}; megatron-core rounds the YaRN correction range")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConversionError(f"{where}: field 'partial_rotary_factor' is {params['partial_rotary_factor']!r}; only 1.0 is supported")
    original = field(params, "original_max_position_embeddings", int, source=where)
    # HF: a missing factor is max_position_embeddings / original_max_position_embeddings.
    factor = field(params, "factor", float, source=where, default=max_positions / original)
    mscale = params.get("mscale") or 0.0
    mscale_all_dim = params.get("mscale_all_dim") or 0.0
    for key, value in (("mscale", mscale), ("mscale_all_dim", mscale_all_dim)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise ConversionError(f"{where}: field '{key}' must be a non-negative number, got {value!r}")
    # HF scales cos/sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are
    # set, else by mscale(factor, 1); megatron-core always by the ratio (mscale_all_dim 0 gives a
    # denominator of 1). The softmax scale uses mscale_all_dim alone on both sides.
    if mscale_all_dim and not mscale:
        raise ConversionError(f"{where}: field 'mscale' is unset while mscale_all_dim is {mscale_all_dim!r}; "
                              "megatron-core's YaRN cannot scale cos/sin as HF then does")
    if not mscale_all_dim:
        mscale = 1.0
    return theta, {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": original,
        "beta_fast": float(params.get("beta_fast") or 32),
        "beta_slow": float(params.get("beta_slow") or 1),
        "mscale": float(mscale),
        "mscale_all_dim": float(mscale_all_dim),
    }


def spec_from_config(config: dict, *, source: str) -> ModelSpec:
    refuse(config, "attention_bias", source=source, why="MLA projection biases are not supported")
    if config.get("rope_interleave", True) is not True:
        raise ConversionError(f"{source}: field 'rope_interleave' is {config['rope_interleave']!r}; "
                              "megatron-core's multi-latent attention rotates interleaved pairs only")
    nope = field(config, "qk_nope_head_dim", int, source=source)
    rope = field(config, "qk_rope_head_dim", int, source=source)
    if rope % 2:
        raise ConversionError(f"{source}: field 'qk_rope_head_dim' ({rope}) must be even")
    # A query head is nope + rope wide (HF's own head_dim field is the rotary part).
    base = {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_scaling")}
    common = decoder_fields({**base, "head_dim": nope + rope}, source=source)
    if common["rms_norm_eps"] != _LATENT_NORM_EPS:
        raise ConversionError(f"{source}: field 'rms_norm_eps' is {common['rms_norm_eps']!r}; HF's q/kv latent norms use "
                              f"{_LATENT_NORM_EPS} whatever it is and megatron-core's use it: only {_LATENT_NORM_EPS} is exact")
    theta, scaling = _yarn(config, source=source, max_positions=common["max_position_embeddings"])
    q_lora_rank = field(config, "q_lora_rank", int, source=source, default=0)
    kv_lora_rank = field(config, "kv_lora_rank", int, source=source)
    v_head_dim = field(config, "v_head_dim", int, source=source)
    moe = moe_fields(config, source=source, num_experts_field="n_routed_experts", moe_intermediate_field="moe_intermediate_size")
    router = sigmoid_router_fields(config, source=source, moe=moe, num_layers=common["num_layers"])
    common.update(rope_theta=theta, rope_scaling=scaling)
    return ModelSpec(
        architecture=ARCHITECTURE, family=MODEL_TYPE, qkv_bias=False, qk_layernorm=q_lora_rank > 0,
        q_lora_rank=q_lora_rank, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope, v_head_dim=v_head_dim,
        **router, **moe, **common,
    )  # fmt: skip


def layer_keys(spec: ModelSpec, *, layer: int) -> dict:
    attention = {**(Q_LORA_KEYS if spec.q_lora_rank else Q_PLAIN_KEYS), **KV_KEYS}
    attention = {**{k: v for k, v in NORM_KEYS.items() if "input_" in k}, **attention,
                 **{k: v for k, v in NORM_KEYS.items() if "pre_mlp" in k}}
    if spec.is_moe_layer(layer):
        return {**attention, **expert_keys(MOE_KEYS, num_experts=spec.num_experts)}
    return {**attention, **DENSE_MLP_KEYS}


def attention_hf_shapes(spec: ModelSpec, *, layer: int) -> dict[str, tuple[int, ...]]:
    """The HF attention tensors of a layer (and its two norms), in the key map's order."""
    h, n, rope = spec.hidden_size, spec.num_heads, spec.qk_rope_head_dim
    p = f"model.layers.{layer}."
    shapes = {p + "input_layernorm.weight": (h,)}
    if spec.q_lora_rank:
        shapes[p + "self_attn.q_a_proj.weight"] = (spec.q_lora_rank, h)
        shapes[p + "self_attn.q_a_layernorm.weight"] = (spec.q_lora_rank,)
        shapes[p + "self_attn.q_b_proj.weight"] = (n * spec.head_dim, spec.q_lora_rank)
    else:
        shapes[p + "self_attn.q_proj.weight"] = (n * spec.head_dim, h)
    shapes[p + "self_attn.kv_a_proj_with_mqa.weight"] = (spec.kv_lora_rank + rope, h)
    shapes[p + "self_attn.kv_a_layernorm.weight"] = (spec.kv_lora_rank,)
    shapes[p + "self_attn.kv_b_proj.weight"] = (n * (spec.head_dim - rope + spec.v_head_dim), spec.kv_lora_rank)
    shapes[p + "self_attn.o_proj.weight"] = (h, n * spec.v_head_dim)
    shapes[p + "post_attention_layernorm.weight"] = (h,)
    return shapes


def moe_hf_shapes(spec: ModelSpec, *, layer: int) -> dict[str, tuple[int, ...]]:
    h, f, s = spec.hidden_size, spec.moe_intermediate_size, spec.moe_shared_intermediate_size
    p = f"model.layers.{layer}.mlp."
    shapes = {p + "gate.weight": (spec.num_experts, h), p + "gate.e_score_correction_bias": (spec.num_experts,)}
    for e in range(spec.num_experts):
        shapes[p + f"experts.{e}.gate_proj.weight"] = (f, h)
        shapes[p + f"experts.{e}.up_proj.weight"] = (f, h)
        shapes[p + f"experts.{e}.down_proj.weight"] = (h, f)
    shapes[p + "shared_experts.gate_proj.weight"] = (s, h)
    shapes[p + "shared_experts.up_proj.weight"] = (s, h)
    shapes[p + "shared_experts.down_proj.weight"] = (h, s)
    return shapes


def tp_sizes(spec: ModelSpec) -> dict[str, int]:
    """The sizes a tp split cuts (field name -> size), beyond those every family has."""
    return {"n_shared_experts * moe_intermediate_size": spec.moe_shared_intermediate_size}


def transformer_fields(spec: ModelSpec) -> dict:
    """megatron-core MLATransformerConfig fields: MLA with its RoPE, and the sigmoid router
    (expert bias loaded and frozen: update rate 0), groups, scale and shared experts."""
    fields = {
        "add_qkv_bias": False,
        "multi_latent_attention": True,
        "qk_layernorm": True,  # the q/kv latent norms (local spec: IdentityOp without it)
        "q_lora_rank": spec.q_lora_rank or None,
        "kv_lora_rank": spec.kv_lora_rank,
        "qk_head_dim": spec.head_dim - spec.qk_rope_head_dim,
        "qk_pos_emb_head_dim": spec.qk_rope_head_dim,
        "v_head_dim": spec.v_head_dim,
        "rotary_base": spec.rope_theta,
        "apply_rope_fusion": False,
        **sigmoid_router_transformer_fields(spec),
    }
    yarn = spec.rope_scaling
    if yarn is None:
        # Plain RoPE; rotary_scaling_factor 1 keeps megatron-core's softmax scale at 1/sqrt(d).
        fields.update(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
    else:
        fields.update(
            rope_type="yarn", rotary_scaling_factor=yarn["factor"],
            original_max_position_embeddings=yarn["original_max_position_embeddings"],
            beta_fast=yarn["beta_fast"], beta_slow=yarn["beta_slow"], mscale=yarn["mscale"],
            mscale_all_dim=yarn["mscale_all_dim"],
        )  # fmt: skip
    return fields

