"""Megatron-LM's `args` Namespace (stored in a torch_dist checkpoint's common.pt) <-> ModelSpec.

Megatron-LM's `--use-checkpoint-args` copies model fields from the saved `args` into its own
(`load_args_from_checkpoint` in megatron/training/checkpointing.py). `checkpoint_args` writes
those fields, plus the ones this package needs to read a checkpoint back without an HF config
(`norm_epsilon`, `use_rope_scaling`, `rope_scaling_factor`, `qk_layernorm`, the unpadded
`vocab_size`). `hf_config_from_args` goes the other way, for checkpoints that Megatron-LM,
Megatron-Bridge or ms-swift wrote: it refuses models this package cannot map (LayerNorm, no
SwiGLU, linear biases, learned positions; MoE routing other than softmax top-k without expert
bias, groups or shared experts) with one line naming the field. MoE args (`num_experts`,
`moe_router_topk`, `moe_ffn_hidden_size`, `moe_layer_freq`, `moe_router_pre_softmax`) become a
Qwen3-MoE config when the model has q/k layernorms, else a Mixtral one.
"""

from __future__ import annotations

import argparse

from checkpoint_convert.families import family_of
from checkpoint_convert.families.base import DTYPES, ConversionError, ModelSpec, moe_layer_freq
from checkpoint_convert.mapping import expert_tp_size

# megatron-core's llama3.1 RoPE scaling hard-codes these three of its four parameters.
MEGATRON_ROPE_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _rotary_base(theta: float) -> int | float:
    return int(theta) if float(theta).is_integer() else theta  # Megatron-LM parses --rotary-base as int


def checkpoint_args(spec: ModelSpec, *, tp: int, pp: int, padded_vocab_size: int, vocab_divisor: int, dtype: str,
                    ep: int = 1, vpp: int = 1) -> argparse.Namespace:
    """The args a torch_dist checkpoint of this model, written at tp x pp (x ep) with `vpp` model
    chunks per pipeline rank, carries. Chunks are recorded as Megatron-LM records a run given
    --num-virtual-stages-per-pipeline-rank N: that arg and virtual_pipeline_model_parallel_size
    N, num_layers_per_virtual_pipeline_stage None (its validate_args refuses both set)."""
    torch_dtype = DTYPES[dtype]
    scaling = spec.rope_scaling if spec.rope_scaling and spec.rope_scaling.get("rope_type") == "llama3" else None
    args = dict(
        # model shape
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.intermediate_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_query_groups,
        group_query_attention=spec.num_query_groups != spec.num_heads,
        kv_channels=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        seq_length=spec.max_position_embeddings,
        # positions
        position_embedding_type="rope",
        add_position_embedding=False,
        use_rotary_position_embeddings=True,
        rotary_base=_rotary_base(spec.rope_theta),
        rotary_percent=spec.rotary_percent,
        rotary_interleaved=False,
        use_rope_scaling=scaling is not None,
        rope_scaling_factor=float(scaling["factor"]) if scaling else 8.0,
        # layers
        normalization="RMSNorm",
        norm_epsilon=spec.rms_norm_eps,
        apply_layernorm_1p=False,
        swiglu=True,
        squared_relu=False,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_layernorm,
        apply_query_key_layer_scaling=False,
        untie_embeddings_and_output_weights=not spec.tie_word_embeddings,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        num_experts=spec.num_experts or None,
        mtp_num_layers=None,
        # vocabulary
        vocab_size=spec.vocab_size,
        padded_vocab_size=padded_vocab_size,
        make_vocab_size_divisible_by=vocab_divisor,
        # precision
        params_dtype=torch_dtype,
        bf16=dtype == "bfloat16",
        fp16=dtype == "float16",
        # layout of the writer
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        num_virtual_stages_per_pipeline_rank=vpp if vpp > 1 else None,
        num_layers_per_virtual_pipeline_stage=None,
        expert_model_parallel_size=ep,
        context_parallel_size=1,
        data_parallel_size=1,
        world_size=tp * pp,
        ckpt_format="torch_dist",
        use_dist_ckpt=True,
        **(_moe_args(spec, tp=tp, ep=ep) if spec.num_experts else {}),
    )
    return argparse.Namespace(**{**args, **_family_args(spec)})


def _moe_args(spec: ModelSpec, *, tp: int, ep: int) -> dict:
    """Megatron-LM's --moe-* args of a MoE model: the routing of the HF model (mapping's
    moe_transformer_fields), sequential experts. moe_layer_freq is 1 when every layer is MoE
    (megatron-core then stacks the layers), else the 0/1 list (per-layer keys)."""

    return dict(
        moe_router_topk=spec.moe_topk, moe_ffn_hidden_size=spec.moe_intermediate_size,
        moe_layer_freq=moe_layer_freq(spec), moe_router_pre_softmax=not spec.moe_norm_topk,
        moe_router_score_function="softmax", moe_router_dtype="fp32", moe_router_enable_expert_bias=False,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False, moe_shared_expert_intermediate_size=None,
        expert_tensor_parallel_size=expert_tp_size(tp=tp, ep=ep),
    )  # fmt: skip


