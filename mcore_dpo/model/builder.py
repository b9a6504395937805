"""Model builder: an HF config (as a ModelSpec) -> megatron-core GPTModel chunk for this stage.

The key map between Hugging Face and megatron-core names lives in
`checkpoint_convert.mapping`; this module builds the modules and fills them from it,
so training and conversion share one source of truth.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from checkpoint_convert.families import family_of
from checkpoint_convert.families.base import ModelSpec
from checkpoint_convert.mapping import padded_vocab_size, sequential_expert_name, stage_layers
from mcore_dpo.model.rope import rope_returning
from mcore_dpo.parallel.mesh import Layout, Mesh
from mcore_dpo.parallel.platform import fused_kernel_fields


def layer_spec_name(*, use_te: bool) -> str:
    return "te" if use_te else "local"


def recompute_fields(recompute: str, recompute_num_layers: int | None) -> dict:
    """TransformerConfig's activation-recompute fields for --recompute: "none" keeps every
    activation; "selective" recomputes the core attention (softmax and probabilities, megatron-core's
    default recompute_modules ["core_attn"]); "full" keeps only the input of each chunk of
    `recompute_num_layers` layers (default 1: every layer) and reruns the chunk in the backward
    (recompute_method "uniform")."""
    if recompute == "none":
        return {}
    if recompute == "selective":
        return {"recompute_granularity": "selective"}
    if recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform",
                "recompute_num_layers": recompute_num_layers or 1}
    raise ValueError(f"recompute: {recompute!r} is not none, selective or full")


def transformer_config(
    spec: ModelSpec, *, mesh: Mesh, dtype: torch.dtype, on_gpu: bool, sequence_parallel: bool = False,
    grouped_experts: bool = False, deterministic: bool = False, fused: dict[str, bool] | None = None,
    recompute: str = "none", recompute_num_layers: int | None = None,
):
    """megatron-core's TransformerConfig of this stage. `grouped_experts`: the MoE layers' experts
    are one grouped GEMM per projection (`moe_grouped_gemm`; the Transformer Engine spec only).
    `fused`: the fused kernels' fields (`platform.fused_kernel_fields` decides; none by default).
    `recompute`, `recompute_num_layers`: activation recompute (`recompute_fields`)."""
    from megatron.core.transformer import TransformerConfig

    layout = mesh.layout
    # One explicit per-stage layout so that uneven layer splits match checkpoint_convert's. With
    # model chunks (--vpp) one row per virtual stage, in virtual-stage order (chunk c of stage s is
    # row c*pp + s), from which megatron-core takes its virtual pipeline size.
    stages, virtual = [], layout.pp * layout.vpp
    for stage in range(virtual):
        n = len(stage_layers(spec.num_layers, pp=virtual, pp_rank=stage))
        row = ["decoder"] * n
        if stage == 0:
            row = ["embedding"] + row
        if stage == virtual - 1:
            row = row + ["loss"]
        stages.append(row)
    # Multi-latent attention (DeepSeek-V3) has a config class of its own (its MLA and YaRN fields).
    config_class = TransformerConfig
    if spec.multi_latent_attention:
        from megatron.core.transformer.transformer_config import MLATransformerConfig as config_class
    return config_class(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.intermediate_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.v_head_dim if spec.multi_latent_attention else spec.head_dim,  # MLA: the v head (mla.py)
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=layout.tp,
        # Activations outside the tensor-parallel linears are split over tp along the sequence.
        sequence_parallel=sequence_parallel,
        pipeline_model_parallel_size=layout.pp,
        # Context parallelism: each row split over cp ranks. Transformer Engine's attention runs it
        # itself (cp_comm_type "p2p": a ring of key/value exchanges); the local spec's core
        # attention is model/cp_attention.py's (keys and values all-gathered over cp).
        context_parallel_size=layout.cp,
        **({"cp_comm_type": "p2p"} if layout.cp > 1 else {}),
        # Experts split over ep ranks: their parameters are then reduced over the
        # expert-data-parallel group (allreduce=False), not over dp.
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
        pipeline_model_parallel_layout=stages if layout.pp > 1 else None,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        pipeline_dtype=dtype,
        use_cpu_initialization=not on_gpu,
        # Weights always come from a checkpoint, but megatron-core only marks tensor-parallel
        # parameters (which the gradient norm relies on) when it initialises them.
        perform_initialization=True,
        attention_softmax_in_fp32=True,
        deterministic_mode=deterministic,  # --deterministic (platform.make_deterministic)
        **recompute_fields(recompute, recompute_num_layers),  # --recompute, --recompute-num-layers
        # What differs by family (qkv bias, qk norms, experts): the family module says; then the
        # fused kernels where the platform has them (platform.fused_kernel_fields), else none.
        **{"activation_func": F.silu, "add_bias_linear": False, **_family_fields(spec, grouped_experts=grouped_experts),
           **(fused or fused_kernel_fields(requested=False, use_te=False, on_gpu=False, moe=bool(spec.num_experts)))},
    )


def _family_fields(spec: ModelSpec, *, grouped_experts: bool) -> dict:
    fields = family_of(spec).transformer_fields(spec)
    if spec.family == "gpt_oss":
        # The fused bias-activation kernel takes megatron-core's own quick_gelu only (GPT-OSS's is
        # the family's, the same formula): on every platform, the unfused clamped SwiGLU.
        from megatron.core.fusions.fused_bias_geglu import quick_gelu

        fields["activation_func"] = quick_gelu
    if grouped_experts:
        if not spec.num_experts:
            raise ValueError(f"grouped_experts: {spec.architecture} has no experts")
        fields["moe_grouped_gemm"] = True
    return fields


def check_buildable(spec: ModelSpec, *, layout: Layout, use_te: bool, grouped_experts: bool = False) -> None:
    """Raise ValueError (one line) where `build_stage_model` cannot build `spec` at `layout`: every
    refusal of the builder, callable before any rank starts (verify's parent does)."""
    if spec.family in ("gpt_oss", "gemma3_text") and use_te:
        name, module = ("GPT-OSS", "gpt_oss") if spec.family == "gpt_oss" else ("Gemma 3", "gemma3")
        raise ValueError(f"{name}: the Transformer Engine layer spec is not supported; build the local spec "
                         f"(mcore_dpo/model/{module}.py)")
    if spec.family == "gpt_oss" and layout.etp > 1:
        # megatron-core 0.16.1's expert MLP adds its fc2 bias on every expert-tp rank before the sum.
        raise ValueError(f"GPT-OSS: experts split over {layout.etp} tensor-parallel ranks would add each "
                         "expert's output bias that many times in megatron-core; at tp > 1 use --ep > 1 "
                         "(experts whole on their rank)")
    if layout.cp > 1 and (spec.family == "gemma3_text" or spec.num_experts or spec.multi_latent_attention):
        raise ValueError(f"context parallelism: not supported for {spec.architecture} (dense models of the "
                         "standard layer spec only)")
    if grouped_experts and not use_te:
        # The local spec's grouped experts are megatron-core's legacy GroupedMLP (bf16 only, other weights).
        raise ValueError("grouped_experts: needs the Transformer Engine layer spec (use_te)")


def build_stage_model(
    spec: ModelSpec, *, mesh: Mesh, dtype: torch.dtype, on_gpu: bool, use_te: bool, sequence_parallel: bool = False,
    grouped_experts: bool = False, deterministic: bool = False, fused_kernels: bool | None = None,
    recompute: str = "none", recompute_num_layers: int | None = None, arbitrary_masks: bool = False,
    chunk: int = 0,
):
    """This rank's GPTModel chunk: embedding on the first stage, norm + output layer on the last
    (a reward model's score head, `spec.num_labels`: model/score_head.py). With virtual pipeline
    stages (`mesh.layout.vpp` > 1) model chunk `chunk` of this rank (megatron-core's vp_stage):
    the embedding on chunk 0 of stage 0, the output layer on the last chunk of the last stage.
    With `sequence_parallel`, the hidden states between the tensor-parallel linears (and
    between pipeline stages) are [s/tp, b, h]. `grouped_experts` (Transformer Engine spec, MoE
    models): megatron-core's TEGroupedMLP experts instead of its SequentialMLP; their parameters
    are named differently (`shard_names` translates). `arbitrary_masks`: attention takes any
    `segment_mask` (shared-prompt rows); the local spec always does, the Transformer Engine
    spec's attention is switched from its built-in causal mask to TE's arbitrary one."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs

    check_buildable(spec, layout=mesh.layout, use_te=use_te, grouped_experts=grouped_experts)
    config = transformer_config(spec, mesh=mesh, dtype=dtype, on_gpu=on_gpu, sequence_parallel=sequence_parallel,
                                grouped_experts=grouped_experts, deterministic=deterministic,
                                recompute=recompute, recompute_num_layers=recompute_num_layers,
                                fused=fused_kernel_fields(requested=fused_kernels, use_te=use_te, on_gpu=on_gpu,
                                                          moe=bool(spec.num_experts)))
    vp_stage = chunk if mesh.layout.vpp > 1 else None  # megatron-core's virtual pipeline stage
    first, last = mesh.holds_input(chunk), mesh.holds_output(chunk)
    if spec.family == "gemma3_text":  # sandwich (1 + w) norms, local/global layers: a spec module of ours
        from mcore_dpo.model import gemma3

        layer_spec = gemma3.block_spec(config, pp_rank=mesh.pp_rank, vp_stage=vp_stage)
    elif config.num_moe_experts:
        # Dense and MoE layers mixed (moe_layer_freq): the block spec of this stage's layers.
        layer_spec = gpt_layer_specs.get_gpt_decoder_block_spec(
            config, use_transformer_engine=use_te, normalization="RMSNorm", pp_rank=mesh.pp_rank, vp_stage=vp_stage
        )
        if sequence_parallel and not use_te:
            layer_spec = _block_spec_with_sp_norms(layer_spec)
        if spec.multi_latent_attention:
            from mcore_dpo.model.mla import with_latent_core_attention

            layer_spec = with_latent_core_attention(layer_spec)
        if spec.family == "gpt_oss":  # sinks, windows by position, YaRN by halves: a spec module of ours
            from mcore_dpo.model import gpt_oss

            layer_spec = gpt_oss.with_sink_attention(layer_spec)
    elif use_te:
        layer_spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=config.qk_layernorm)
    else:
        layer_spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=config.qk_layernorm)
        if mesh.layout.cp > 1:  # megatron-core's local attention refuses cp > 1
            from mcore_dpo.model.cp_attention import with_context_parallel_attention

            layer_spec = with_context_parallel_attention(layer_spec)
        if sequence_parallel:
            layer_spec = _local_block_spec_with_sp_norms(layer_spec, config=config, pp_rank=mesh.pp_rank,
                                                         vp_stage=vp_stage)
    if arbitrary_masks and use_te:
        layer_spec = _with_arbitrary_masks(layer_spec)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=padded_vocab_size(spec.vocab_size, tp=mesh.layout.tp),
        max_sequence_length=spec.max_position_embeddings,
        pre_process=first,
        post_process=last,
        share_embeddings_and_output_weights=spec.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_percent=spec.rotary_percent,  # partial RoPE (GLM-4.5): the first dims of each head
        rotary_base=int(spec.rope_theta) if float(spec.rope_theta).is_integer() else spec.rope_theta,
        vp_stage=vp_stage,
    )
    if spec.num_labels and last:  # a reward model: the score head in place of the LM head
        from mcore_dpo.model.score_head import attach_score_head

        attach_score_head(model, num_labels=spec.num_labels, hidden_size=spec.hidden_size, dtype=dtype)
    if spec.family == "gemma3_text":
        gemma3.adapt_model(model, spec, dtype=dtype)
    if spec.family == "gpt_oss":
        gpt_oss.adapt_model(model, spec)
    if spec.moe_expert_bias:
        _expert_bias_as_frozen_parameters(model)
    if first:
        model.embedding.register_forward_hook(_canonical_strides)
        if recompute == "full":
            model.embedding.register_forward_hook(_recompute_input_requires_grad)
    if spec.rope_scaling is not None and spec.rope_scaling["rope_type"] == "llama3" and hasattr(model, "rotary_pos_emb"):
        # megatron-core's llama3 scaling hard-codes three of its four parameters: set the
        # inverse frequencies from the checkpoint's own values instead.
        model.rotary_pos_emb.inv_freq = llama3_inv_freq(
            head_dim=spec.head_dim, rope_theta=spec.rope_theta, rope_scaling=spec.rope_scaling
        ).to(model.rotary_pos_emb.inv_freq.device)
    return model


def _with_arbitrary_masks(layer_spec):
    """A copy of a layer (or block) spec whose self-attention reads the mask it is given
    (megatron-core's AttnMaskType.arbitrary) instead of building a causal one."""
    from megatron.core.transformer.enums import AttnMaskType

    layer_spec = copy.deepcopy(layer_spec)
    for layer in getattr(layer_spec, "layer_specs", None) or [layer_spec]:
        layer.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.arbitrary
    return layer_spec


def _recompute_input_requires_grad(_module, _args, output: torch.Tensor) -> torch.Tensor:
    """Forward hook of the embedding under --recompute full. megatron-core's checkpoint is an
    autograd Function: the layers inside it get gradients only when its input requires grad. A
    frozen embedding (LoRA) gives an input that does not, and the first stage's trainable
    weights would silently get none. With grad enabled, the output is made a leaf that requires
    grad (nothing flows back into the frozen embedding); otherwise it is returned as it is."""
    if torch.is_grad_enabled() and not output.requires_grad:
        return output.detach().requires_grad_()
    return output


def _expert_bias_as_frozen_parameters(model: torch.nn.Module) -> None:
    """megatron-core's routers keep their expert bias (DeepSeek-V3's e_score_correction_bias) in a
    buffer. Made a parameter that requires no gradient, it is loaded and exported with the
    weights (which go by named_parameters), while the optimizer, DDP and the gradient
    norm (which take only trainable parameters) leave it alone; megatron-core's own update of the
    bias (in its finalize_model_grads, not called here) is also off (update rate 0)."""
    for module in model.modules():
        bias = module._buffers.get("expert_bias")
        if bias is not None:
            del module._buffers["expert_bias"]
            module.expert_bias = torch.nn.Parameter(bias, requires_grad=False)


def _canonical_strides(_module, _args, output: torch.Tensor) -> torch.Tensor:
    """Forward hook of the embedding: its [s, b, h] output with the strides of a fresh tensor.

    megatron-core turns [b, s, h] into [s, b, h] by `transpose(0, 1).contiguous()`, which for a
    packed row (b = 1) copies nothing and keeps the batch stride s*h. torch.matmul then folds
    such an input into one matrix product only when the weight requires grad, and otherwise
    runs a batched product of s one-row products, which rounds differently: with identical
    weights, the policy (trainable) and the frozen reference would give different log-probs.
    A view with canonical strides (free: no copy) makes both fold."""
    return output.contiguous().view(output.shape)


def place_on_device(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The model on `device`, its RoPE frequencies too: megatron-core keeps them in a plain
    attribute that `Module.to` does not move, and copies them over in the first forward, a
    host->device copy that waits for the GPU."""
    model = model.to(device)
    rope = getattr(model, "rotary_pos_emb", None)
    if rope is not None:
        rope.inv_freq = rope.inv_freq.to(device)
    return model


class SequenceParallelRMSNorm:
    """torch RMSNorm whose weight is marked `sequence_parallel` (megatron-core's torch-norm
    wrapper refuses sequence parallelism, and its apex norm needs CUDA). An RMSNorm acts on each
    token alone, so it runs unchanged on [s/tp, b, h]; only its weight gradient, which then
    covers this rank's tokens, must be summed over tp (`allreduce_sequence_parallel_grads`)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        norm.weight.sequence_parallel = config.sequence_parallel
        return norm


def _local_block_spec_with_sp_norms(layer_spec, *, config, pp_rank: int, vp_stage: int | None = None):
    """The local layer spec for one stage, every norm (the final one too) sequence-parallel."""

    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    layer_spec = _layer_spec_with_sp_norms(layer_spec)
    num_layers = get_num_layers_to_build(config, pp_rank=pp_rank, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * num_layers, layer_norm=SequenceParallelRMSNorm)


def _block_spec_with_sp_norms(block_spec):
    """A local block spec (MoE and dense layers mixed) with every norm sequence-parallel."""
    block_spec = copy.deepcopy(block_spec)
    block_spec.layer_specs = [_layer_spec_with_sp_norms(layer_spec) for layer_spec in block_spec.layer_specs]
    block_spec.layer_norm = SequenceParallelRMSNorm
    return block_spec


def _layer_spec_with_sp_norms(layer_spec):
    """A copy of a local layer spec with every norm sequence-parallel: the pre-attention and
    pre-MLP norms and the q/k norms (which megatron-core's torch-norm wrapper refuses under
    sequence parallelism too)."""

    from megatron.core.transformer.identity_op import IdentityOp

    layer_spec = copy.deepcopy(layer_spec)
    layer_spec.submodules.input_layernorm = SequenceParallelRMSNorm
    layer_spec.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
    attention = layer_spec.submodules.self_attention.submodules
    for name in ("q_layernorm", "k_layernorm", "kv_layernorm"):  # kv_layernorm: multi-latent attention
        if getattr(attention, name, IdentityOp) not in (None, IdentityOp):
            setattr(attention, name, SequenceParallelRMSNorm)
    return layer_spec


def allreduce_sequence_parallel_grads(model: torch.nn.Module, *, tp_group) -> None:
    """Sum the gradients (`main_grad`) of sequence-parallel parameters over the tp group: each
    tp rank saw only its share of the sequence. The per-head q/k norms (qk_layernorm) are
    replicated over tp but each rank normalises only its own heads, so their gradients are
    summed too. What megatron-core's finalize_model_grads does for these parameters; the tp
    copies are then equal, so the gradient norm counts them once.

    Expert-parallel parameters (megatron-core marks them `allreduce=False`) are never summed:
    megatron-core 0.16.1 marks an expert RowParallelLinear's bias (GPT-OSS's expert fc2 bias)
    `sequence_parallel` too, but the tp ranks of an ep > 1 layout hold different experts under
    the same local names, and each expert already saw every token routed to it."""
    import torch.distributed as dist

    grads = [
        p.main_grad
        for name, p in model.named_parameters()
        if p.requires_grad
        and getattr(p, "allreduce", True)
        and (getattr(p, "sequence_parallel", False) or name.endswith(("q_layernorm.weight", "k_layernorm.weight")))
    ]
    if not grads or dist.get_world_size(tp_group) == 1:
        return
    flat = torch._utils._flatten_dense_tensors(grads)
    dist.all_reduce(flat, group=tp_group)
    for grad, summed in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        grad.copy_(summed)


def llama3_inv_freq(*, head_dim: int, rope_theta: float, rope_scaling: dict) -> torch.Tensor:
    """RoPE inverse frequencies with llama3-style scaling (the HF `rope_type: llama3` rule)."""
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    factor = float(rope_scaling["factor"])
    low = float(rope_scaling["low_freq_factor"])
    high = float(rope_scaling["high_freq_factor"])
    old_len = float(rope_scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def shard_names(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Tensors keyed by a live model's parameter names -> keyed by the names shards, checkpoints
    and optimizer files use, whatever experts ran: grouped GEMM experts' `...experts.linear_fc1.
    weight{i}` become `...experts.local_experts.{i}.linear_fc1.weight`; every other name is kept."""
    return {sequential_expert_name(name): tensor for name, tensor in tensors.items()}


def live_names(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `shard_names` for `model`: tensors keyed by shard names -> keyed by the
    model's own parameter names (a name the model does not have is kept as it is)."""
    live = {sequential_expert_name(name): name for name, _ in model.named_parameters()}
    return {live.get(name, name): tensor for name, tensor in tensors.items()}


def load_shard(model: torch.nn.Module, shard: dict[str, torch.Tensor]) -> None:
    """Copy a stage shard (megatron-core parameter names, experts as `local_experts.{i}` whatever
    the model's experts are) into the model; key sets must match."""
    params = shard_names(dict(model.named_parameters()))  # reported by the shard's (file) names
    missing = sorted(set(params) - set(shard))
    extra = sorted(set(shard) - set(params))
    if missing or extra:
        raise ValueError(f"shard does not match the model: missing {missing[:3]}, unexpected {extra[:3]}")
    with torch.no_grad():
        for name, param in params.items():
            value = shard[name]
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(f"shard tensor {name}: shape {tuple(value.shape)}, model expects {tuple(param.shape)}")
            param.copy_(value.to(param.dtype))


def open_weights(path: str, *, verify_checksums: bool = True):
    """HF-named lazy tensors of an HF directory or of a checkpoint_convert Megatron directory
    (any tp/pp: the latter is read through HF names). Has `.spec`, `.get(name)` and
    `.get_part(name, dim, start, stop)`, which reads only that part's bytes (a rank's own rows
    or columns, see mapping.hf_to_mcore_shard). verify_checksums=False: a checkpoint the driver
    has just checked against its manifest (its rank files' checksums are not read again)."""
    from checkpoint_convert.io import open_hf_dir
    from checkpoint_convert.mcore_dir import is_mcore_dir, open_mcore_dir

    if is_mcore_dir(path):
        return open_mcore_dir(path, verify_checksums=verify_checksums).hf_view()
    return open_hf_dir(path)


def tokenizer_dir(path: str) -> str:
    """Where the tokenizer files of a model directory live."""
    from checkpoint_convert.mcore_dir import is_mcore_dir, open_mcore_dir

    return str(open_mcore_dir(path).hf_files_dir) if is_mcore_dir(path) else path


def freeze(model: torch.nn.Module) -> torch.nn.Module:
    """The reference: no grads, no DDP, no optimizer state; eval mode."""
    for param in model.parameters():
        param.requires_grad_(False)
    model.eval()
    return model


def causal_mask(seq_len: int, *, device: torch.device) -> torch.Tensor:
    """[1, 1, s, s] bool, True where attention is not allowed. Right padding needs nothing more:
    real tokens come first and never attend to the pads behind them."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def segment_mask(segment_ids: torch.Tensor, *, shared_prompt: torch.Tensor | None = None,
                 num_sequences: int | None = None) -> torch.Tensor:
    """[rows, 1, W, W] bool for rows of segments (`segment_ids` [rows, W], as
    `pairs.Microbatch` holds them), True where attention is not allowed: a token sees the
    earlier tokens of its own segment (block-diagonal causal) and, where `shared_prompt` marks a
    pair's prompt body (`data.prefix_sharing`), the earlier body tokens of its own pair:
    sequences j and b + j are pair j's (b = num_sequences / 2; ids >= num_sequences are padding)."""
    width = segment_ids.shape[-1]
    blocked = segment_ids[:, :, None] != segment_ids[:, None, :]
    if shared_prompt is not None:
        half = num_sequences // 2
        pair = torch.where(segment_ids < num_sequences, segment_ids % half, half)  # padding: a pair of its own
        blocked &= ~(shared_prompt[:, None, :] & (pair[:, :, None] == pair[:, None, :]))
    blocked |= torch.triu(torch.ones(width, width, dtype=torch.bool, device=segment_ids.device), diagonal=1)
    return blocked[:, None]


@contextlib.contextmanager
def _rope_at_positions(model: torch.nn.Module, position_ids: torch.Tensor, *, num_positions: int):
    """RoPE at `position_ids` [rows, W] instead of 0..W-1 (a packed row restarts at 0 in each
    sequence; a shared-prompt row restarts its rejected branch where the chosen one started).
    megatron-core's rotary embedding takes a length, not positions: its table up to the largest
    position (`num_positions` = that + 1, known on the host) is computed by its own code and
    indexed per token, [W, rows, 1, d], which its rotation broadcasts over [W, rows, heads, d]."""
    rope = getattr(model, "rotary_pos_emb", None)
    if rope is None:  # multi-latent attention: the table goes to the decoder, which hands it to each layer (mla.py)
        from mcore_dpo.model.mla import rotary_table_at

        emb = rotary_table_at(model, position_ids, num_positions=num_positions)
        decoder_forward = model.decoder.forward

        def decoder_at_positions(*args, **kwargs):
            return decoder_forward(*args, **{**kwargs, "rotary_pos_emb": emb})

        model.decoder.forward = decoder_at_positions
        try:
            yield
        finally:
            del model.decoder.forward
        return
    table = rope.get_emb(num_positions)  # [L, 1, 1, d]
    with rope_returning(rope, table[:, 0][position_ids.t()]):  # [W, rows, 1, d]
        yield


def packed_seq_params(seq_lens: tuple[int, ...], *, device: torch.device):
    """megatron-core's PackedSeqParams for one packed row in the THD layout (Transformer Engine);
    cu_seqlens built on the host and copied without blocking it."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from mcore_dpo.parallel.platform import to_device

    cu = to_device(torch.tensor([0, *itertools.accumulate(seq_lens)], dtype=torch.int32), device)
    longest = max(seq_lens)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


def stage_forward(
    model: torch.nn.Module,
    *,
    tokens: torch.Tensor,
    input_tensor: torch.Tensor | None,
    mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
    packed_params=None,
    num_positions: int | None = None,
) -> torch.Tensor:
    """One stage's forward. First stage reads tokens [b, s]; later stages read the previous
    stage's hidden states [s, b, h]. Returns hidden states [s, b, h], or on the last stage the
    vocab-parallel logits [b, s, v/tp].

    Rows of segments (packed, shared-prompt): either the THD layout (`packed_params`, attention
    over cu_seqlens, no mask) or the `segment_mask` with RoPE at `position_ids` (then
    `num_positions`: the largest position + 1, a host-side fact of the rows)."""
    unwrapped = model.module if hasattr(model, "module") else model
    unwrapped.set_input_tensor(input_tensor)
    if packed_params is not None:
        return model(input_ids=tokens, position_ids=position_ids, attention_mask=None,
                     packed_seq_params=packed_params)
    if position_ids is not None:
        if num_positions is None:
            raise ValueError("stage_forward: position_ids with a mask need num_positions (the largest position + 1)")
        with _rope_at_positions(unwrapped, position_ids, num_positions=num_positions):
            return model(input_ids=tokens, position_ids=position_ids, attention_mask=mask)
    seq_len = tokens.shape[1]
    position_ids = torch.arange(seq_len, device=tokens.device).unsqueeze(0).expand_as(tokens)
    return model(input_ids=tokens, position_ids=position_ids, attention_mask=mask)


class RouterTap:
    """Records the router logits of a model's MoE layers while `active`, in forward order, as
    (global layer index from 0, logits [s, b, E] or [s*b, E] in the graph). The routers' own
    gating runs unchanged: this wraps it on each router instance."""

    def __init__(self, model: torch.nn.Module):
        from megatron.core.transformer.moe.router import TopKRouter

        self.active = False
        self.records: list[tuple[int, torch.Tensor]] = []
        self.num_layers = 0
        for module in model.modules():
            if isinstance(module, TopKRouter):
                self.num_layers += 1
                module.gating = self._wrap(module, module.gating)

    def _wrap(self, router, gating):
        def tapped(input: torch.Tensor) -> torch.Tensor:
            logits = gating(input)
            if self.active:
                self.records.append((router.layer_number - 1, logits))
            return logits

        return tapped

    def take(self) -> list[tuple[int, torch.Tensor]]:
        records, self.records = self.records, []
        return records
