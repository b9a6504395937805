"""Megatron-side ranks for the torch_dist tests, written against megatron-core's own APIs only
(parallel_state, TransformerConfig, GPTModel, dist_checkpointing), the way Megatron-LM builds
and checkpoints a GPT model, and independent of checkpoint_convert's reader, writer and key map.

Each rank function runs in a spawned process of a gloo group of tp * pp ranks; the last
stage's tp ranks gather the vocab-parallel logits and tp rank 0 saves them.
"""

from __future__ import annotations

import math
import os
from argparse import Namespace
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.helpers.tiers import launches


def _setup(rank: int, world_size: int, port: int, *, tp: int, pp: int, ep: int = 1, etp: int | None = None,
           vpp: int | None = None):
    os.environ["MCORE_DPO_FORCE_CPU"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist
    from megatron.core import parallel_state

    from mcore_dpo.parallel import platform as platform_lib

    platform = platform_lib.detect(local_rank=rank)
    platform_lib.activate(platform)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp, virtual_pipeline_model_parallel_size=vpp,
    )
    platform_lib.init_model_rng(platform, 0)
    return platform


def _teardown() -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def padded_vocab(vocab_size: int, *, divisor: int, tp: int) -> int:
    """Megatron-LM's _vocab_size_with_padding."""
    multiple = divisor * tp
    return math.ceil(vocab_size / multiple) * multiple


def transformer_config_from_args(args: Namespace):
    """The TransformerConfig Megatron-LM makes of `args` (its core_transformer_config_from_args):
    every arg named like a field of the config class (MLATransformerConfig when
    `multi_latent_attention`) is copied; then its translations of the args that are named
    otherwise (normalization's epsilon, --swiglu, --quick-geglu, --num-experts,
    --group-query-attention) and the `yarn_*` values its GPT-OSS launchers set on the config; then
    this rank's parallel sizes and the settings a CPU needs (fp32, no fused kernels, no dropout,
    sequential experts). Nothing here knows a model family: what the checkpoint's args say is
    what is built."""
    import dataclasses

    from megatron.core import parallel_state
    from megatron.core.activations import quick_gelu
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    config_class = MLATransformerConfig if getattr(args, "multi_latent_attention", False) else TransformerConfig
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(config_class) if hasattr(args, f.name)}
    quick_geglu = getattr(args, "quick_geglu", False)
    fields.update(
        layernorm_epsilon=args.norm_epsilon, gated_linear_unit=args.swiglu or quick_geglu,
        activation_func=F.silu if args.swiglu else quick_gelu if quick_geglu else F.gelu,
        num_query_groups=args.num_query_groups if args.group_query_attention else None,
        num_moe_experts=getattr(args, "num_experts", None),
    )  # fmt: skip
    fields.update(
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        virtual_pipeline_model_parallel_size=parallel_state.get_virtual_pipeline_model_parallel_world_size(),
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=parallel_state.get_expert_tensor_parallel_world_size(),
        context_parallel_size=1, sequence_parallel=False,  # (the local spec's torch norms refuse it)
        params_dtype=torch.float32, pipeline_dtype=torch.float32, bf16=False, fp16=False,
        use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        persist_layer_norm=False, apply_rope_fusion=False, gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True, moe_grouped_gemm=False, moe_permute_fusion=False,
        moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0, moe_router_load_balancing_type="none",
    )  # fmt: skip
    config = config_class(**fields)
    # YaRN as GPTModel's position embedding: megatron-core reads these from the config, where
    # Megatron-LM's GPT-OSS launchers put the args of the same names.
    for name, value in vars(args).items():
        if name.startswith("yarn_"):
            setattr(config, name, value)
    return config


def _local_spec(config, args: Namespace):
    """The layer (block) spec Megatron-LM's model provider picks for the local implementation,
    with one substitution megatron-core 0.16.1 needs on a CPU: multi-latent attention's core
    attention takes the q/k and v head sizes, which only Transformer Engine's attention accepts
    (the local DotProductAttention computes from the tensors' own sizes, so it is given them and
    drops them, with its output's width v_head_dim per head), and its module checks isinstance
    against Transformer Engine placeholders unless told TE is absent.""" 
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    if not (config.num_moe_experts or config.multi_latent_attention):
        return get_gpt_layer_local_spec(normalization=args.normalization, qk_layernorm=config.qk_layernorm)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization=args.normalization,
                                      pp_rank=parallel_state.get_pipeline_model_parallel_rank())
    if config.multi_latent_attention:
        from megatron.core.extensions import transformer_engine as te_extension
        from megatron.core.transformer import multi_latent_attention
        from megatron.core.transformer.dot_product_attention import DotProductAttention

        class HeadSizesDotProductAttention(DotProductAttention):
            def __init__(self, *a, k_channels=None, v_channels=None, **kw):
                super().__init__(*a, **kw)
                # Its output is v_head_dim per head (not kv_channels).
                self.hidden_size_per_partition = self.num_attention_heads_per_partition * self.config.v_head_dim

        multi_latent_attention.HAVE_TE = te_extension.HAVE_TE
        for layer_spec in spec.layer_specs:
            layer_spec.submodules.self_attention.submodules.core_attention = HeadSizesDotProductAttention
    return spec