# A family's gated activation (families/*.py `activation_func`) -> the Megatron-LM flags naming it.
_ACTIVATION_ARGS = {"quick_gelu": {"swiglu": False, "quick_geglu": True}}


def _family_args(spec: ModelSpec) -> dict:
    """The family's own TransformerConfig fields (families/*.py `transformer_fields`: multi-latent
    attention's ranks and YaRN, the sigmoid router with its groups, scale and shared experts,
    sinks, windows, biases, the clamped GLU) under the names Megatron-LM's args give them: its
    core_transformer_config_from_args copies every arg named like a config field, and calls the
    experts `num_experts`. An activation function is not an arg: Megatron-LM names its gated ones
    by flags (`swiglu`, `quick_geglu` for GPT-OSS's); Gemma 3's tanh GELU has none, and is known
    from the checkpoint's hf_files, as Gemma 3's (1 + w) norms and sandwich norms are."""
    args = {}
    for name, value in family_of(spec).transformer_fields(spec).items():
        if name == "activation_func":
            args.update(_ACTIVATION_ARGS.get(value.__name__, {"swiglu": False}))
            continue
        args["num_experts" if name == "num_moe_experts" else name] = value
    if "rotary_base" in args:
        args["rotary_base"] = _rotary_base(args["rotary_base"])
    family_args = getattr(family_of(spec), "megatron_lm_args", None)  # what a family's args say otherwise
    return {**args, **(family_args(spec) if family_args else {})}


def _get(args: object, name: str, kind: type | tuple[type, ...], *, source: str, default: object = ...) -> object:
    value = getattr(args, name, None)
    if value is None:
        if default is ...:
            raise ConversionError(f"{source}: field 'args.{name}' is missing (pass --hf-config DIR)")
        return default
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,))):
        raise ConversionError(f"{source}: field 'args.{name}' has unexpected value {value!r}")
    return value


def _refuse(args: object, name: str, supported: object, *, source: str, default: object) -> None:
    value = getattr(args, name, default)
    if value is None:
        value = default
    if value != supported:
        raise ConversionError(f"{source}: field 'args.{name}' is {value!r}; only {supported!r} is supported")


def hf_config_from_args(args: object, *, source: str, padded_vocab_size: int) -> dict:
    """An HF config.json (as a dict) for the model Megatron's args describe.

    The family is Qwen3 when the checkpoint has q/k layernorms, Qwen2 when it has qkv biases,
    Llama otherwise (Mistral without a sliding window is the same model); with experts
    (`num_experts`) Qwen3-MoE when it has q/k layernorms, Mixtral otherwise. The unpadded vocabulary is args.vocab_size when the
    writer recorded it, else the padded one: Megatron-LM trains on the padded vocabulary.
    """
    if not isinstance(args, (argparse.Namespace,)) and not hasattr(args, "__dict__"):
        raise ConversionError(f"{source}: 'args' is not a Namespace")
    for name, plain in (("multi_latent_attention", False), ("softmax_type", "vanilla"), ("window_size", None),
                        ("quick_geglu", False)):  # fmt: skip
        value = getattr(args, name, plain)
        if value not in (plain, None):  # the families that need their HF config (their args are written above)
            raise ConversionError(f"{source}: field 'args.{name}' is {value!r}; a model with it is read with its HF "
                                  "config (pass --hf-config DIR)")
    _refuse(args, "normalization", "RMSNorm", source=source, default="LayerNorm")
    _refuse(args, "swiglu", True, source=source, default=False)
    _refuse(args, "add_bias_linear", False, source=source, default=True)
    _refuse(args, "position_embedding_type", "rope", source=source, default="learned_absolute")
    _refuse(args, "rotary_percent", 1.0, source=source, default=1.0)
    _refuse(args, "rotary_interleaved", False, source=source, default=False)
    _refuse(args, "apply_layernorm_1p", False, source=source, default=False)
    _refuse(args, "squared_relu", False, source=source, default=False)
    hidden = _get(args, "hidden_size", int, source=source)
    heads = _get(args, "num_attention_heads", int, source=source)
    gqa = _get(args, "group_query_attention", bool, source=source, default=False)
    groups = _get(args, "num_query_groups", int, source=source) if gqa else heads
    qkv_bias = _get(args, "add_qkv_bias", bool, source=source, default=False)
    qk_layernorm = _get(args, "qk_layernorm", bool, source=source, default=False)
    if qkv_bias and qk_layernorm:
        raise ConversionError(f"{source}: fields 'args.add_qkv_bias' and 'args.qk_layernorm' are both true; no supported family has both")
    num_experts = _get(args, "num_experts", int, source=source, default=0)
    if num_experts:
        architecture, model_type = ("Qwen3MoeForCausalLM", "qwen3_moe") if qk_layernorm else ("MixtralForCausalLM", "mixtral")
    else:
        architecture, model_type = ("Qwen3ForCausalLM", "qwen3") if qk_layernorm else (
            ("Qwen2ForCausalLM", "qwen2") if qkv_bias else ("LlamaForCausalLM", "llama"))
    if num_experts and qkv_bias:
        raise ConversionError(f"{source}: field 'args.add_qkv_bias' is true in a model with experts; no supported MoE family has qkv biases")
    vocab = _get(args, "vocab_size", int, source=source, default=padded_vocab_size)
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": _get(args, "ffn_hidden_size", int, source=source),
        "num_hidden_layers": _get(args, "num_layers", int, source=source),
        "num_attention_heads": heads,
        "num_key_value_heads": groups,
        "head_dim": _get(args, "kv_channels", int, source=source, default=hidden // heads),
        "max_position_embeddings": _get(args, "max_position_embeddings", int, source=source),
        "rms_norm_eps": float(_get(args, "norm_epsilon", (float, int), source=source, default=1e-5)),
        "rope_theta": float(_get(args, "rotary_base", (int, float), source=source, default=10000)),
        "tie_word_embeddings": not _get(args, "untie_embeddings_and_output_weights", bool, source=source, default=False),
        "vocab_size": vocab,
        "hidden_act": "silu",
    }
    if _get(args, "use_rope_scaling", bool, source=source, default=False):
        factor = float(_get(args, "rope_scaling_factor", (float, int), source=source, default=8.0))
        config["rope_scaling"] = {"rope_type": "llama3", "factor": factor, **MEGATRON_ROPE_SCALING}
    if num_experts:
        config.update(_moe_config(args, num_experts=num_experts, qwen3=qk_layernorm, source=source))
    return config


