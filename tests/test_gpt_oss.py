"""The GPT-OSS family (checkpoint_convert/families/gpt_oss.py, mcore_dpo/model/gpt_oss.py) against
transformers' own GptOssForCausalLM (tiny fp32 models, tests/helpers/gpt_oss.py): the config
translation and its one-line refusals, the YaRN frequencies against HF's, the MXFP4 dequantiser
against transformers' (an independent peer) and an import of experts stored MXFP4, the conversion
round trips at (tp, pp, ep) = (1,1,1), (2,2,1), (1,2,2) and through torch_dist, the export loading
and generating like the source, `verify`, and one DPO step against HF + TRL's formulas (in
float64: tests/helpers/gpt_oss.float64_reference says why) at (tp, pp, dp, ep) = (1,2,2,2),
(2,2,1,2) and (1,1,4,1), and one LoRA DPO step (attention and the biased experts, gate/up
interleaved) against HF + PEFT at (1,2,2,2) (tests/helpers/lora_families.py), the four jobs in one
launch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from checkpoint_convert.__main__ import main
from checkpoint_convert.families import spec_from_hf_config
from checkpoint_convert.families.base import ConversionError
from checkpoint_convert.io import open_hf_dir
from tests.helpers import parity
from tests.helpers.gpt_oss import CONFIG, float64_reference, gpt_oss, mxfp4_experts, random_mxfp4, without_float32_islands
from tests.helpers.lora_families import check_lora_job, lora_job, write_init_adapter
from tests.helpers.models import save_hf, save_pretrained_with_tokenizer
from tests.helpers.moe_parity import one_step_jobs, rank_shard
from tests.helpers.ranks import load_rank_tensors, run_ranks, verify
from tests.helpers.reference import RTOL, assert_close
from tests.helpers.round_trips import assert_moe_conversions, assert_same, tensors_of


@pytest.fixture(scope="module")
def hub_dir(tmp_path_factory) -> Path:
    """The tiny model as transformers 5.24's save_pretrained writes it, with a tokenizer."""
    return save_pretrained_with_tokenizer(gpt_oss(seed=3), tmp_path_factory.mktemp("gpt_oss") / "hub")


def _config(**overrides) -> dict:
    return {**gpt_oss(seed=0).config.to_dict(), **overrides}


# --------------------------------------------------------------------------- config translation
def test_spec_and_transformer_fields_follow_the_hf_config():
    from checkpoint_convert.families import gpt_oss as family

    spec = spec_from_hf_config(_config())
    assert spec.family == "gpt_oss" and spec.qkv_bias and spec.moe_layers == (0, 1, 2, 3) and spec.moe_norm_topk
    assert (spec.num_experts, spec.moe_topk, spec.moe_intermediate_size, spec.swiglu_limit) == (4, 2, 32, 1.5)
    assert spec.sliding_layers == (0, 2) and spec.sliding_window == 4 and spec.rope_theta == 150000.0
    assert spec.rope_scaling["rope_type"] == "yarn" and spec.rope_scaling["truncate"] is False
    fields = family.transformer_fields(spec)
    assert fields["add_bias_linear"] and fields["add_qkv_bias"] and fields["softmax_type"] == "learnable"
    assert (fields["glu_linear_offset"], fields["activation_func_clamp_value"]) == (1.0, 1.5)
    assert fields["window_size"] == (3, 0) and fields["window_attn_skip_freq"] == [1, 0, 1, 0]
    assert not fields["moe_router_pre_softmax"] and fields["moe_router_score_function"] == "softmax"
    # quick_gelu is HF's gate * sigmoid(1.702 gate)
    x = torch.linspace(-4, 4, 33)
    assert torch.equal(fields["activation_func"](x), x * torch.sigmoid(x * 1.702))
    # A bare config.json means GptOssConfig's defaults: YaRN factor 32 over 4096, theta 150000,
    # even layers sliding.
    bare = {k: v for k, v in _config().items() if k not in ("rope_parameters", "layer_types", "swiglu_limit")}
    spec = spec_from_hf_config(bare)
    assert spec.rope_scaling["factor"] == 32.0 and spec.rope_theta == 150000.0 and spec.sliding_layers == (0, 2)
    assert spec.swiglu_limit == 7.0


@pytest.mark.parametrize("rope", [{}, {"attention_factor": 1.3}, {"mscale": 0.9, "mscale_all_dim": 0.7}, {"factor": 1.0}],
                         ids=["default-factor", "explicit-factor", "mscales", "no-scaling"])
