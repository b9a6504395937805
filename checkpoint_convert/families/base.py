"""What every model family shares: the validated model description (`ModelSpec`), the
one-line error type, and the readers of the config.json fields all decoder-only families
have. Pure functions only; each family module builds on these."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class ConversionError(ValueError):
    """Bad input to a conversion; str() is one line naming the file/tensor/field."""


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelSpec:
    architecture: str  # e.g. "LlamaForCausalLM"
    family: str  # the family module's name: "llama" | "mistral" | "qwen2" | "qwen3" | ...
    vocab_size: int  # unpadded, as in the HF config
    hidden_size: int
    intermediate_size: int  # the dense MLP's FFN size
    num_layers: int
    num_heads: int
    num_query_groups: int  # HF num_key_value_heads
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # Normalized llama3 form {"rope_type": "llama3", "factor", "low_freq_factor",
    # "high_freq_factor", "original_max_position_embeddings"} or None (plain RoPE).
    rope_scaling: dict | None
    tie_word_embeddings: bool
    qkv_bias: bool
    max_position_embeddings: int
    torch_dtype: str  # "float32" | "bfloat16" | "float16": dtype of the source weights
    # Mistral v0.1 configs carry a sliding window; it only matters for sequences longer than it.
    sliding_window: int | None = None
    # Per-head RMSNorm of q and k after the projection (Qwen3).
    qk_layernorm: bool = False
    # Mixture of experts (0 experts: every layer is dense).
    num_experts: int = 0
    moe_topk: int = 0
    moe_intermediate_size: int = 0  # one expert's FFN size
    # Router: True = softmax over the top-k logits (Mixtral; Qwen3-MoE with norm_topk_prob),
    # False = softmax over all experts, then the top-k probabilities unnormalised.
    moe_norm_topk: bool = True
    moe_layers: tuple[int, ...] = ()  # global numbers of the layers whose MLP is the MoE block
    router_aux_loss_coef: float = 0.0  # HF config's, 0 unless output_router_logits is true
    # Multi-latent attention (DeepSeek-V3; kv_lora_rank 0: the q/k/v attention above). head_dim
    # is then a query head's size, qk_rope_head_dim of it rotary (the rest "nope"); q_lora_rank 0
    # is a plain q projection.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # MoE router and shared experts beyond the softmax routers above (DeepSeek-V3): a sigmoid
    # score with a loaded per-expert bias for the choice, group-limited top-k (0: no groups), the
    # scale of the combined weights, and the shared experts' FFN size (0: none).
    moe_score_function: str = "softmax"
    moe_expert_bias: bool = False
    moe_router_groups: int = 0
    moe_router_group_topk: int = 0
    moe_topk_scaling: float = 1.0
    moe_shared_intermediate_size: int = 0
    # The share of head_dim that RoPE rotates, its first dims (GLM-4.5's partial_rotary_factor;
    # megatron-core's rotary_percent).
    rotary_percent: float = 1.0
    # Gemma 3: the layers (global numbers) that attend only `sliding_window` tokens back, with a
    # RoPE base of their own; linear RoPE factors (global, local layers; 1.0: none); the softmax
    # scale query_pre_attn_scalar^-0.5 (0: head_dim's); the tanh cap of the logits (0: none).
    sliding_layers: tuple[int, ...] = ()
    rope_local_theta: float = 0.0
    rope_linear_factors: tuple[float, float] = (1.0, 1.0)
    query_pre_attn_scalar: float = 0.0
    final_logit_softcapping: float = 0.0
    # GPT-OSS: the clamp of its experts' SwiGLU (0: none); its sliding layers use the Gemma 3
    # fields above (sliding_layers, sliding_window).
    swiglu_limit: float = 0.0
    # A reward model (the family's SCORE_ARCHITECTURE, `*ForSequenceClassification`): the rows of its
    # score head [num_labels, h], which replaces the LM head (nothing tied). 0: a causal LM.
    num_labels: int = 0

    @property
    def multi_latent_attention(self) -> bool:
        return self.kv_lora_rank > 0

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers


def field(config: dict, name: str, kind: type, *, source: str, default: object = ...) -> object:
    """config[name] checked to be a `kind` (numbers positive); a missing field is an error
    unless a default is given."""
    if name not in config or config[name] is None:
        if default is ...:
            raise ConversionError(f"{source}: field '{name}' is missing")
        return default
    value = config[name]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ConversionError(f"{source}: field '{name}' must be {kind.__name__}, got {value!r}")
    if kind in (int, float) and value <= 0:
        raise ConversionError(f"{source}: field '{name}' must be positive, got {value!r}")
    return value


def rope_scaling_of(config: dict, *, source: str) -> tuple[float, dict | None, str, str]:
    """rope_theta, the RoPE scaling parameters (None when absent or of type default), their
    field name and their rope_type, from either the transformers<5 form (rope_theta +
    rope_scaling) or the transformers 5 form (rope_parameters)."""
    params = config.get("rope_parameters")
    field_name = "rope_parameters"
    if not isinstance(params, dict) or not params:
        params = config.get("rope_scaling")
        field_name = "rope_scaling"
    theta = config.get("rope_theta")
    if theta is None and isinstance(params, dict):
        theta = params.get("rope_theta")
    theta = field({"rope_theta": theta}, "rope_theta", float, source=source, default=10000.0)
    if params is None:
        return theta, None, field_name, "default"
    if not isinstance(params, dict):
        raise ConversionError(f"{source}: field '{field_name}' must be an object, got {params!r}")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in (None, "default"):
        return theta, None, field_name, "default"
    return theta, params, field_name, rope_type


def rope_from_config(config: dict, *, source: str) -> tuple[float, dict | None]:
    """rope_theta and the normalized llama3 scaling (`rope_scaling_of`; other types refused)."""
    theta, params, field_name, rope_type = rope_scaling_of(config, source=source)
    if params is None:
        return theta, None
    if rope_type != "llama3":
        raise ConversionError(
            f"{source}: field '{field_name}.rope_type' is {rope_type!r}; only 'default' and 'llama3' are supported"
        )
    scaling = {"rope_type": "llama3"}
    for key, kind in (
        ("factor", float),
        ("low_freq_factor", float),
        ("high_freq_factor", float),
        ("original_max_position_embeddings", int),
    ):
        scaling[key] = field(params, key, kind, source=f"{source}: {field_name}")
    if scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ConversionError(f"{source}: field '{field_name}.high_freq_factor' must exceed low_freq_factor")
    return theta, scaling


def refuse_quantization(config: dict, *, source: str, readable: tuple[str, ...] = ()) -> None:
    """One line for a `quantization_config` whose method the family does not dequantise on import
    (`readable`: the ones it does). Read as plain weights, quantised tensors would train on their
    stored values (DeepSeek-V3's release: fp8 with `*_scale_inv` block scales)."""
    quantization = config.get("quantization_config")
    if not quantization:
        return
    method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
    if method in readable:
        return
    if readable:
        why = f"only {', '.join(map(repr, readable))} (dequantised on import) is read"
    else:
        why = ("quantised weights are not read (they would train as stored): use a bf16, fp16 or fp32 copy "
               "whose config.json has no quantization_config")
    raise ConversionError(f"{source}: field 'quantization_config.quant_method' is {method!r}; {why}")


def num_labels_of(config: dict, *, source: str) -> int:
    """The rows of a `*ForSequenceClassification` score head as transformers reads config.json:
    `num_labels` when set, else the length of `id2label`, else 2 (transformers' default)."""
    if config.get("num_labels") is not None:
        return field(config, "num_labels", int, source=source)
    id2label = config.get("id2label")
    if id2label is None:
        return 2
    if not isinstance(id2label, dict) or not id2label:
        raise ConversionError(f"{source}: field 'id2label' is {id2label!r}; a score head needs at least one label")
    return len(id2label)


def refuse(config: dict, name: str, *, source: str, why: str) -> None:
    """One line when a config turns on a feature the family does not map."""
    if config.get(name):
        raise ConversionError(f"{source}: field '{name}' is {config[name]!r}; {why}")


def decoder_fields(config: dict, *, source: str, intermediate_size: bool = True) -> dict:
    """The ModelSpec fields every family reads the same way (all but architecture, family and
    the family's own switches)."""
    hidden_act = config.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ConversionError(f"{source}: field 'hidden_act' is {hidden_act!r}; only 'silu' is supported")
    refuse(config, "mlp_bias", source=source, why="MLP biases are not supported")
    hidden_size = field(config, "hidden_size", int, source=source)
    num_heads = field(config, "num_attention_heads", int, source=source)
    num_query_groups = field(config, "num_key_value_heads", int, source=source, default=num_heads)
    if num_heads % num_query_groups:
        raise ConversionError(
            f"{source}: field 'num_key_value_heads' ({num_query_groups}) must divide num_attention_heads ({num_heads})"
        )
    if "head_dim" in config and config["head_dim"] is not None:
        head_dim = field(config, "head_dim", int, source=source)
    else:
        if hidden_size % num_heads:
            raise ConversionError(f"{source}: field 'hidden_size' ({hidden_size}) is not divisible by num_attention_heads")
        head_dim = hidden_size // num_heads
    theta, scaling = rope_from_config(config, source=source)
    dtype = config.get("torch_dtype", config.get("dtype")) or "float32"
    if dtype not in DTYPES:
        raise ConversionError(f"{source}: field 'torch_dtype' is {dtype!r}; supported: {', '.join(DTYPES)}")
    return dict(
        vocab_size=field(config, "vocab_size", int, source=source),
        hidden_size=hidden_size,
        intermediate_size=field(config, "intermediate_size", int, source=source) if intermediate_size else 0,
        num_layers=field(config, "num_hidden_layers", int, source=source),
        num_heads=num_heads,
        num_query_groups=num_query_groups,
        head_dim=head_dim,
        rms_norm_eps=field(config, "rms_norm_eps", float, source=source, default=1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        max_position_embeddings=field(config, "max_position_embeddings", int, source=source, default=2048),
        torch_dtype=dtype,
    )


# Split kinds of a key map entry (how one megatron-core tensor is cut over tp ranks):
#   replicated  every tp rank holds the whole tensor (norms, routers)
#   vocab       rows padded with zeros to the padded vocabulary, then split on dim 0
#   qkv         q, k, v fused group by group (r query heads, k head, v head), whole groups per rank
#   fc1         [gate chunk i; up chunk i] on rank i
#   column      split on dim 0 (a column-parallel linear of one HF tensor: the MLA projections)
#   row         split on dim 1 (row-parallel linear input dim)
# A key map: megatron-core name template -> (split kind, Hugging Face name templates).
# `{layer}` is the local layer number on the megatron side and the global one on the HF side.


def expert_keys(keys: dict, *, num_experts: int) -> dict:
    """A key map whose templates hold `{expert}`, written out for experts 0..num_experts-1
    (megatron-core's local expert index equals the global one at expert-parallel size 1)."""
    out = {}
    for template, (kind, hf) in keys.items():
        if "{expert}" not in template:
            out[template] = (kind, hf)
            continue
        for expert in range(num_experts):
            out[template.replace("{expert}", str(expert))] = (kind, tuple(t.replace("{expert}", str(expert)) for t in hf))
    return out


def moe_fields(config: dict, *, source: str, num_experts_field: str, moe_intermediate_field: str) -> dict:
    """The ModelSpec fields of a mixture-of-experts config; a missing expert field is one line."""
    num_experts = config.get(num_experts_field, config.get("num_local_experts"))
    num_experts = field({num_experts_field: num_experts}, num_experts_field, int, source=source)
    topk = field(config, "num_experts_per_tok", int, source=source)
    if topk > num_experts:
        raise ConversionError(f"{source}: field 'num_experts_per_tok' ({topk}) exceeds {num_experts_field} ({num_experts})")
    coef = field(config, "router_aux_loss_coef", float, source=source, default=0.0) if config.get("output_router_logits") else 0.0
    return dict(
        num_experts=num_experts,
        moe_topk=topk,
        moe_intermediate_size=field(config, moe_intermediate_field, int, source=source),
        router_aux_loss_coef=coef,
    )


def moe_transformer_fields(spec: ModelSpec) -> dict:
    """megatron-core MoE settings that reproduce the HF routers: dropless top-k over the router
    logits in fp32, the softmax over the top-k logits (`moe_norm_topk`) or over all experts
    first (then the top-k probabilities are used as they are), sequential experts (no grouped
    GEMM without Transformer Engine), the all-to-all dispatcher. The aux loss is set by the
    trainer (`--moe-aux-loss-coef`); 0 turns it off."""
    return {
        "num_moe_experts": spec.num_experts,
        "moe_router_topk": spec.moe_topk,
        "moe_ffn_hidden_size": spec.moe_intermediate_size,
        "moe_router_pre_softmax": not spec.moe_norm_topk,
        "moe_router_score_function": "softmax",
        "moe_router_dtype": "fp32",
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False,
        "moe_permute_fusion": False,
        "moe_router_load_balancing_type": "none",
        "moe_aux_loss_coeff": 0.0,
        "moe_layer_freq": moe_layer_freq(spec),
    }


def moe_layer_freq(spec: ModelSpec) -> int | list[int]:
    """megatron-core's `moe_layer_freq` of a MoE model: 1 when every layer is MoE, else the 0/1
    list. It also picks the torch_dist key layout: with 1 megatron-core stacks the layers
    (`decoder.layers.mlp....` [L, ...], what Megatron-LM's default expects), with a list it saves
    per-layer keys (`decoder.layers.N.mlp....`)."""
    pattern = [1 if spec.is_moe_layer(layer) else 0 for layer in range(spec.num_layers)]
    return 1 if all(pattern) else pattern


def sigmoid_router_fields(config: dict, *, source: str, moe: dict, num_layers: int) -> dict:
    """The ModelSpec fields of the DeepSeek-V3 MoE block (DeepSeek-V3, GLM-4.5), given the
    `moe_fields` of its config: dense layers below `first_k_dense_replace`, then the MoE ones;
    sigmoid scores, the choice made on score + a loaded per-expert bias, group-limited
    (`n_group`, `topk_group`), the chosen scores renormalised and scaled by
    `routed_scaling_factor`; `n_shared_experts` x moe_intermediate_size of shared experts.
    What megatron-core's router cannot reproduce is one line naming the field."""
    first_dense = field(config, "first_k_dense_replace", int, source=source, default=0) if config.get("first_k_dense_replace") else 0
    if first_dense >= num_layers:
        raise ConversionError(f"{source}: field 'first_k_dense_replace' ({first_dense}) leaves no MoE layer of {num_layers}")
    topk, experts = moe["moe_topk"], moe["num_experts"]
    if config.get("norm_topk_prob", True) is not True:
        raise ConversionError(f"{source}: field 'norm_topk_prob' is {config['norm_topk_prob']!r}; "
                              "megatron-core's sigmoid router always renormalises the top-k scores")
    if topk == 1:
        raise ConversionError(f"{source}: field 'num_experts_per_tok' is 1; megatron-core's sigmoid router "
                              "does not renormalise a single score as HF does")
    groups = field(config, "n_group", int, source=source, default=1)
    group_topk = field(config, "topk_group", int, source=source, default=groups)
    if experts % groups:
        raise ConversionError(f"{source}: field 'n_group' ({groups}) does not divide n_routed_experts ({experts})")
    if group_topk > groups:
        raise ConversionError(f"{source}: field 'topk_group' ({group_topk}) exceeds n_group ({groups})")
    if group_topk == groups:  # every group kept: no group limit (in both models)
        groups = group_topk = 0
    elif topk % group_topk or topk // group_topk != 2:
        # HF ranks a group by its two best scores; megatron-core by its top (topk / topk_group).
        raise ConversionError(f"{source}: field 'topk_group' ({group_topk}) is not num_experts_per_tok / 2 ({topk} / 2); "
                              "megatron-core then ranks the groups differently from HF's top-2 sum")
    shared = field(config, "n_shared_experts", int, source=source)
    return dict(
        moe_norm_topk=True, moe_layers=tuple(range(first_dense, num_layers)), moe_score_function="sigmoid",
        moe_expert_bias=True, moe_router_groups=groups, moe_router_group_topk=group_topk,
        moe_topk_scaling=field(config, "routed_scaling_factor", float, source=source, default=1.0),
        moe_shared_intermediate_size=shared * moe["moe_intermediate_size"],
    )  # fmt: skip


def sigmoid_router_transformer_fields(spec: ModelSpec) -> dict:
    """megatron-core MoE settings of `sigmoid_router_fields`: the sigmoid router with its expert
    bias loaded and frozen (update rate 0), groups, scale and shared experts."""
    return {
        **moe_transformer_fields(spec),
        "moe_router_score_function": "sigmoid",
        "moe_router_pre_softmax": False,
        "moe_router_enable_expert_bias": True,
        "moe_router_bias_update_rate": 0.0,
        "moe_router_num_groups": spec.moe_router_groups or None,
        "moe_router_group_topk": spec.moe_router_group_topk or None,
        "moe_router_topk_scaling_factor": spec.moe_topk_scaling,
        "moe_shared_expert_intermediate_size": spec.moe_shared_intermediate_size,
    }
