"""The DeepSeek-V3 family (checkpoint_convert/families/deepseek_v3.py) against transformers' own
DeepseekV3ForCausalLM (tiny fp32 models, tests/helpers/deepseek.py): the config translation
and its one-line refusals, the conversion round trips at (tp, pp, ep) = (1,1,1), (2,2,1),
(1,2,2), torch_dist in and out, the multi-token-prediction layers dropped on import, `verify`,
the export loading and generating like the source, one DPO step against HF + TRL's formulas at
(tp, pp, dp, ep) = (2,2,1,1) and (1,1,2,2), and one LoRA DPO step (multi-latent attention's q/kv
projections, o_proj and the routed experts) against HF + PEFT at (1,2,2,2) and, with a plain q
projection, (1,1,2,2) (tests/helpers/lora_families.py)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoint_convert.__main__ import main
from checkpoint_convert.families import spec_from_hf_config
from checkpoint_convert.families.base import ConversionError
from tests.helpers.deepseek import CONFIG, YARN, check_deepseek_job, deepseek_v3
from tests.helpers.lora_families import check_lora_job, lora_job, write_init_adapter
from tests.helpers.models import save_hf, save_pretrained_with_tokenizer
from tests.helpers.parity import packed_parity_job, parity_job
from tests.helpers.round_trips import assert_moe_conversions, assert_quantised_copy_refused, assert_same
from tests.helpers.ranks import check_ran_packed, run_ranks, verify


@pytest.fixture(scope="module")
def hub_dir(tmp_path_factory) -> Path:
    """The tiny model as transformers 5.24's save_pretrained writes it, with a tokenizer."""
    return save_pretrained_with_tokenizer(deepseek_v3(seed=3), tmp_path_factory.mktemp("deepseek") / "hub")


# --------------------------------------------------------------------------- config translation
def test_spec_and_transformer_fields_follow_the_hf_config():
    from checkpoint_convert.families import deepseek_v3 as family

    spec = spec_from_hf_config(deepseek_v3(seed=0).config.to_dict())
    assert spec.moe_layers == (1, 2) and spec.multi_latent_attention and spec.head_dim == 12
    assert (spec.moe_router_groups, spec.moe_router_group_topk, spec.moe_topk_scaling) == (2, 1, 2.5)
    assert spec.moe_shared_intermediate_size == 24 and spec.moe_expert_bias
    fields = family.transformer_fields(spec)
    assert fields["moe_router_score_function"] == "sigmoid" and fields["moe_router_enable_expert_bias"]
    assert fields["moe_router_bias_update_rate"] == 0.0  # the loaded bias is never moved
    assert (fields["rope_type"], fields["rotary_scaling_factor"], fields["mscale"], fields["mscale_all_dim"]) == (
        "yarn", 4.0, 0.9, 0.7)
    assert fields["moe_layer_freq"] == [0, 1, 1] and fields["q_lora_rank"] == 16
    plain = spec_from_hf_config({**CONFIG, "architectures": ["DeepseekV3ForCausalLM"], "rope_parameters": None,
                                 "q_lora_rank": None, "n_group": 1, "topk_group": 1})
    assert plain.q_lora_rank == 0 and not plain.qk_layernorm and plain.rope_scaling is None
    assert plain.moe_router_groups == 0  # one group: no group limit
    assert family.transformer_fields(plain)["rotary_scaling_factor"] == 1.0


