"""configs/: every YAML loads and validates as a TrainConfig, tiny.yaml is the embedded
default, and the realistic files' header arithmetic (parameter count, memory per GPU, cluster
size) matches a recomputation from the architecture numbers they state."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from mcore_dpo.parallel import platform as plat
from mcore_dpo.parallel.mesh import Layout
from mcore_dpo.command_line import load_yaml
from mcore_dpo.config import TrainConfig
from tests.helpers.config_arithmetic import (CONFIG_DIR, GPU, expert_params, header_values, is_moe, key_values,
                                             memory_gb_per_gpu, param_count)
from tests.helpers import mla_memory
from tests.helpers.ranks import spawn_processes

ALL_CONFIGS = sorted(CONFIG_DIR.glob("*.yaml"))
REALISTIC = [p for p in ALL_CONFIGS if p.name != "tiny.yaml"]
PATH_FIELDS = ("model", "ref_model", "data", "eval_data")


def config_without_paths(path: Path) -> TrainConfig:
    values = load_yaml(str(path))
    config = TrainConfig(**values)
    # The model and data paths name cluster storage; everything else must validate here.
    return dataclasses.replace(config, **{name: None for name in PATH_FIELDS})


def test_configs_exist():
    names = {p.name for p in ALL_CONFIGS}
    assert {"tiny.yaml", "llama3_8b.yaml", "qwen2_5_7b.yaml", "llama3_70b.yaml", "qwen3_8b.yaml", "qwen3_30b_a3b.yaml",
            "mixtral_8x7b.yaml", "llama3_1_8b_32k.yaml", "gpt_oss_20b.yaml", "gemma3_27b.yaml", "glm4_5_air.yaml",
            "deepseek_v3.yaml"} <= names


@pytest.mark.parametrize("path", ALL_CONFIGS, ids=lambda p: p.name)
def test_every_config_loads_and_validates(path: Path):
    config = config_without_paths(path)
    config.validate()


def test_tiny_is_the_embedded_default():
    assert load_yaml(str(CONFIG_DIR / "tiny.yaml")) == dataclasses.asdict(TrainConfig())


@pytest.mark.parametrize("path", REALISTIC, ids=lambda p: p.name)
def test_realistic_config_header_arithmetic(path: Path):
    header = header_values(path)
    for key in ("cluster", "arch", "attention", "sequence_parallel", "params_b", "gpu_memory_gb", "memory_gb_per_gpu"):
        assert key in header, f"{path.name}: header lacks '# {key}:'"
    arch = key_values(header["arch"])
    cluster = key_values(header["cluster"])
    config = config_without_paths(path)

    assert param_count(arch) / 1e9 == pytest.approx(float(header["params_b"]), abs=0.005)
    assert header["sequence_parallel"] == str(
        plat.use_sequence_parallel(GPU, requested=config.sequence_parallel, tp=config.tp)).lower()
    memory_gb = memory_gb_per_gpu(arch=arch, config=config, attention=header["attention"].split()[0])
    assert memory_gb == pytest.approx(float(header["memory_gb_per_gpu"]), abs=0.05)
    assert memory_gb < float(header["gpu_memory_gb"])
    assert config.tp * config.pp * config.cp * config.dp == int(cluster["nodes"]) * int(cluster["gpus_per_node"])
    # A row splits over cp into 2 x cp chunks (x tp with sequence parallelism) without padding.
    sp = config.tp if header["sequence_parallel"] == "true" else 1
    assert config.max_length % (2 * config.cp * sp) == 0
    # A tensor-parallel group stays inside one node; grouped-query heads split evenly over tp.
    assert config.tp <= int(cluster["gpus_per_node"])
    assert int(arch["kv_heads"]) % config.tp == 0 and int(arch["heads"]) % config.tp == 0
    assert int(arch["layers"]) % config.pp == 0
    assert config.dtype == "bfloat16"
    if is_moe(arch):
        assert expert_params(arch) / 1e9 == pytest.approx(float(header["expert_params_b"]), abs=0.005)
        assert int(arch["experts"]) % config.ep == 0
        # An expert-parallel group (ep consecutive ranks of a stage's tp x dp, each expert whole on
        # its rank at ep > 1: mesh.Layout.ep_rank_of) stays inside one node (tp x ep ranks), unless
        # the header states the nodes it spans.
        layout = Layout(tp=config.tp, pp=config.pp, dp=config.dp, ep=config.ep)
        group = range(config.ep * layout.etp)  # the first stage's first ranks (tp fastest, then dp)
        ep_ranks = {layout.ep_rank_of(tp_rank=r % config.tp, dp_rank=r // config.tp) for r in group}
        assert ep_ranks == set(range(config.ep))
        nodes = {r // int(cluster["gpus_per_node"]) for r in group}
        assert len(nodes) == int(header.get("expert_parallel_nodes", 1))
        if len(nodes) == 1:
            assert config.tp * config.ep <= int(cluster["gpus_per_node"])
    else:
        assert config.ep == 1 and "expert_parallel_nodes" not in header


@pytest.mark.parametrize("path", REALISTIC, ids=lambda p: p.name)
def test_header_states_the_memory_with_full_recompute(path: Path):
    # Every config states its recompute and its memory with it (memory_gb_per_gpu, above). One
    # that recomputes does so because it must: its header states what it would hold without
    # (memory_gb_per_gpu_recompute_none), more than its GPUs have. One without recompute states,
    # when dense, what --recompute full would hold (each layer's input only, recomputed in the
    # backward); a MoE one nothing (full recompute is refused for mixture-of-experts models).
    header = header_values(path)
    arch, config = key_values(header["arch"]), config_without_paths(path)
    attention = header["attention"].split()[0]
    if config.recompute != "none":
        none = memory_gb_per_gpu(arch=arch, config=dataclasses.replace(config, recompute="none",
                                                                       recompute_num_layers=None), attention=attention)
        assert none == pytest.approx(float(header["memory_gb_per_gpu_recompute_none"]), abs=0.05)
        assert none > float(header["gpu_memory_gb"]) > float(header["memory_gb_per_gpu"])
        return
    assert "memory_gb_per_gpu_recompute_none" not in header
    if is_moe(arch):
        assert "memory_gb_per_gpu_recompute_full" not in header
        return
    full = memory_gb_per_gpu(arch=arch, config=dataclasses.replace(config, recompute="full"), attention=attention)
    assert full == pytest.approx(float(header["memory_gb_per_gpu_recompute_full"]), abs=0.05)
    assert full < float(header["memory_gb_per_gpu"])


def test_moe_configs_split_the_experts():
    for name, ep in (("qwen3_30b_a3b.yaml", 8), ("mixtral_8x7b.yaml", 8)):
        config = config_without_paths(CONFIG_DIR / name)
        assert config.ep == ep and is_moe(key_values(header_values(CONFIG_DIR / name)["arch"]))


def test_expert_memory_is_in_the_header_arithmetic():
    # Without the experts branch (all 30.5 B parameters treated as dense, over tp x pp = 1) the
    # Qwen3-30B-A3B figure would be far off: the experts' split over ep 8 is what fits it. (At
    # ep 1 the sharded optimizer would still split their optimizer state over dp 8: 308.6 GB.)
    path = CONFIG_DIR / "qwen3_30b_a3b.yaml"
    header = header_values(path)
    arch, config = key_values(header["arch"]), config_without_paths(path)
    stated = float(header["memory_gb_per_gpu"])
    assert memory_gb_per_gpu(arch=arch, config=config, attention="flash") == pytest.approx(stated, abs=0.05)
    single_rank = dataclasses.replace(config, ep=1)
    assert memory_gb_per_gpu(arch=arch, config=single_rank, attention="flash") > stated + 200


def test_70b_config_is_tp8_pp4_or_more():
    config = config_without_paths(CONFIG_DIR / "llama3_70b.yaml")
    assert config.tp == 8 and config.pp >= 4


def test_32k_config_is_tp4_cp2_and_cp_is_in_its_arithmetic():
    """configs/llama3_1_8b_32k.yaml: tp 4 x cp 2 on 8 GPUs, 32768 tokens; it loads through the real
    parser (`cp: 2` is a file key). Its figure needs cp in the arithmetic: the same file read as
    cp 1 (the whole 32k row on each rank, the optimizer state over dp alone) is far above it. The
    header's other layouts of the same 8 GPUs: tp 4 x dp 2 (cp 1), tp 8."""
    from mcore_dpo.command_line import resolve

    path = CONFIG_DIR / "llama3_1_8b_32k.yaml"
    values = load_yaml(str(path))
    assert values["cp"] == 2 and values["tp"] == 4 and values["max_length"] == 32768
    config, _ = resolve(["--config", str(path), "--model", str(CONFIG_DIR), "--data", str(path),
                         "--eval-data", str(path)])  # existing stand-ins for the cluster paths
    assert (config.cp, config.tp, config.dp, config.recompute) == (2, 4, 1, "full")
    header = header_values(path)
    arch = key_values(header["arch"])
    stated = float(header["memory_gb_per_gpu"])
    assert memory_gb_per_gpu(arch=arch, config=config, attention="flash") == pytest.approx(stated, abs=0.05)
    as_cp1 = memory_gb_per_gpu(arch=arch, config=dataclasses.replace(config, cp=1), attention="flash")
    assert as_cp1 > stated + 20
    for layout, gb in ((dict(cp=1, dp=2), 53.3), (dict(cp=1, tp=8), 33.0)):
        other = memory_gb_per_gpu(arch=arch, config=dataclasses.replace(config, **layout), attention="flash")
        assert other == pytest.approx(gb, abs=0.05) and f"{gb} GB" in path.read_text(encoding="utf-8"), layout