def test_megatron_lm_yarn_args_give_hf_attention_factor(rope):
    """The args' YaRN makes megatron-core's cos/sin factor (its concentration factor of the
    `yarn_*` values) HF's attention factor, whatever way the config gives it; the softmax scale
    is then megatron-core's plain one."""
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import _yarn_get_concentration_factor

    from checkpoint_convert.families.gpt_oss import attention_factor, megatron_lm_args

    spec = spec_from_hf_config({**_config(), "rope_parameters": {**CONFIG["rope_parameters"], **rope}})
    args = megatron_lm_args(spec)
    got = _yarn_get_concentration_factor(args["yarn_rotary_scaling_factor"], args["yarn_mscale"], args["yarn_mscale_all_dim"])
    assert got == pytest.approx(attention_factor(spec), rel=1e-12, abs=0)
    assert args["softmax_scale"] is None and args["position_embedding_type"] == "yarn"
    assert args["yarn_correction_range_round_to_int"] is spec.rope_scaling["truncate"]


def test_yarn_frequencies_and_scale_equal_hf():
    """rope_inv_freq and attention_factor = HF's YaRN (truncate false and true)."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from checkpoint_convert.families.gpt_oss import attention_factor, rope_inv_freq

    for truncate in (False, True):
        config = GptOssConfig(**{**CONFIG, "rope_parameters": {**CONFIG["rope_parameters"], "truncate": truncate}})
        theirs, scale = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
        spec = spec_from_hf_config(config.to_dict())
        assert torch.equal(rope_inv_freq(spec), theirs) and attention_factor(spec) == scale, truncate


@pytest.mark.parametrize("overrides,message", [
    ({"attention_bias": False}, "field 'attention_bias' is False; megatron-core's add_bias_linear"),
    ({"swiglu_alpha": 1.5}, "field 'swiglu_alpha' is 1.5; megatron-core's quick_gelu has 1.702"),
    ({"quantization_config": {"quant_method": "fp8"}}, "field 'quantization_config.quant_method' is 'fp8'; only 'mxfp4'"),
    ({"layer_types": ["sliding_attention"] * 3}, "field 'layer_types' must list 4 of sliding_attention, full_attention"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
     "field 'rope_parameters.rope_type' is 'linear'; only 'default' and 'yarn' are supported"),
    ({"rope_parameters": {**CONFIG["rope_parameters"], "partial_rotary_factor": 0.5}},
     "field 'partial_rotary_factor' is 0.5; only 1.0 is supported"),
    ({"rope_parameters": {**CONFIG["rope_parameters"], "truncate": "yes"}}, "field 'truncate' must be true or false"),
    ({"num_experts_per_tok": 8}, "field 'num_experts_per_tok' (8) exceeds num_local_experts (4)"),
    ({"hidden_act": "gelu"}, "field 'hidden_act' is 'gelu'; only 'silu' is supported"),
])
def test_what_megatron_core_cannot_express_is_one_line(overrides, message):
    with pytest.raises(ConversionError) as error:
        spec_from_hf_config(_config(**overrides), source="m/config.json")
    text = str(error.value)
    assert "\n" not in text and text.startswith("m/config.json") and message in text, text


# --------------------------------------------------------------------------- MXFP4
def test_mxfp4_dequantiser_equals_transformers():
    """Ours against transformers' convert_moe_packed_tensors on tensors written in the layout:
    every code and nibble order, scales over a wide range, both dtypes."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from checkpoint_convert.families.gpt_oss import dequantise_mxfp4

    gen = torch.Generator().manual_seed(0)
    blocks, _ = random_mxfp4((3, 8, 64), gen=gen)
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # each code in both nibbles
    scales = torch.randint(100, 150, (3, 8, 2), generator=gen).to(torch.uint8)
    for dtype in (torch.float32, torch.bfloat16):
        ours = dequantise_mxfp4(blocks, scales, dtype=dtype)  # [E, rows, cols]
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, cols, rows]
        assert ours.dtype == dtype and torch.equal(ours.transpose(1, 2), theirs)
    with pytest.raises(ValueError, match="must be uint8"):
        dequantise_mxfp4(blocks.to(torch.int8), scales, dtype=torch.float32)


