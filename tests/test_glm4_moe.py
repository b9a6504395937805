"""The GLM-4.5 family (checkpoint_convert/families/glm4_moe.py) against transformers' own
Glm4MoeForCausalLM (tiny fp32 models, tests/helpers/glm.py): the config translation (both config
forms, HF's defaults) and its one-line refusals, megatron-core's partial RoPE against HF's, the
conversion round trips at (tp, pp, ep) = (1,1,1), (2,2,1), (1,2,2) and through torch_dist, the
multi-token-prediction layers dropped on import, `verify`, the export loading and generating like
the source, and one DPO step against HF + TRL's formulas at (tp, pp, dp, ep) = (2,2,1,1) and
(1,2,2,2), and one LoRA DPO step against HF + PEFT at (1,2,2,2) (tests/helpers/lora_families.py),
the three jobs in one launch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoint_convert.__main__ import main
from checkpoint_convert.families import spec_from_hf_config
from checkpoint_convert.families.base import ConversionError
from tests.helpers.glm import CONFIG, glm4_moe
from tests.helpers.lora_families import check_lora_job, lora_job, write_init_adapter
from tests.helpers.models import save_hf, save_pretrained_with_tokenizer
from tests.helpers.moe_parity import check_expert_bias_job, one_step_jobs
from tests.helpers.round_trips import assert_moe_conversions, assert_quantised_copy_refused, assert_same
from tests.helpers.ranks import run_ranks, verify


@pytest.fixture(scope="module")
def hub_dir(tmp_path_factory) -> Path:
    """The tiny model as transformers 5.24's save_pretrained writes it, with a tokenizer."""
    return save_pretrained_with_tokenizer(glm4_moe(seed=3), tmp_path_factory.mktemp("glm") / "hub")


def _config(**overrides) -> dict:
    return {**CONFIG, "architectures": ["Glm4MoeForCausalLM"], **overrides}


# --------------------------------------------------------------------------- config translation
def test_spec_and_transformer_fields_follow_the_hf_config():
    from checkpoint_convert.families import glm4_moe as family

    spec = spec_from_hf_config(glm4_moe(seed=0).config.to_dict())
    assert spec.moe_layers == (1, 2) and spec.qkv_bias and spec.qk_layernorm and spec.rotary_percent == 0.5
    assert (spec.moe_router_groups, spec.moe_router_group_topk, spec.moe_topk_scaling) == (2, 1, 2.5)
    assert spec.moe_shared_intermediate_size == 24 and spec.moe_expert_bias and not spec.multi_latent_attention
    fields = family.transformer_fields(spec)
    assert fields["add_qkv_bias"] and fields["qk_layernorm"] and not fields["rotary_interleaved"]
    assert fields["moe_router_score_function"] == "sigmoid" and fields["moe_router_enable_expert_bias"]
    assert fields["moe_router_bias_update_rate"] == 0.0 and fields["moe_layer_freq"] == [0, 1, 1]
    # The hub's config.json (transformers 4 form: top-level rope_theta and partial_rotary_factor)
    # reads the same; a field it lacks means what Glm4MoeConfig's default means.
    hub = {k: v for k, v in _config(rope_theta=10000.0).items()}
    assert spec_from_hf_config(hub) == spec
    bare = {k: v for k, v in hub.items() if k not in ("partial_rotary_factor", "rms_norm_eps", "first_k_dense_replace",
                                                      "use_qk_norm", "attention_bias", "n_shared_experts")}
    air = spec_from_hf_config(bare)
    assert (air.rotary_percent, air.rms_norm_eps, air.moe_layers, air.qk_layernorm, air.qkv_bias) == (0.5, 1e-5, (1, 2),
                                                                                                    False, False)
    assert air.moe_shared_intermediate_size == 24
    nested = {k: v for k, v in _config().items() if k not in ("rope_theta", "partial_rotary_factor")}
    nested = spec_from_hf_config({**nested, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5,
                                                                "partial_rotary_factor": 0.75}})
    assert (nested.rotary_percent, nested.rope_theta) == (0.75, 5e5)