def moe_layer_pattern(freq: object, *, num_layers: int, source: str) -> list[int]:
    """Megatron-LM's --moe-layer-freq (after its parser: an int N, every Nth layer from layer 0
    is MoE, or a list of 0/1 per layer) as one 0/1 per layer."""
    if isinstance(freq, int) and not isinstance(freq, bool) and freq >= 1:
        return [1 if layer % freq == 0 else 0 for layer in range(num_layers)]
    if isinstance(freq, (list, tuple)) and len(freq) == num_layers and all(v in (0, 1) for v in freq):
        return [int(v) for v in freq]
    raise ConversionError(f"{source}: field 'args.moe_layer_freq' is {freq!r}; expected an int >= 1 or {num_layers} 0/1 values")


def _moe_config(args: object, *, num_experts: int, qwen3: bool, source: str) -> dict:
    """The MoE fields of a Qwen3-MoE (q/k norms) or Mixtral config for Megatron-LM's --moe-* args:
    dropless softmax top-k routing without bias, groups or scaling, no shared experts."""
    for name, supported, default in (
        ("moe_router_score_function", "softmax", "softmax"), ("moe_router_enable_expert_bias", False, False),
        ("moe_shared_expert_intermediate_size", None, None), ("moe_router_num_groups", None, None),
        ("moe_router_group_topk", None, None), ("moe_expert_capacity_factor", None, None),
        ("moe_use_legacy_grouped_gemm", False, False), ("moe_router_topk_scaling_factor", None, None),
    ):  # fmt: skip
        if getattr(args, name, default) not in (default, supported):
            raise ConversionError(f"{source}: field 'args.{name}' is {getattr(args, name)!r}; only {supported!r} is supported")
    layers = _get(args, "num_layers", int, source=source)
    pattern = moe_layer_pattern(getattr(args, "moe_layer_freq", None) or 1, num_layers=layers, source=source)
    topk = _get(args, "moe_router_topk", int, source=source, default=2)
    ffn = _get(args, "moe_ffn_hidden_size", int, source=source, default=None) or _get(args, "ffn_hidden_size", int, source=source)
    pre_softmax = _get(args, "moe_router_pre_softmax", bool, source=source, default=False)
    if qwen3:
        return {"num_experts": num_experts, "num_experts_per_tok": topk, "moe_intermediate_size": ffn,
                "norm_topk_prob": not pre_softmax, "decoder_sparse_step": 1,
                "mlp_only_layers": [layer for layer, moe in enumerate(pattern) if not moe]}  # fmt: skip
    if 0 in pattern:
        raise ConversionError(f"{source}: field 'args.moe_layer_freq' makes layers {[i for i, m in enumerate(pattern) if not m]} "
                              "dense; Mixtral (no q/k layernorm) has experts on every layer")
    if pre_softmax:
        raise ConversionError(f"{source}: field 'args.moe_router_pre_softmax' is True; Mixtral (no q/k layernorm) "
                              "renormalises its top-k probabilities (False)")
    return {"num_local_experts": num_experts, "num_experts_per_tok": topk, "intermediate_size": ffn, "sliding_window": None}


def layout_from_args(args: object) -> tuple[int, int]:
    """(tp, pp) the checkpoint was written at; Megatron-LM's default is 1 for a missing field."""
    tp = getattr(args, "tensor_model_parallel_size", None) or 1
    pp = getattr(args, "pipeline_model_parallel_size", None) or 1
    return int(tp), int(pp)