def test_megatron_attention_scales_equal_hf():
    """The softmax scale (HF: 1/sqrt(d) x mscale(factor, mscale_all_dim)^2) and the cos/sin
    factor (HF: mscale(factor, mscale) / mscale(factor, mscale_all_dim)) of megatron-core's MLA
    equal HF's, for the mscale conventions HF distinguishes."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import _yarn_get_concentration_factor
    from megatron.core.transformer.multi_latent_attention import _yarn_get_mscale
    from transformers import DeepseekV3ForCausalLM
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from checkpoint_convert.families import deepseek_v3 as family

    for mscale, mscale_all_dim in ((0.9, 0.7), (1.0, 1.0), (0.9, 0.0), (None, None)):
        rope = {**YARN, "mscale": mscale, "mscale_all_dim": mscale_all_dim}
        model = DeepseekV3ForCausalLM(type(deepseek_v3(seed=0).config)(**{**CONFIG, "rope_parameters": rope}))
        fields = family.transformer_fields(spec_from_hf_config(model.config.to_dict()))
        m = _yarn_get_mscale(fields["rotary_scaling_factor"], fields["mscale_all_dim"])
        ours = m * m / math.sqrt(12)
        assert math.isclose(ours, model.model.layers[0].self_attn.scaling, rel_tol=1e-12), rope
        _, hf_factor = ROPE_INIT_FUNCTIONS["yarn"](model.config)
        factor = _yarn_get_concentration_factor(fields["rotary_scaling_factor"], fields["mscale"], fields["mscale_all_dim"])
        assert math.isclose(factor, hf_factor, rel_tol=1e-12), rope


@pytest.mark.parametrize("overrides,message", [
    ({"norm_topk_prob": False}, "field 'norm_topk_prob' is False; megatron-core's sigmoid router always renormalises"),
    ({"num_experts_per_tok": 1, "topk_group": 2}, "field 'num_experts_per_tok' is 1"),
    ({"n_routed_experts": 8, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2},
     "field 'topk_group' (2) is not num_experts_per_tok / 2"),
    ({"rope_interleave": False}, "field 'rope_interleave' is False"),
    ({"attention_bias": True}, "field 'attention_bias' is True"),
    ({"rms_norm_eps": 1e-5}, "field 'rms_norm_eps' is 1e-05"),
    ({"first_k_dense_replace": 3}, "field 'first_k_dense_replace' (3) leaves no MoE layer"),
    ({"rope_parameters": {**YARN, "attention_factor": 1.5}}, "field 'attention_factor' is set"),
    ({"rope_parameters": {**YARN, "truncate": False}}, "field 'truncate' is False"),
    ({"rope_parameters": {**YARN, "mscale": 0.0}}, "field 'mscale' is unset while mscale_all_dim is 0.7"),
    ({"rope_parameters": {**YARN, "rope_type": "linear"}}, "field 'rope_parameters.rope_type' is 'linear'"),
])
def test_what_megatron_core_cannot_express_is_one_line(overrides, message):
    config = {**CONFIG, "architectures": ["DeepseekV3ForCausalLM"], **overrides}
    with pytest.raises(ConversionError) as error:
        spec_from_hf_config(config, source="m/config.json")
    text = str(error.value)
    assert "\n" not in text and text.startswith("m/config.json") and message in text, text


# --------------------------------------------------------------------------- conversion
def test_round_trips_at_three_layouts_and_torch_dist(hub_dir, tmp_path):
    """(tp, pp, ep) = (1,1,1), (2,2,1), (1,2,2): each rank file holds what the trainer's key map
    puts there; back to HF bit for bit; and through torch_dist (written at tp 2 pp 2 ep 2)."""
    source = assert_moe_conversions(hub_dir, tmp_path, reshard_flags=["--tp", "2", "--pp", "1"], export="221")
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in source  # the router bias is part of it


def test_multi_token_prediction_layers_are_dropped_on_import_with_one_line(hub_dir, tmp_path, capsys):
    """A checkpoint with num_nextn_predict_layers = 1 stores a layer past num_hidden_layers (HF's
    forward does not use it): its tensors are dropped on import, with one line saying so."""
    import json
    import shutil

    directory = tmp_path / "mtp"
    shutil.copytree(hub_dir, directory)
    config = json.loads((directory / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (directory / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(directory / "model.safetensors"))
    extra = {"model.layers.3.eh_proj.weight": torch.ones(32, 64), "model.layers.3.enorm.weight": torch.ones(32)}
    save_file({**tensors, **extra}, str(directory / "model.safetensors"), metadata={"format": "pt"})
    capsys.readouterr()
    assert main(["hf-to-mcore", "--hf-dir", str(directory), "--out", str(tmp_path / "m")]) == 0
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "dropping" in line]
    assert len(lines) == 1 and "dropping 2 tensor(s) of layers past num_hidden_layers (3)" in lines[0], err
    assert main(["mcore-to-hf", "--mcore-dir", str(tmp_path / "m"), "--out", str(tmp_path / "hf")]) == 0
    assert_same(tmp_path / "hf", tensors, "MTP layer dropped")


def test_the_released_fp8_weights_are_refused_in_one_line(hub_dir, tmp_path, capsys):
    """DeepSeek-V3's release: fp8 weights with 128 x 128 block scales (`*_scale_inv`), which read
    as plain weights would train on the raw fp8 values: the converter and the trainer refuse
    them, naming config.json's field."""
    fp8 = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
    assert_quantised_copy_refused(hub_dir, tmp_path, capsys, quantization=fp8,
                                  scales={"model.layers.1.self_attn.q_a_proj.weight_scale_inv": torch.ones(1, 1)})


