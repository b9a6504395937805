"""The Gemma 3 text family (checkpoint_convert/families/gemma3.py, mcore_dpo/model/gemma3.py)
against transformers' own Gemma3ForCausalLM (tiny fp32 models, tests/helpers/gemma.py: local
and global layers on both stages of a pp-2 split, a window shorter than the sequences): the
config translation and its one-line refusals, the conversion round trips at (tp, pp) = (1,1),
(2,2), through torch_dist and a reshard, `verify`, the export loading and generating like the
source, and one DPO step against HF + TRL's formulas at (tp, pp, dp) = (2,2,1) (sequence
parallel), (1,2,2) (padded, packed and with shared prompts) and (2,1,2), with activation
recompute, and one LoRA DPO step on all four targets against HF + PEFT at (2,2,1)
(tests/helpers/lora_families.py), in one launch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from checkpoint_convert.__main__ import main
from checkpoint_convert.families import spec_from_hf_config
from checkpoint_convert.families.base import ConversionError
from checkpoint_convert.mapping import hf_tensor_shapes
from tests.helpers.gemma import CONFIG, ROPE, gemma3
from tests.helpers.lora_families import check_lora_job, lora_job, write_init_adapter
from tests.helpers.models import assert_export_generates_like, save_hf
from tests.helpers import parity
from tests.helpers.reference import RTOL
from tests.helpers.round_trips import assert_round_trips, assert_torch_dist_round_trips
from tests.helpers.ranks import check_ran_packed, run_ranks, verify

_BASE = {**CONFIG, "architectures": ["Gemma3ForCausalLM"]}


@pytest.fixture(scope="module")
def hub_dir(tmp_path_factory) -> Path:
    """The tiny model as transformers 5's save_pretrained writes it, with a tokenizer."""
    return save_hf(gemma3(seed=3), tmp_path_factory.mktemp("gemma3") / "hub")


# --------------------------------------------------------------------------- config translation
def test_spec_and_transformer_fields_follow_the_hf_config():
    from checkpoint_convert.families import gemma3 as family

    spec = spec_from_hf_config(gemma3(seed=0).config.to_dict())
    assert spec.family == "gemma3_text" and spec.tie_word_embeddings and spec.qk_layernorm
    assert (spec.sliding_layers, spec.sliding_window) == ((0, 1, 3, 4), 4)
    assert (spec.rope_theta, spec.rope_local_theta, spec.rope_linear_factors) == (1e6, 1e4, (8.0, 1.0))
    fields = family.transformer_fields(spec)
    assert fields["softmax_scale"] == 24 ** -0.5 and fields["activation_func"] is family.gelu_tanh
    assert fields["window_size"] == (3, 0) and fields["window_attn_skip_freq"] == [1, 1, 0, 1, 1, 0]
    # The transformers 4 form of a released config (gemma-3-27b's text part): rope_theta,
    # rope_local_base_freq, rope_scaling (global layers only), sliding_window_pattern, tied by default.
    old = {k: v for k, v in _BASE.items() if k not in ("layer_types", "rope_parameters", "tie_word_embeddings")}
    old.update(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
               sliding_window_pattern=6, num_hidden_layers=12)
    spec = spec_from_hf_config(old)
    assert spec.sliding_layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10) and spec.tie_word_embeddings
    assert (spec.rope_theta, spec.rope_local_theta, spec.rope_linear_factors) == (1e6, 1e4, (8.0, 1.0))
    untied = spec_from_hf_config({**_BASE, "tie_word_embeddings": False, "final_logit_softcapping": None})
    assert "lm_head.weight" in hf_tensor_shapes(untied) and untied.final_logit_softcapping == 0.0