def test_mxfp4_experts_import_as_the_dequantised_model(tmp_path, capsys):
    """A checkpoint whose experts are stored as MXFP4 blocks and scales (quantization_config mxfp4)
    imports as the plain model of the dequantised weights, bit for bit; the export writes them
    plain, without quantization_config."""
    model = gpt_oss(seed=5)
    quantized = mxfp4_experts(model, seed=5)
    plain = tmp_path / "plain"
    model.save_pretrained(str(plain))
    tensors = tensors_of(plain)
    stored = {n: t for n, t in tensors.items() if not n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    stored.update(quantized)
    packed = tmp_path / "mxfp4"
    packed.mkdir()
    save_file(stored, str(packed / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((plain / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (packed / "config.json").write_text(json.dumps(config))
    for layout in (["--tp", "1"], ["--tp", "2", "--pp", "2"]):
        assert main(["hf-to-mcore", "--hf-dir", str(plain), "--out", str(tmp_path / "a"), *layout, "--overwrite"]) == 0
        assert main(["hf-to-mcore", "--hf-dir", str(packed), "--out", str(tmp_path / "b"), *layout, "--overwrite"]) == 0
        for a, b in zip(sorted((tmp_path / "a").glob("tp*/model.safetensors")), sorted((tmp_path / "b").glob("tp*/model.safetensors"))):
            assert_same(b.parent, tensors_of(a.parent), f"MXFP4 import at {layout}")
    assert main(["mcore-to-hf", "--mcore-dir", str(tmp_path / "b"), "--out", str(tmp_path / "hf")]) == 0
    assert_same(tmp_path / "hf", tensors, "MXFP4 -> Megatron -> HF (plain)")
    assert "quantization_config" not in json.loads((tmp_path / "hf" / "config.json").read_text())
    # Blocks that do not fit the expected tensor: one line naming the file and tensor.
    bad = dict(stored)
    bad["model.layers.1.mlp.experts.down_proj_blocks"] = bad["model.layers.1.mlp.experts.down_proj_blocks"][:, :8].contiguous()
    save_file(bad, str(packed / "model.safetensors"), metadata={"format": "pt"})
    capsys.readouterr()
    assert main(["hf-to-mcore", "--hf-dir", str(packed), "--out", str(tmp_path / "c")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.layers.1.mlp.experts.down_proj_blocks" in err[0] and "does not dequantise" in err[0]


# --------------------------------------------------------------------------- conversion
def test_round_trips_at_three_layouts_torch_dist_and_the_export(hub_dir, tmp_path):
    """(tp, pp, ep) = (1,1,1), (2,2,1), (1,2,2): each rank file holds what the key map puts there;
    back to HF bit for bit; through torch_dist (written at tp 2 pp 2 ep 2) and back, directly and
    resharded to tp 2 pp 1 ep 2; the export loads with AutoModelForCausalLM and generates the
    source's greedy tokens (past the sliding window)."""
    source = assert_moe_conversions(hub_dir, tmp_path, reshard_flags=["--tp", "2", "--pp", "1", "--ep", "2"], export="122")
    assert {"model.layers.0.self_attn.sinks", "model.layers.3.mlp.experts.gate_up_proj_bias"} <= set(source)


def test_verify_pp2_ep2(hub_dir, tmp_path, capsys):
    assert main(["hf-to-mcore", "--hf-dir", str(hub_dir), "--out", str(tmp_path / "m"), "--pp", "2", "--ep", "2"]) == 0
    capsys.readouterr()
    code = verify(["--hf-dir", str(hub_dir), "--mcore-dir", str(tmp_path / "m"), "--atol", "1e-4", "--seq-len", "48"])
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    assert "argmax agreement 100.00%" in captured.out


def test_the_sinks_count_in_the_grad_norm_on_every_tp_rank():
    """The sinks (`core_attention.softmax_offset`, one per local head) are split over tp, but
    megatron-core 0.16.1 leaves them unmarked; `mark_sinks_split` marks them, so the gradient
    norm counts each tp rank's sinks (unmarked, it counted them on tp rank 0 only, like a norm:
    grad_norm at tp 2 was short by the other ranks' sinks). A rank at tp 2 with whole experts
    (ep 2): its sinks, tp-split weights and its own experts' (unsplit) output biases count, the
    replicated norm does not."""
    from types import SimpleNamespace

    from mcore_dpo.model.gpt_oss import mark_sinks_split
    from mcore_dpo.optim.adamw import params_once
    from mcore_dpo.parallel.mesh import Layout, Mesh

    stage = torch.nn.Module()
    stage.core_attention = torch.nn.Module()
    stage.core_attention.softmax_offset = torch.nn.Parameter(torch.zeros(2))
    stage.norm = torch.nn.Parameter(torch.ones(32))
    stage.qkv = torch.nn.Parameter(torch.zeros(64, 32))
    stage.qkv.tensor_model_parallel = True
    stage.expert_fc2_bias = torch.nn.Parameter(torch.zeros(32))
    stage.expert_fc2_bias.allreduce = False
    mark_sinks_split(stage.core_attention)
    mark_sinks_split(stage.core_attention)  # idempotent
    assert stage.core_attention.softmax_offset.partition_dim == 0
    spec = SimpleNamespace(tie_word_embeddings=False)
    for tp_rank in (0, 1):
        mesh = Mesh(layout=Layout(tp=2, pp=1, dp=1, ep=2), rank=tp_rank, tp_rank=tp_rank, pp_rank=0, dp_rank=0,
                    tp_group=None, pp_group=None, dp_group=None, model_parallel_group=None, prev_rank=None,
                    next_rank=None, embedding_group=None, ep_rank=tp_rank, edp_rank=0)
        counted = {id(p) for p in params_once(stage, spec=spec, mesh=mesh)}
        names = {n for n, p in stage.named_parameters() if id(p) in counted}
        replicated = {"norm"} if tp_rank == 0 else set()
        assert names == {"core_attention.softmax_offset", "qkv", "expert_fc2_bias"} | replicated, tp_rank


# --------------------------------------------------------------------------- DPO parity
def _check_job(out_dir: Path, j: int, job: dict, layout: tuple[int, int, int, int]) -> None:
    """Step-1 metrics, every rank's step-1 gradients and dp rank 0's weights after the step
    against HF + TRL's formulas, one step in float64 (`float64_reference`: the attention-sink
    gradient's cancellation leaves an fp32 reference itself about 7e-6 from the exact value)."""
    tp, pp, dp, ep = layout
    config = job["config"]
    ref = float64_reference(config["model"], config["ref_model"], steps=1)
    expected = rank_shard(open_hf_dir(config["model"]).spec, layout)
    what = f"gpt_oss at tp{tp} pp{pp} dp{dp} ep{ep}"

    for (t, p, d), shard in load_rank_tensors(out_dir, j, "grads1", layout=(tp, pp, dp)).items():
        want = expected(ref["grads"][0], t, p, d)
        assert set(want) == set(shard), what
        for name, value in want.items():
            assert_close(shard[name], value, what=f"{what} step 1 grad {name} (rank tp{t} pp{p} dp{d})")
    for (t, p, d), shard in load_rank_tensors(out_dir, j, "weights", layout=(tp, pp, dp)).items():
        if d == 0:
            for name, value in expected(ref["weights"], t, p, d).items():
                assert_close(shard[name], value, what=f"{what} weight {name} after 1 step")
    ours = json.loads((out_dir / f"job{j}_metrics.json").read_text())
    parity.check_metrics(ours[0], ref["metrics"][0], names=parity.METRICS, prefix="", what=f"{what} step 1", rtol=RTOL)


def test_parity_one_step_pp2_ep2(tmp_path):
    """One DPO step at (tp, pp, dp, ep) = (1, 2, 2, 2), (2, 2, 1, 2) (sequence parallel) and
    (1, 1, 4, 1) (expert-tp 1 without expert parallelism: the experts' output bias added after a
    no-op reduce, mcore_dpo/model/gpt_oss.py), one launch of 4 ranks: metrics, every rank's
    gradients and the weights after the step against HF + TRL's formulas. In the same launch,
    LoRA at (1, 2, 2, 2) against HF + PEFT, in float64 as the rest."""

    policy = save_hf(gpt_oss(seed=1), tmp_path / "policy")
    reference = save_hf(gpt_oss(seed=2), tmp_path / "reference")
    layouts = ((1, 2, 2, 2), (2, 2, 1, 2), (1, 1, 4, 1))
    jobs = one_step_jobs(policy, reference, name="gpt_oss", layouts=layouts)
    lora_layout = (1, 2, 2, 2)
    jobs.append(lora_job(lora_layout, policy, write_init_adapter(policy, tmp_path / "adapter", seed=5), name="gpt_oss"))
    run_ranks(world_size=4, jobs=jobs, out_dir=tmp_path / "out")
    for j, (job, layout) in enumerate(zip(jobs, layouts)):
        _check_job(tmp_path / "out", j, job, layout)
    with without_float32_islands():
        check_lora_job(tmp_path / "out", len(layouts), jobs[-1], lora_layout, dtype=torch.float64)