def test_verify_tp2_pp2(hub_dir, tmp_path, capsys):
    assert main(["hf-to-mcore", "--hf-dir", str(hub_dir), "--out", str(tmp_path / "m"), "--tp", "2", "--pp", "2"]) == 0
    capsys.readouterr()
    # 48 positions: past the YaRN original length (32), so the scaled frequencies matter.
    code = verify(["--hf-dir", str(hub_dir), "--mcore-dir", str(tmp_path / "m"), "--atol", "1e-4", "--seq-len", "48"])
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    assert "argmax agreement 100.00%" in captured.out


# --------------------------------------------------------------------------- DPO parity
def test_parity_one_step_pp2_and_ep2(tmp_path):
    """One DPO step at (tp, pp, dp, ep) = (2, 2, 1, 1) (sequence parallel, as every MoE model at
    tp > 1) and (1, 1, 2, 2): metrics, every rank's gradients and the weights after the step
    against HF + TRL's formulas; the router biases come out as loaded. In the same launches, LoRA
    against HF + PEFT at (1, 2, 2, 2) and, on a plain q projection, (1, 1, 2, 2)."""
    policy = save_hf(deepseek_v3(seed=1), tmp_path / "policy")
    reference = save_hf(deepseek_v3(seed=2), tmp_path / "reference")
    layouts = ((2, 2, 1, 1), (1, 1, 2, 2))
    # LoRA: q_a/q_b at pp 2 ep 2 in the launch of 4 ranks; a plain q projection (q_lora_rank null)
    # at ep 2 in the launch of 2. That model is drawn from seed 2: at seed 1 its layer-0 q_proj
    # adapter's step-1 gradient is a near-cancellation of the chosen and rejected terms, which fp32
    # rounding alone puts 2e-5 (HF) and 1.2e-5 (the engine) from its float64 value.
    plain_q = save_hf(deepseek_v3(seed=2, q_lora_rank=None), tmp_path / "plain_q")
    lora = [(layout, lora_job(layout, model, write_init_adapter(model, tmp_path / f"adapter{k}", seed=5),
                              name="deepseek_v3"))
            for k, (layout, model) in enumerate((((1, 2, 2, 2), policy), ((1, 1, 2, 2), plain_q)))]
    for k, layout in enumerate(layouts):
        common = dict(name="deepseek_v3", steps=1, ep=layout[3], export_hf=False, distributed_optimizer=False)
        # Rows of segments: packed (RoPE restarting in each sequence) at both layouts, and packed with
        # shared prompts (the rejected branch at the chosen one's positions) at tp 2 with sequence
        # parallelism: each layer's rotary table comes at the tokens' positions (model/mla.py).
        jobs = [parity_job(layout, policy, reference, **common), packed_parity_job(layout, policy, reference, **common)]
        if layout[0] == 2:
            jobs.append(packed_parity_job(layout, policy, reference, prefix_sharing=True, **common))
        for job in jobs:
            job["eval_pairs"] = []
        run_ranks(world_size=layout[0] * layout[1] * layout[2], jobs=jobs + [lora[k][1]], out_dir=tmp_path / f"out{k}")
        check_ran_packed(tmp_path / f"out{k}", padded=0, packed=1)
        for j, job in enumerate(jobs):
            check_deepseek_job(tmp_path / f"out{k}", j, job, layout)
        check_lora_job(tmp_path / f"out{k}", len(jobs), lora[k][1], lora[k][0])