def test_header_parser_sees_a_wrong_count(tmp_path: Path):
    # The arithmetic check must be able to fail: a file whose stated count is off is caught.
    text = (CONFIG_DIR / "llama3_8b.yaml").read_text(encoding="utf-8").replace("# params_b: 8.03", "# params_b: 8.30")
    bad = tmp_path / "bad.yaml"
    bad.write_text(text, encoding="utf-8")
    arch = key_values(header_values(bad)["arch"])
    assert param_count(arch) / 1e9 != pytest.approx(float(header_values(bad)["params_b"]), abs=0.005)


def test_header_attention_matters():
    # The stated attention implementation is part of the arithmetic: the local spec's s x s
    # probabilities at seq 2048 do not fit the stated figure.
    path = CONFIG_DIR / "llama3_8b.yaml"
    header = header_values(path)
    arch, config = key_values(header["arch"]), config_without_paths(path)
    flash = memory_gb_per_gpu(arch=arch, config=config, attention="flash")
    local = memory_gb_per_gpu(arch=arch, config=config, attention="local")
    assert flash == pytest.approx(float(header["memory_gb_per_gpu"]), abs=0.05)
    assert local > flash + 5


def test_the_collectives_timeout_defaults_by_platform_and_a_flag_sets_it():
    """One timeout, from the config when given; unset, the ranks' platform decides: 1800 s on
    GPUs (a large model's first step fits), 300 s on the CPU. NCCL is set to raise, not abort."""
    import torch

    from mcore_dpo.parallel import platform
    from mcore_dpo.command_line import resolve

    assert resolve([])[0].timeout_s is None
    assert resolve(["--timeout-s", "42"])[0].timeout_s == 42.0
    gpu = platform.Platform(device=torch.device("cuda", 0), backend="nccl")
    cpu = platform.Platform(device=torch.device("cpu"), backend="gloo")
    assert platform.default_timeout_s(gpu) == 1800.0 and platform.default_timeout_s(cpu) == 300.0
    assert platform.nccl_error_settings() == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}