def build_gpt(args: Namespace, *, vocab_size: int, platform, vp_stage: int | None = None):
    """GPTModel for this rank, from Megatron-LM style args, as its gpt model provider builds it:
    the local layer spec (for MoE or multi-latent attention, the decoder block spec of this stage).
    With virtual pipeline stages, this rank's model chunk `vp_stage`, its pre/post processing as
    Megatron-LM's get_model decides them (the first chunk of the first stage, the last of the last)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    from mcore_dpo.parallel import platform as platform_lib

    config = transformer_config_from_args(args)
    spec = _local_spec(config, args)
    with platform_lib.building_models(platform):
        return GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=padded_vocab(vocab_size, divisor=args.make_vocab_size_divisible_by,
                                    tp=config.tensor_model_parallel_size),
            max_sequence_length=args.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage),
            vp_stage=vp_stage,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            rotary_percent=getattr(args, "rotary_percent", 1.0),
            rotary_base=args.rotary_base,
            rope_scaling=getattr(args, "use_rope_scaling", False),
            rope_scaling_factor=getattr(args, "rope_scaling_factor", 8.0),
        )


def _forward(model, tokens: torch.Tensor, *, hidden_size: int, out_path: str) -> None:
    """Pipeline forward with blocking send/recv; the last stage saves the gathered logits."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    batch, seq_len = tokens.shape
    mask = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)[None, None]
    position_ids = torch.arange(seq_len).unsqueeze(0).expand_as(tokens)
    model.eval()
    with torch.no_grad():
        hidden = None
        if not parallel_state.is_pipeline_first_stage():
            hidden = torch.empty(seq_len, batch, hidden_size)
            dist.recv(hidden, src=parallel_state.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
        output = model(input_ids=tokens, position_ids=position_ids, attention_mask=mask)
        if not parallel_state.is_pipeline_last_stage():
            dist.send(output.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
            return
        group = parallel_state.get_tensor_model_parallel_group()
        parts = [torch.empty_like(output) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, output.contiguous(), group=group)
        if parallel_state.get_tensor_model_parallel_rank() == 0 and parallel_state.get_data_parallel_rank() == 0:
            save_file({"logits": torch.cat(parts, dim=-1).contiguous()}, out_path)


def consumer_rank(rank: int, world_size: int, port: int, job: dict) -> None:
    """Load a torch_dist checkpoint with dist_checkpointing.load at this group's tp x pp, run it."""
    platform = _setup(rank, world_size, port, tp=job["tp"], pp=job["pp"], ep=job.get("ep", 1), etp=job.get("etp"))
    try:
        from megatron.core import dist_checkpointing

        args = dist_checkpointing.load_common_state_dict(job["checkpoint"])["args"]
        model = build_gpt(args, vocab_size=args.vocab_size, platform=platform)
        # As Megatron-LM's load_checkpoint: the model's sharded state under "model".
        state = dist_checkpointing.load({"model": model.sharded_state_dict()}, job["checkpoint"])
        model.load_state_dict(state["model"], strict=True)
        tokens = load_file(job["tokens"])["tokens"]
        _forward(model, tokens, hidden_size=args.hidden_size, out_path=job["logits"])
    finally:
        _teardown()


def vpp_consumer_rank(rank: int, world_size: int, port: int, job: dict) -> None:
    """Load a torch_dist checkpoint written for virtual pipeline stages into this rank's model
    chunks as Megatron-LM does (tp 1): one GPTModel per chunk c (vp_stage c), their sharded state
    under `model{c}`, one dist_checkpointing.load; then the forward through the virtual stages in
    order (chunk c of stage s is stage c*pp + s: the hidden states go round the ring of ranks,
    blocking send/recv), and the last one saves the logits."""
    import torch.distributed as dist

    vpp = job["vpp"]
    platform = _setup(rank, world_size, port, tp=1, pp=job["pp"], vpp=vpp)
    try:
        from megatron.core import dist_checkpointing, parallel_state

        args = dist_checkpointing.load_common_state_dict(job["checkpoint"])["args"]
        assert args.virtual_pipeline_model_parallel_size == vpp, args.virtual_pipeline_model_parallel_size
        chunks = [build_gpt(args, vocab_size=args.vocab_size, platform=platform, vp_stage=c) for c in range(vpp)]
        sharded = {f"model{c}": chunk.sharded_state_dict() for c, chunk in enumerate(chunks)}
        state = dist_checkpointing.load(sharded, job["checkpoint"])
        for c, chunk in enumerate(chunks):
            chunk.load_state_dict(state[f"model{c}"], strict=True)
        tokens = load_file(job["tokens"])["tokens"]
        batch, seq_len = tokens.shape
        mask = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)[None, None]
        position_ids = torch.arange(seq_len).unsqueeze(0).expand_as(tokens)
        pp, pp_rank = job["pp"], parallel_state.get_pipeline_model_parallel_rank()
        with torch.no_grad():
            for c, chunk in enumerate(chunks):
                chunk.eval()
                stage = c * pp + pp_rank
                hidden = None
                if stage > 0:
                    hidden = torch.empty(seq_len, batch, args.hidden_size)
                    dist.recv(hidden, src=parallel_state.get_pipeline_model_parallel_prev_rank())
                chunk.set_input_tensor(hidden)
                output = chunk(input_ids=tokens, position_ids=position_ids, attention_mask=mask)
                if stage < pp * vpp - 1:
                    dist.send(output.contiguous(), dst=parallel_state.get_pipeline_model_parallel_next_rank())
                else:
                    save_file({"logits": output.contiguous()}, job["logits"])
    finally:
        _teardown()


def training_consumer_rank(rank: int, world_size: int, port: int, job: dict) -> None:
    """As Megatron-LM resumes from a training checkpoint: load the model and the optimizer state
    (megatron-core's model-space keys `optimizer.state.<kind>.<model key>`, sharded like the
    model tensor) with dist_checkpointing.load at this group's tp x pp, save what was loaded
    (per rank) and the logits. `job["divisor"]` keeps the padded vocabulary of the writer."""
    platform = _setup(rank, world_size, port, tp=job["tp"], pp=job["pp"], ep=job.get("ep", 1), etp=job.get("etp"))
    try:
        from megatron.core import dist_checkpointing
        from megatron.core.dist_checkpointing.dict_utils import nested_values
        from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

        args = dist_checkpointing.load_common_state_dict(job["checkpoint"])["args"]
        args.make_vocab_size_divisible_by = job["divisor"]
        model = build_gpt(args, vocab_size=args.vocab_size, platform=platform)
        model_sd = model.sharded_state_dict()
        by_param = {id(t.data): t for t in nested_values(model_sd) if hasattr(t, "data")}
        params = dict(model.named_parameters())
        optim = {
            kind: {name: make_sharded_optimizer_tensor(by_param[id(p)], torch.empty_like(p), prefix=f"optimizer.state.{kind}")
                   for name, p in params.items()}
            for kind in ("fp32_param", "exp_avg", "exp_avg_sq")
        }  # fmt: skip
        state = dist_checkpointing.load({"model": model_sd, "optimizer": optim}, job["checkpoint"])
        model.load_state_dict(state["model"], strict=True)
        loaded = {f"model/{n}": p.detach().clone() for n, p in params.items()}
        for kind in optim:  # (the result also holds common.pt's entries under "optimizer")
            loaded.update({f"{kind}/{n}": t.detach().clone() for n, t in state["optimizer"][kind].items()})
        save_file(loaded, job["state"].format(rank=rank))
        tokens = load_file(job["tokens"])["tokens"]
        _forward(model, tokens, hidden_size=args.hidden_size, out_path=job["logits"])
    finally:
        _teardown()


def _fill_from_hf(model, hf: dict[str, torch.Tensor], args: Namespace) -> None:
    """The HF weights in this rank's GPTModel chunk (the mapping spelled out here, on purpose)."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    t = parallel_state.get_tensor_model_parallel_rank()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    first_layer = parallel_state.get_pipeline_model_parallel_rank() * (args.num_layers // pp)
    groups, d = args.num_query_groups, args.kv_channels
    r = args.num_attention_heads // groups

    def vocab_part(weight: torch.Tensor, rows: int) -> torch.Tensor:
        padded = torch.cat([weight, weight.new_zeros(rows * tp - weight.shape[0], weight.shape[1])])
        return padded.chunk(tp, dim=0)[t]

    params = dict(model.named_parameters())
    values = {}
    for name, param in params.items():
        if name == "embedding.word_embeddings.weight":
            values[name] = vocab_part(hf["model.embed_tokens.weight"], param.shape[0])
        elif name == "output_layer.weight":
            values[name] = vocab_part(hf["lm_head.weight"], param.shape[0])
        elif name == "decoder.final_layernorm.weight":
            values[name] = hf["model.norm.weight"]
        else:
            _, _, local, *rest = name.split(".")
            p = f"model.layers.{first_layer + int(local)}."
            suffix = ".".join(rest)
            if suffix == "input_layernorm.weight":
                values[name] = hf[p + "input_layernorm.weight"]
            elif suffix == "pre_mlp_layernorm.weight":
                values[name] = hf[p + "post_attention_layernorm.weight"]
            elif suffix.startswith("self_attention.") and suffix.split(".")[1] in ("q_layernorm", "k_layernorm"):
                values[name] = hf[p + f"self_attn.{suffix.split('.')[1][0]}_norm.weight"]
            elif suffix == "mlp.router.weight":
                values[name] = hf[p + "mlp.gate.weight"]
            elif suffix.startswith("mlp.experts.local_experts."):
                # Expert-parallel rank r holds experts [r E/ep, (r+1) E/ep), split over expert tp.
                local_expert, linear = suffix.split(".")[3], suffix.split(".")[4]
                ep_rank = parallel_state.get_expert_model_parallel_rank()
                e = ep_rank * (args.num_experts // parallel_state.get_expert_model_parallel_world_size()) + int(local_expert)
                etp = parallel_state.get_expert_tensor_parallel_world_size()
                et = parallel_state.get_expert_tensor_parallel_rank()
                q = p + f"mlp.experts.{e}."
                if linear == "linear_fc1":
                    values[name] = torch.cat([hf[q + "gate_proj.weight"].chunk(etp, dim=0)[et], hf[q + "up_proj.weight"].chunk(etp, dim=0)[et]])
                else:
                    values[name] = hf[q + "down_proj.weight"].chunk(etp, dim=1)[et]
            elif suffix.startswith("self_attention.linear_qkv."):
                kind = suffix.rsplit(".", 1)[1]
                q = hf[p + f"self_attn.q_proj.{kind}"].reshape(groups, r * d, -1)
                k = hf[p + f"self_attn.k_proj.{kind}"].reshape(groups, d, -1)
                v = hf[p + f"self_attn.v_proj.{kind}"].reshape(groups, d, -1)
                fused = torch.cat([q, k, v], dim=1).chunk(tp, dim=0)[t]
                values[name] = fused.reshape(param.shape)
            elif suffix == "self_attention.linear_proj.weight":
                values[name] = hf[p + "self_attn.o_proj.weight"].chunk(tp, dim=1)[t]
            elif suffix == "mlp.linear_fc1.weight":
                gate = hf[p + "mlp.gate_proj.weight"].chunk(tp, dim=0)[t]
                up = hf[p + "mlp.up_proj.weight"].chunk(tp, dim=0)[t]
                values[name] = torch.cat([gate, up])
            elif suffix == "mlp.linear_fc2.weight":
                values[name] = hf[p + "mlp.down_proj.weight"].chunk(tp, dim=1)[t]
            else:
                raise AssertionError(f"unmapped parameter {name}")
    with torch.no_grad():
        for name, param in params.items():
            assert values[name].shape == param.shape, (name, values[name].shape, param.shape)
            param.copy_(values[name])


def megatron_lm_args(config: dict, *, tp: int, pp: int, divisor: int = 128) -> Namespace:
    """Args as Megatron-LM would save them for this model (vocab_size unset: Megatron-LM pads
    the tokenizer's vocabulary and records only padded_vocab_size). Includes an enum value,
    as Megatron-LM's --attention-backend does."""
    from megatron.core.transformer.enums import AttnBackend

    return Namespace(
        num_layers=config["num_hidden_layers"], hidden_size=config["hidden_size"],
        ffn_hidden_size=config["intermediate_size"], num_attention_heads=config["num_attention_heads"],
        group_query_attention=True, num_query_groups=config["num_key_value_heads"],
        kv_channels=config["hidden_size"] // config["num_attention_heads"],
        max_position_embeddings=config["max_position_embeddings"], seq_length=64,
        position_embedding_type="rope", rotary_base=int(config.get("rope_theta", 10000)), rotary_percent=1.0,
        normalization="RMSNorm", norm_epsilon=config["rms_norm_eps"], swiglu=True, add_bias_linear=False,
        add_qkv_bias=False, untie_embeddings_and_output_weights=not config["tie_word_embeddings"],
        make_vocab_size_divisible_by=divisor, padded_vocab_size=padded_vocab(config["vocab_size"], divisor=divisor, tp=tp),
        vocab_size=None, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        params_dtype=torch.float32, ckpt_format="torch_dist", attention_backend=AttnBackend.auto,
        tokenizer_type="HuggingFaceTokenizer",
    )  # fmt: skip


def producer_rank(rank: int, world_size: int, port: int, job: dict) -> None:
    """Fill a GPTModel from HF weights, save it with dist_checkpointing.save in Megatron-LM's
    layout (<save>/iter_0000100 + latest_checkpointed_iteration.txt), then run it."""
    platform = _setup(rank, world_size, port, tp=job["tp"], pp=job["pp"], ep=job.get("ep", 1), etp=job.get("etp"))
    try:
        import torch.distributed as dist
        from megatron.core import dist_checkpointing, parallel_state
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        from mcore_dpo.parallel import platform as platform_lib

        args = Namespace(**job["args"])
        hf = load_file(job["hf_weights"])
        model = build_gpt(args, vocab_size=job["vocab_size"], platform=platform)
        _fill_from_hf(model, hf, args)
        pp_rank, tp_rank = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank()
        dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        state = {
            "model": model.sharded_state_dict(),
            "args": args,
            "checkpoint_version": 3.0,
            "iteration": 100,
            # Training checkpoints carry more than the model; readers of the weights skip it.
            # (Per data-parallel rank, as Megatron-LM keeps it.)
            "rng_state": ShardedObject("rng_state", [{"torch_rng_state": torch.get_rng_state()}], (job["pp"], job["tp"], dp),
                                       (pp_rank, tp_rank, dp_rank), replica_id=0),
        }
        iteration_dir = Path(job["save"]) / "iter_0000100"
        if rank == 0:
            iteration_dir.mkdir(parents=True)
        dist.barrier()
        with platform_lib.saving_dist_checkpoint(platform):
            dist_checkpointing.save(state, str(iteration_dir))
        if rank == 0:
            (Path(job["save"]) / "latest_checkpointed_iteration.txt").write_text("100")
        tokens = load_file(job["tokens"])["tokens"]
        _forward(model, tokens, hidden_size=args.hidden_size, out_path=job["logits"])
    finally:
        _teardown()


@launches("ranks")
def spawn(fn, *, world_size: int, job: dict) -> None:
    """`fn(rank, world_size, port, job)` on world_size ranks (one of the rank functions above),
    forked from tests/helpers/ranks.py's preloaded server."""
    from mcore_dpo.parallel.ports import free_port
    from tests.helpers.ranks import spawn_processes

    spawn_processes(fn, nprocs=world_size, args=(world_size, free_port(), job))


def megatron_lm_moe_args(config: dict, *, tp: int, pp: int, ep: int, divisor: int = 128) -> Namespace:
    """Megatron-LM's args for a Qwen3-MoE config (its --num-experts, --moe-* and --qk-layernorm
    flags; --moe-layer-freq as the list its parser makes of "([1]*N)" style values)."""
    args = megatron_lm_args(config, tp=tp, pp=pp, divisor=divisor)
    sparse = [0 if i in config.get("mlp_only_layers", []) else 1 for i in range(config["num_hidden_layers"])]
    args.kv_channels = config["head_dim"]
    args.qk_layernorm = True
    args.num_experts = config.get("num_experts", config.get("num_local_experts"))
    args.moe_router_topk = config["num_experts_per_tok"]
    args.moe_ffn_hidden_size = config["moe_intermediate_size"]
    args.moe_layer_freq = sparse if 0 in sparse else 1
    args.moe_router_pre_softmax = not config["norm_topk_prob"]
    args.moe_router_score_function = "softmax"
    args.moe_router_load_balancing_type = "none"
    args.moe_aux_loss_coeff = 0.0
    args.moe_token_dispatcher_type = "alltoall"
    args.moe_grouped_gemm = False
    args.moe_router_enable_expert_bias = False
    args.moe_shared_expert_intermediate_size = None
    args.moe_router_topk_scaling_factor = None
    args.expert_model_parallel_size = ep
    return args