def test_megatron_partial_rope_equals_hf(monkeypatch):
    """megatron-core's RotaryEmbedding(rotary_percent) + apply_rotary_pos_emb (not interleaved)
    give HF's Glm4Moe rotary embedding + apply_rotary_pos_emb bit for bit: the first
    int(head_dim x factor) dims rotated by halves, the rest passed through."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers.models.glm4_moe import modeling_glm4_moe as hf

    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    model = glm4_moe(seed=0)
    spec = spec_from_hf_config(model.config.to_dict())
    seq, heads, d = 96, 2, spec.head_dim
    q, k = torch.randn(2, 1, heads, seq, d, generator=torch.Generator().manual_seed(5)).unbind(0)  # HF: [b, h, s, d]
    cos, sin = model.model.rotary_emb(q, torch.arange(seq)[None])
    expected = hf.apply_rotary_pos_emb(q, k, cos, sin)
    rope = RotaryEmbedding(kv_channels=d, rotary_percent=spec.rotary_percent, rotary_base=int(spec.rope_theta),
                           use_cpu_initialization=True)
    freqs = rope.get_emb(seq)  # [s, 1, 1, rotary dims]
    assert freqs.shape[-1] == 8
    config = SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False)
    for x, theirs in zip((q, k), expected):
        ours = apply_rotary_pos_emb(x.permute(2, 0, 1, 3), freqs, config, cp_group="unused")  # megatron: [s, b, h, d]
        assert torch.equal(ours.permute(1, 2, 0, 3), theirs)
        assert torch.equal(theirs[..., 8:], x[..., 8:])  # the pass-through half


@pytest.mark.parametrize("overrides,message", [
    ({"norm_topk_prob": False}, "field 'norm_topk_prob' is False; megatron-core's sigmoid router always renormalises"),
    ({"num_experts_per_tok": 1, "topk_group": 2}, "field 'num_experts_per_tok' is 1"),
    ({"n_routed_experts": 8, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2},
     "field 'topk_group' (2) is not num_experts_per_tok / 2"),
    ({"n_group": 3}, "field 'n_group' (3) does not divide n_routed_experts (4)"),
    ({"first_k_dense_replace": 3}, "field 'first_k_dense_replace' (3) leaves no MoE layer"),
    ({"partial_rotary_factor": 1.5}, "field 'partial_rotary_factor' must be a number in (0, 1], got 1.5"),
    ({"partial_rotary_factor": 0.05}, "field 'partial_rotary_factor' (0.05) leaves no rotary pair of head_dim 16"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
     "field 'rope_parameters.rope_type' is 'yarn'; only 'default' is supported"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "field 'rope_scaling.rope_type' is 'linear'"),
    ({"hidden_act": "gelu"}, "field 'hidden_act' is 'gelu'; only 'silu' is supported"),
])
def test_what_megatron_core_cannot_express_is_one_line(overrides, message):
    with pytest.raises(ConversionError) as error:
        spec_from_hf_config(_config(**overrides), source="m/config.json")
    text = str(error.value)
    assert "\n" not in text and text.startswith("m/config.json") and message in text, text


# --------------------------------------------------------------------------- conversion
def test_round_trips_at_three_layouts_torch_dist_and_the_export(hub_dir, tmp_path):
    """(tp, pp, ep) = (1,1,1), (2,2,1), (1,2,2): each rank file holds what the trainer's key map
    puts there; back to HF bit for bit; through torch_dist (written at tp 2 pp 2 ep 2) and back,
    directly and resharded to tp 2 pp 1 ep 2; the export loads with AutoModelForCausalLM and generates the source's greedy tokens."""
    source = assert_moe_conversions(hub_dir, tmp_path, reshard_flags=["--tp", "2", "--pp", "1", "--ep", "2"], export="122")
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in source  # the router bias is part of it


def test_multi_token_prediction_layers_are_dropped_on_import_with_one_line(hub_dir, tmp_path, capsys):
    """GLM-4.5(-Air) checkpoints store num_nextn_predict_layers = 1 layer past num_hidden_layers
    (HF's forward has no such module): its tensors are dropped on import, with one line."""
    directory = tmp_path / "mtp"
    shutil.copytree(hub_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (directory / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(directory / "model.safetensors"))
    extra = {"model.layers.3.eh_proj.weight": torch.ones(32, 64), "model.layers.3.self_attn.q_proj.weight": torch.ones(64, 32)}
    save_file({**tensors, **extra}, str(directory / "model.safetensors"), metadata={"format": "pt"})
    capsys.readouterr()
    assert main(["hf-to-mcore", "--hf-dir", str(directory), "--out", str(tmp_path / "m")]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "dropping" in line]
    assert len(lines) == 1 and "dropping 2 tensor(s) of layers past num_hidden_layers (3)" in lines[0], err
    assert main(["mcore-to-hf", "--mcore-dir", str(tmp_path / "m"), "--out", str(tmp_path / "hf")]) == 0
    assert_same(tmp_path / "hf", tensors, "MTP layer dropped")


def test_a_quantised_checkpoint_is_refused_in_one_line(hub_dir, tmp_path, capsys):
    """An fp8 checkpoint in the compressed-tensors layout (a `weight_scale` beside each weight):
    the converter and the trainer refuse it, naming config.json's field."""
    fp8 = {"quant_method": "compressed-tensors", "format": "float-quantized"}
    assert_quantised_copy_refused(hub_dir, tmp_path, capsys, quantization=fp8,
                                  scales={"model.layers.1.mlp.shared_experts.gate_proj.weight_scale": torch.ones(1)})


def test_verify_tp2_pp2(hub_dir, tmp_path, capsys):
    assert main(["hf-to-mcore", "--hf-dir", str(hub_dir), "--out", str(tmp_path / "m"), "--tp", "2", "--pp", "2"]) == 0
    capsys.readouterr()
    code = verify(["--hf-dir", str(hub_dir), "--mcore-dir", str(tmp_path / "m"), "--atol", "1e-4", "--seq-len", "48"])
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    assert "argmax agreement 100.00%" in captured.out


# --------------------------------------------------------------------------- DPO parity
def test_parity_one_step_pp2_and_ep2(tmp_path):
    """One DPO step at (tp, pp, dp, ep) = (2, 2, 1, 1) (sequence parallel, as every MoE model at
    tp > 1) and (1, 2, 2, 2), one launch of 4 ranks: metrics, every rank's gradients and the
    weights after the step against HF + TRL's formulas; the router biases come out as loaded.
    In the same launch, LoRA on attention and the routed experts at (1, 2, 2, 2) against HF + PEFT."""
    policy = save_hf(glm4_moe(seed=1), tmp_path / "policy")
    reference = save_hf(glm4_moe(seed=2), tmp_path / "reference")
    layouts = ((2, 2, 1, 1), (1, 2, 2, 2))
    jobs = one_step_jobs(policy, reference, name="glm4_moe", layouts=layouts)
    lora_layout = (1, 2, 2, 2)
    jobs.append(lora_job(lora_layout, policy, write_init_adapter(policy, tmp_path / "adapter", seed=5), name="glm4_moe"))
    run_ranks(world_size=4, jobs=jobs, out_dir=tmp_path / "out")
    for j, (job, layout) in enumerate(zip(jobs, layouts)):
        check_expert_bias_job(tmp_path / "out", j, job, layout)
    check_lora_job(tmp_path / "out", len(layouts), jobs[-1], lora_layout)