def test_fused_kernels_run_where_transformer_engine_provides_them():
    """On a GPU with the Transformer Engine spec every fusion is on unless --no-fused-kernels;
    elsewhere (the CPU, the local spec) none is, as the CPU parity tests check."""
    from mcore_dpo.command_line import resolve
    from mcore_dpo.parallel.platform import fused_kernel_fields

    import importlib.util

    from megatron.core.models.common.embeddings import rope_utils

    names = ("bias_activation_fusion", "bias_dropout_fusion")
    on = fused_kernel_fields(requested=None, use_te=True, on_gpu=True, moe=True)
    assert all(on[n] for n in names) and on["moe_permute_fusion"] and not on["masked_softmax_fusion"]
    # fused RoPE where megatron-core found Transformer Engine's two kernels (padded and THD)
    te_rope = rope_utils.fused_apply_rotary_pos_emb is not None and rope_utils.fused_apply_rotary_pos_emb_thd is not None
    assert on["apply_rope_fusion"] is te_rope
    # megatron-core's own linears need apex's extension for the weight-gradient fusion
    apex_wgrad = importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None
    assert on["gradient_accumulation_fusion"] is apex_wgrad
    for requested, use_te, on_gpu in ((False, True, True), (None, False, True), (None, True, False), (True, False, False)):
        fields = fused_kernel_fields(requested=requested, use_te=use_te, on_gpu=on_gpu, moe=False)
        assert not any(fields.values()) and "moe_permute_fusion" not in fields
    assert resolve(["--no-fused-kernels"])[0].fused_kernels is False and resolve([])[0].fused_kernels is None