def test_megatron_rope_and_norm_equal_hf():
    """The two-kind RoPE table gives each layer kind HF's angles and the positions, and the
    (1 + w) norm and the bf16 embedding scale are HF's bit for bit."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mcore_dpo.model.gemma3 import GemmaRMSNorm, embedding_scale, inv_freq, layer_rope

    model = gemma3(seed=0)
    spec = spec_from_hf_config(model.config.to_dict())
    freqs = torch.outer(torch.arange(20, dtype=torch.float32), inv_freq(spec))
    table = torch.cat((freqs, freqs), dim=-1)  # megatron-core's RotaryEmbedding.get_emb, non-interleaved
    rope = model.model.rotary_emb
    x, positions = torch.zeros(1, 20, 16), torch.arange(20)[None]
    for kind, local in (("full_attention", False), ("sliding_attention", True)):
        cos, _ = rope(x, positions, kind)
        angles, at = layer_rope(table, local=local)
        assert torch.equal(angles.cos(), cos[0]) and torch.equal(at, positions[0].float()), kind
    config = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4)
    norm = GemmaRMSNorm(config, 32, eps=1e-6)
    hf_norm = model.model.layers[0].input_layernorm
    with torch.no_grad():
        norm.weight.copy_(hf_norm.weight)
    h = torch.randn(3, 5, 32)
    assert torch.equal(norm(h), hf_norm(h))
    embed = model.model.embed_tokens.to(torch.bfloat16)  # HF rounds sqrt(h) to the weights' dtype
    ids = torch.arange(3, 50)
    ours = torch.nn.functional.embedding(ids, embed.weight) * embedding_scale(spec, dtype=torch.bfloat16)
    assert embedding_scale(spec, dtype=torch.bfloat16) != 32 ** 0.5 and torch.equal(ours, embed(ids))


@pytest.mark.parametrize("overrides,message", [
    ({"attention_bias": True}, "field 'attention_bias' is True"),
    ({"attn_logit_softcapping": 50.0}, "field 'attn_logit_softcapping' is 50.0; transformers' Gemma3ForCausalLM does not apply it"),
    ({"use_bidirectional_attention": True}, "field 'use_bidirectional_attention' is True"),
    ({"hidden_activation": "gelu"}, "field 'hidden_activation' is 'gelu'"),
    ({"rope_parameters": {**ROPE, "full_attention": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e6}}},
     "field 'rope_parameters.full_attention.rope_type' is 'yarn'; only 'default' and 'linear'"),
    ({"rope_parameters": {**ROPE, "sliding_attention": {"rope_type": "default", "rope_theta": 1e4,
                                                        "partial_rotary_factor": 0.5}}},
     "field 'rope_parameters.sliding_attention.partial_rotary_factor' is 0.5"),
    ({"layer_types": ["sliding_attention"] * 5}, "field 'layer_types' must list 6 of"),
    ({"sliding_window": None}, "field 'sliding_window' is missing"),
])
def test_what_cannot_be_reproduced_is_one_line(overrides, message):
    with pytest.raises(ConversionError) as error:
        spec_from_hf_config({**_BASE, **overrides}, source="m/config.json")
    text = str(error.value)
    assert "\n" not in text and text.startswith("m/config.json") and message in text, text


# --------------------------------------------------------------------------- conversion
def test_round_trips_torch_dist_and_the_export_generates_like_the_source(hub_dir, tmp_path, capsys):
    """HF -> Megatron -> HF bit for bit at (tp, pp) = (1,1) and (2,2) (tied embeddings: the last
    stage's copy), through torch_dist and resharded from it; the export loads with AutoModelForCausalLM and greedy
    generation (past the window) equals the source's."""
    source = assert_round_trips(hub_dir, tmp_path, ((1, 1, 1), (2, 2, 1)))
    assert "model.layers.0.post_feedforward_layernorm.weight" in source and "lm_head.weight" not in source
    stage1 = load_file(str(tmp_path / "m221" / "tp1_pp1" / "model.safetensors"))
    assert "decoder.layers.0.mlp.post_layernorm.weight" in stage1 and "output_layer.weight" in stage1
    assert_torch_dist_round_trips(hub_dir, tmp_path, source,
                                  write_flags=["--tp", "2", "--pp", "2"],
                                  reshard_flags=["--tp", "1", "--pp", "3"])
    capsys.readouterr()
    assert_export_generates_like(hub_dir, tmp_path / "hf221", prompt=[1, 17, 42, 7, 9, 3], max_new_tokens=10)


def test_verify_tp2_pp2(hub_dir, tmp_path, capsys):
    assert main(["hf-to-mcore", "--hf-dir", str(hub_dir), "--out", str(tmp_path / "m"), "--tp", "2", "--pp", "2"]) == 0
    capsys.readouterr()
    # 24 positions: six windows of the local layers.
    code = verify(["--hf-dir", str(hub_dir), "--mcore-dir", str(tmp_path / "m"), "--atol", "1e-4", "--seq-len", "24"])
    captured = capsys.readouterr()
    assert code == 0, captured.out + captured.err
    assert "argmax agreement 100.00%" in captured.out


# --------------------------------------------------------------------------- DPO parity
def test_parity_one_step_at_three_layouts(tmp_path):
    """One DPO step at (tp, pp, dp) = (2, 2, 1) sequence-parallel with selective recompute,
    (1, 2, 2) padded with full recompute, packed (positions restarting in each sequence) and
    packed with shared prompts (the rejected branch at the chosen one's positions: the window
    goes by positions, not row indices), and (2, 1, 2) without sequence parallelism (the
    post-norms' gradients whole on each tp rank, the q/k norms' summed), one launch: metrics,
    every rank's gradients and the weights after the step against HF + TRL's formulas. In the
    same launch, LoRA at (2, 2, 1) against HF + PEFT (the adapters' tp splits around the q/k norms
    and the sandwich norms)."""
    policy = save_hf(gemma3(seed=1), tmp_path / "policy")
    reference = save_hf(gemma3(seed=2), tmp_path / "reference")
    layouts = ((2, 2, 1), (1, 2, 2), (1, 2, 2), (1, 2, 2), (2, 1, 2))
    jobs = [parity.parity_job(layouts[0], policy, reference, name="gemma3", steps=1, sequence_parallel=True,
                              recompute="selective"),
            parity.parity_job(layouts[1], policy, reference, name="gemma3", steps=1, recompute="full"),
            parity.packed_parity_job(layouts[2], policy, reference, name="gemma3", steps=1),
            parity.packed_parity_job(layouts[3], policy, reference, name="gemma3", steps=1, prefix_sharing=True),
            parity.parity_job(layouts[4], policy, reference, name="gemma3", steps=1)]
    for job in jobs:
        job["config"]["export_hf"] = False
        job["eval_pairs"] = []
    lora_layout = (2, 2, 1, 1)
    lora = lora_job(lora_layout, policy, write_init_adapter(policy, tmp_path / "adapter", seed=5), name="gemma3")
    run_ranks(world_size=4, jobs=jobs + [lora], out_dir=tmp_path / "out")
    check_ran_packed(tmp_path / "out", padded=1, packed=2)
    ref = parity.cached_reference(str(policy), str(reference), "sigmoid", "interleaved", 1)
    for j, (job, layout) in enumerate(zip(jobs, layouts)):
        what = f"gemma3 job {j} at tp{layout[0]} pp{layout[1]} dp{layout[2]}"
        parity.check_tensors(tmp_path / "out", j, job, layout, ref, what, RTOL)  # step-1 grads, weights after it
        ours = json.loads((tmp_path / "out" / f"job{j}_metrics.json").read_text())
        parity.check_metrics(ours[0], ref["metrics"][0], names=parity.METRICS, prefix="", what=f"{what} step 1", rtol=RTOL)
    check_lora_job(tmp_path / "out", len(jobs), lora, lora_layout)