def test_gemma_norm_activation_bytes_are_the_measured_ones():
    """`fp32_norms` (Gemma 3's norm, mcore_dpo/model/gemma3.py): what autograd keeps per token is
    the fp32 input and normalised tensor and the fp32 1/rms, not the input in bf16; plus the
    fp32 (1 + w), once per call."""
    import types

    import torch

    from mcore_dpo.model.gemma3 import GemmaRMSNorm
    from mcore_dpo.tools.memory_estimate import _fp32_norm_bytes

    hidden, tokens = 64, 16
    norm = GemmaRMSNorm(types.SimpleNamespace(params_dtype=torch.bfloat16, sequence_parallel=False), hidden)
    x = torch.randn(8, 2, hidden, dtype=torch.bfloat16, requires_grad=True)
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        norm(x)
    assert sum(saved.values()) == tokens * _fp32_norm_bytes(hidden) + 4 * hidden


def test_dense_first_layers_and_shared_experts_in_the_arithmetic():
    """GLM-4.5-Air's header keys: `dense_layers` puts a dense MLP of `ffn` in the first layers
    (no router, no experts there), `shared_ffn` a shared SwiGLU in each MoE layer (dense
    parameters); the first stage's activations hold the dense layer, the others MoE layers only."""
    from mcore_dpo.tools import memory_estimate as me
    from tests.helpers.config_arithmetic import dense_param_count, layer_shape

    path = CONFIG_DIR / "glm4_5_air.yaml"
    arch = key_values(header_values(path)["arch"])
    h, v = 4096, 151552
    attention = 2 * h * 96 * 128 + 2 * h * 8 * 128 + (96 + 16) * 128 + 2 * h
    moe_dense = 128 * h + 128 + 3 * h * 1408
    assert dense_param_count(arch) == 2 * v * h + 46 * attention + 3 * h * 10944 + 45 * moe_dense + h
    assert expert_params(arch) == 45 * 128 * 3 * h * 1408
    shape = layer_shape(arch, tp=1)
    kw = dict(seq_len=64, rows=2, tp=1, sequence_parallel=False, attention="flash", dtype_bytes=2)
    moe = me.layer_activation_bytes(shape, **kw, expert_tp=1)
    dense = me.layer_activation_bytes(dataclasses.replace(shape, experts=0, topk=0, moe_ffn=0, shared_ffn=0,
                                                          dense_layers=0), **kw)
    assert moe - me.layer_activation_bytes(dataclasses.replace(shape, shared_ffn=0), **kw, expert_tp=1) == 128 * 5 * 1408 * 2
    boundary = me.boundary_bytes(shape, seq_len=64, rows=2, tp=1, sequence_parallel=False, dtype_bytes=2)
    peak = me.plan_activation_bytes(shape, layers=46, pp=2, num_microbatches=8, ref_mode="interleaved", expert_tp=1, **kw)
    # pp 2: the first stage's 2 microbatches of (1 dense + 22 MoE layers) and 2 boundary activations
    assert peak == pytest.approx(2 * (dense + 22 * moe) + 2 * boundary, rel=1e-12)
    assert dense < moe


# deepseek-ai/DeepSeek-V3's published config.json (its auto_map, quantization_config and
# transformers_version left out: the bf16 copy the config names has no quantization_config).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                            "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}


def test_deepseek_v3_config_is_the_published_model_in_a_layout_the_trainer_accepts():
    """configs/deepseek_v3.yaml resolves through the real parser; the published config.json, read
    by checkpoint_convert, is the model its arch line describes, and passes every check the driver
    makes of a config against its model (mcore_dpo/driver/run.py `prepare`). The header's other
    layouts do not fit: ep 64 (each expert's optimizer state over 4 ranks, 4 experts a rank),
    max_length 2048."""
    from checkpoint_convert.families import spec_from_hf_config
    from checkpoint_convert.mapping import check_layout
    from mcore_dpo.command_line import resolve
    from mcore_dpo.config import ConfigError

    path = CONFIG_DIR / "deepseek_v3.yaml"
    config, _ = resolve(["--config", str(path), "--model", str(CONFIG_DIR), "--data", str(path)])  # stand-ins
    assert (config.tp, config.pp, config.dp, config.ep, config.recompute) == (8, 1, 32, 128, "none")
    spec = spec_from_hf_config(DEEPSEEK_V3)
    source = "DeepSeek-V3/config.json"
    check_layout(spec, tp=config.tp, pp=config.pp, ep=config.ep, source=source)
    config.check_moe_grouped_gemm(num_experts=spec.num_experts, source=source)
    config.check_recompute(num_layers=spec.num_layers, num_experts=spec.num_experts, source=source)
    config.check_context_parallel(num_experts=spec.num_experts, multi_latent_attention=spec.multi_latent_attention,
                                  family=spec.family, source=source)
    config.resolve_moe_aux_loss_coef(num_experts=spec.num_experts, default=spec.router_aux_loss_coef, source=source)
    with pytest.raises(ConfigError, match="full is not supported yet for mixture-of-experts"):
        dataclasses.replace(config, recompute="full").check_recompute(
            num_layers=spec.num_layers, num_experts=spec.num_experts, source=source)

    header = header_values(path)
    arch = key_values(header["arch"])
    assert {k: int(arch[k]) for k in ("hidden", "layers", "heads", "kv_heads", "q_lora_rank", "kv_lora_rank",
                                      "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "ffn", "dense_layers",
                                      "experts", "topk", "moe_ffn", "shared_ffn", "vocab")} == {
        "hidden": spec.hidden_size, "layers": spec.num_layers, "heads": spec.num_heads,
        "kv_heads": spec.num_query_groups, "q_lora_rank": spec.q_lora_rank, "kv_lora_rank": spec.kv_lora_rank,
        "qk_nope_head_dim": spec.head_dim - spec.qk_rope_head_dim, "qk_rope_head_dim": spec.qk_rope_head_dim,
        "v_head_dim": spec.v_head_dim, "ffn": spec.intermediate_size, "dense_layers": min(spec.moe_layers),
        "experts": spec.num_experts, "topk": spec.moe_topk, "moe_ffn": spec.moe_intermediate_size,
        "shared_ffn": spec.moe_shared_intermediate_size, "vocab": spec.vocab_size}
    assert spec.moe_layers == tuple(range(3, 61)) and spec.moe_expert_bias and arch["router_bias"] == "true"
    assert (arch["tied_embeddings"], arch["qkv_bias"]) == (str(spec.tie_word_embeddings).lower(), "false")

    stated = float(header["memory_gb_per_gpu"])
    assert memory_gb_per_gpu(arch=arch, config=config, attention="local") == pytest.approx(stated, abs=0.05)
    text = path.read_text(encoding="utf-8")
    # A checkpoint save: the weights, main grads and optimizer shards, plus one kind of optimizer
    # state of the rank's parameters whole in fp32 (the experts too: expert dp 2 shards them).
    dense, experts = (float(header["params_b"]) - float(header["expert_params_b"])) * 1e9, float(header["expert_params_b"]) * 1e9
    expert_dp = config.tp * config.dp // config.ep
    assert expert_dp > 1
    held = dense * (8 + 12 / config.dp) / (config.tp * config.pp) + experts * (8 + 12 / expert_dp) / (config.ep * config.pp)
    whole = 4 * dense / (config.tp * config.pp) + 4 * experts / (config.ep * config.pp)
    assert config.save_interval > 0 and f"= {(held + whole) / 1e9:.1f} GB of 141 GB. Computed" in text
    for layout, gb in ((dict(ep=64), 154.4), (dict(max_length=2048), 162.3)):
        other = memory_gb_per_gpu(arch=arch, config=dataclasses.replace(config, **layout), attention="local")
        assert other == pytest.approx(gb, abs=0.05) and other > float(header["gpu_memory_gb"])
        assert f"{gb} GB" in text, layout


def test_mla_parameter_count_is_the_models():
    """The header arithmetic's multi-latent attention count (tests/helpers/config_arithmetic.py)
    against a tiny DeepseekV3ForCausalLM of transformers' own, with and without a q latent: every
    tensor of its state dict (the router's e_score_correction_bias included), the dense and the
    expert parameters apart."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    from tests.helpers.config_arithmetic import dense_param_count

    for q_lora_rank in (24, None):
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**mla_memory.hf_config(q_lora_rank=q_lora_rank)))
        sizes = {name: t.numel() for name, t in model.state_dict().items()}
        experts = sum(n for name, n in sizes.items() if ".mlp.experts." in name)
        arch = key_values(mla_memory.arch_line(q_lora_rank=q_lora_rank))
        assert (dense_param_count(arch), expert_params(arch)) == (sum(sizes.values()) - experts, experts), q_lora_rank


def test_mla_layer_bytes_are_what_autograd_saves(tmp_path):
    """Multi-latent attention's activation count (memory_estimate.mla_attention_bytes_per_token,
    the bulk of configs/deepseek_v3.yaml's figure) against what a tiny bf16 DeepSeek-V3 stage
    saves for its backward on two gloo ranks (tests/helpers/mla_memory.py), at tp 1 and at tp 2
    with sequence parallelism, with and without a q latent, byte for byte: the self-attention
    block (its count, plus the layer input its down projections keep, counted with the norms),
    and the whole dense layer (memory_estimate.layer_activation_bytes, its two norms counted as
    the local spec's: fp32 input and normalised tensor and the 1/rms, tests/test_memory_estimate.py
    test_local_norms_are_what_autograd_saves). Beside the per-token count a layer saves only
    per-layer tensors: the RoPE cos/sin of q and k (4 x s x qk_rope_head_dim, bf16) and the causal
    mask (s x s bool). The MoE layer under sequence parallelism: each tp rank's router keeps its
    own s/tp tokens (half of tp 1's) and the two ranks' experts together receive the k copies of
    every token once, which is why memory_estimate divides the routed term by tp there."""
    from mcore_dpo.parallel.ports import free_port
    from mcore_dpo.tools import memory_estimate as me
    from tests.helpers.config_arithmetic import layer_shape

    spawn_processes(mla_memory.rank_main, nprocs=2, args=((free_port(), free_port()), str(tmp_path)))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    s, tokens, bf16 = mla_memory.SEQ_LEN, mla_memory.SEQ_LEN * mla_memory.ROWS, 2
    for name, tp, q_lora_rank in mla_memory.CASES:
        arch = key_values(mla_memory.arch_line(q_lora_rank=q_lora_rank))
        shape = layer_shape(arch, tp=tp)
        h, sp = shape.hidden, tp > 1
        assert shape.q_lora_rank == (q_lora_rank or 0) and shape.head_dim == 18 and shape.v_head_dim == 10
        kw = dict(seq_len=s, rows=mla_memory.ROWS, tp=tp, sequence_parallel=sp, attention="local", dtype_bytes=bf16)
        per_layer = 4 * s * shape.qk_rope_head_dim * bf16 + s * s
        attention = (tokens * me.mla_attention_bytes_per_token(shape, seq_len=s, tp=tp, sequence_parallel=sp,
                                                                dtype_bytes=bf16) + tokens * h * bf16 / tp + per_layer)
        dense = dataclasses.replace(shape, experts=0, topk=0, moe_ffn=0, shared_ffn=0, dense_layers=0)
        for rank in ranks:
            measured = rank[name]
            assert [measured[layer]["attention"] for layer in ("0", "1")] == [attention] * 2, (name, measured)
            assert measured["0"]["layer"] == me.layer_activation_bytes(dense, **kw) + per_layer, name
            # MoE layer (its input h of k copies per token, in one buffer on the rank's experts)
            assert measured["1"]["router"] == ranks[0][name.replace("tp2_sp", "tp1")]["1"]["router"] / tp, name
        received, expected = [rank[name]["1"]["expert_inputs"] for rank in ranks], shape.topk * tokens * h * bf16
        assert received == [expected] * 2 if tp == 1 else sum(received) == expected, (name, received)
    # Without a q latent the count loses the q norm and the q up projection's input, nothing else.
    full, plain = (layer_shape(key_values(mla_memory.arch_line(q_lora_rank=q)), tp=1) for q in (24, None))
    per_token = [me.mla_attention_bytes_per_token(x, seq_len=s, tp=1, sequence_parallel=False, dtype_bytes=bf16)
                 for x in (full, plain)]
    assert per_token[0] - per_token[1] == 8 * 24 + 4 + 24 * bf16
    # The arithmetic's routed term (router, routed copies, expert MLPs: all but the shared expert)
    # splits over tp under sequence parallelism, as the ranks above route.
    routed = [me.mlp_activation_bytes_per_token(full, tp=tp, dtype_bytes=bf16, expert_tp=1, sequence_parallel=tp > 1)
              - 5 * full.shared_ffn * bf16 / tp for tp in (1, 2)]
    assert routed[1] == routed[0] / 2
    # At tp 1 every routed copy stays on the rank: the MoE block (beside its input, counted with the
    # norms) saves less than the arithmetic's MoE term, which the header takes as its count.
    moe_block = ranks[0]["tp1"]["1"]["mlp"] - tokens * full.hidden * bf16
    assert moe_block < tokens * me.mlp_activation_bytes_per_token(full, tp=1, dtype_bytes=bf16)


def test_mla_arithmetic_refuses_what_it_does_not_model():
    """One line each: multi-latent attention runs the local spec only, what selective recompute
    keeps of it is not measured, and its arch line names its own head sizes (no head_dim)."""
    from mcore_dpo.tools import memory_estimate as me
    from tests.helpers.config_arithmetic import dense_param_count, layer_shape

    arch = key_values(mla_memory.arch_line(q_lora_rank=24))
    shape = layer_shape(arch, tp=1)
    kw = dict(seq_len=16, rows=2, tp=1, sequence_parallel=False, dtype_bytes=2)
    for attention, recompute in (("flash", "none"), ("local", "selective")):
        with pytest.raises(ValueError, match=r"^multi-latent attention: modelled for the local layer spec at cp 1 "
                                             r"without selective recompute \(got attention"):
            me.layer_activation_bytes(shape, **kw, attention=attention, recompute=recompute)
    with pytest.raises(ValueError, match="^arch: multi-latent attention states qk_nope_head_dim"):
        dense_param_count({**arch, "head_dim": "18"})
    with pytest.raises(ValueError, match="^arch: multi-latent attention has kv_heads = heads"):
        layer_shape({**arch, "kv_heads": "2"}, tp=1)
