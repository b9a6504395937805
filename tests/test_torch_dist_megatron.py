"""torch_dist against megatron-core itself, as real gloo ranks.

Consumer side: megatron-core's dist_checkpointing.load reads this package's torch_dist output
into GPTModels built the way Megatron-LM builds them, at a different tp/pp than written, and
their logits equal the HF model's. Producer side: a GPTModel the test fills itself is saved by
dist_checkpointing.save in Megatron-LM's layout at tp2 pp2 (with megatron-core 0.19+ the common
state inside the .distcp files, no common.pt); the converter turns it into an HF directory
bit-exactly, and AutoModelForCausalLM's logits on it match Megatron's; the same for a Qwen3-MoE
saved at ep 2 (experts under megatron-core's global expert axis). The new families (DeepSeek-V3,
GLM-4.5, GPT-OSS): megatron-core builds each from nothing but the args the converter wrote, as
Megatron-LM's core_transformer_config_from_args does, and reads the converter's output. Virtual
pipeline stages: the converter's `--pp 2 --vpp 2` torch_dist is read by megatron-core into its own
model chunks (one GPTModel per vp_stage), whose forward through the virtual stages gives HF's logits.
"""

from __future__ import annotations

import json
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
from packaging.version import Version
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from checkpoint_convert.convert import hf_to_mcore, mcore_to_hf_dir
from checkpoint_convert.dcp import DcpReader
from checkpoint_convert.io import open_hf_dir
from checkpoint_convert.torch_dist import COMMON_OBJECT
from tests.helpers.models import VOCAB_SIZE, hf_state, llama_gqa_untied, qwen2_bias_tied, save_hf
from tests.helpers.megatron_ranks import consumer_rank, megatron_lm_args, producer_rank, spawn
from tests.helpers.reference import assert_close

TOL = 1e-5  # of the largest HF logit: float32 rounding differs between CPUs' kernels


def _tokens(path: Path) -> torch.Tensor:
    tokens = torch.randint(0, VOCAB_SIZE, (2, 12), generator=torch.Generator().manual_seed(0))
    save_file({"tokens": tokens}, str(path))
    return tokens


def _hf_logits(directory: Path, tokens: torch.Tensor) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits


def _assert_logits_are_hf(megatron: torch.Tensor, model, tokens: torch.Tensor) -> None:
    """megatron-core's logits (vocabulary padded) against the HF model's on the same tokens: equal
    within TOL of the largest, and exactly zero on the padded vocabulary rows (their weights are zero)."""
    with torch.no_grad():
        reference = model(input_ids=tokens).logits
    assert megatron.shape[-1] >= VOCAB_SIZE
    assert_close(megatron[..., :VOCAB_SIZE], reference, what="megatron-core's logits against HF's", rtol=TOL)
    assert torch.count_nonzero(megatron[..., VOCAB_SIZE:]) == 0


@pytest.mark.parametrize(
    "factory, written, loaded",
    [(llama_gqa_untied, (2, 2), (1, 2)), (qwen2_bias_tied, (1, 4), (2, 1))],
    ids=["llama-untied-written-tp2pp2-loaded-tp1pp2", "qwen2-tied-written-tp1pp4-loaded-tp2pp1"],
)
def test_megatron_core_loads_our_torch_dist_at_another_layout(tmp_path, factory, written, loaded):
    model = factory()
    hf_dir = save_hf(model, tmp_path / "hf")
    out = tmp_path / "torch_dist"
    hf_to_mcore(hf_dir, out, tp=written[0], pp=written[1], fmt="torch_dist", log=lambda _m: None)
    tokens = _tokens(tmp_path / "tokens.safetensors")
    job = {"checkpoint": str(out / "release"), "tp": loaded[0], "pp": loaded[1],
           "tokens": str(tmp_path / "tokens.safetensors"), "logits": str(tmp_path / "logits.safetensors")}  # fmt: skip
    spawn(consumer_rank, world_size=loaded[0] * loaded[1], job=job)
    _assert_logits_are_hf(load_file(job["logits"])["logits"], model, tokens)


def _mcore_to_hf_cli(save: Path, out: Path) -> None:
    """`checkpoint_convert mcore-to-hf` of a Megatron-LM save directory through its command line,
    in this process (the console entry point's own process: tests/test_convert_cli.py)."""
    from checkpoint_convert.__main__ import main

    assert main(["mcore-to-hf", "--mcore-dir", str(save), "--out", str(out)]) == 0


def _assert_same_weights(converted, original: dict[str, torch.Tensor], *, padded: int) -> None:
    """Every tensor of `original` bit for bit in `converted` (an HF view); the embedding and head
    have their real rows, then zero rows up to the padded vocabulary."""
    for name, tensor in original.items():
        got = converted.get(name)
        if got.shape[0] == padded:
            assert torch.equal(got[:VOCAB_SIZE], tensor) and torch.count_nonzero(got[VOCAB_SIZE:]) == 0, name
        else:
            assert torch.equal(got, tensor), name


def test_megatron_lm_checkpoint_converts_to_hf_bit_exactly(tmp_path):
    model = llama_gqa_untied()
    hf_dir = save_hf(model, tmp_path / "hf")
    config = json.loads((hf_dir / "config.json").read_text())
    tp, pp = 2, 2
    args = megatron_lm_args(config, tp=tp, pp=pp)
    tokens = _tokens(tmp_path / "tokens.safetensors")
    save = tmp_path / "megatron_save"
    job = {"tp": tp, "pp": pp, "args": vars(args), "vocab_size": config["vocab_size"], "save": str(save),
           "hf_weights": str(hf_dir / "model.safetensors"), "tokens": str(tmp_path / "tokens.safetensors"),
           "logits": str(tmp_path / "logits.safetensors")}  # fmt: skip
    spawn(producer_rank, world_size=tp * pp, job=job)
    # The layout of the installed release, both read: up to 0.18 the common state is common.pt;
    # from 0.19 only the object common_state/shard_0_1 in the .distcp files (megatron-core 0.19+
    # is run by scripts/compat_check.sh).
    written = save / "iter_0000100"
    before_019 = Version(version("megatron-core")) < Version("0.19")
    assert (written / "common.pt").is_file() == before_019
    assert (COMMON_OBJECT in DcpReader(written).objects) == (not before_019)
    megatron = load_file(job["logits"])["logits"]
    padded = args.padded_vocab_size
    assert megatron.shape[-1] == padded

    # With the HF config beside it: the exact model back, bit for bit.
    exact = tmp_path / "hf_exact"
    mcore_to_hf_dir(save, exact, hf_config_dir=hf_dir, log=lambda _m: None)
    original, converted = hf_state(model), open_hf_dir(exact)
    assert sorted(converted.names) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(converted.get(name), tensor), name
    assert_close(megatron[..., :VOCAB_SIZE], _hf_logits(exact, tokens), what="megatron-core's logits against HF's", rtol=TOL)

    # From Megatron's args alone (CLI): Megatron-LM records no unpadded vocabulary, so the HF
    # model keeps the padded one, exactly as Megatron trained it.
    from_args = tmp_path / "hf_from_args"
    _mcore_to_hf_cli(save, from_args)
    exported = json.loads((from_args / "config.json").read_text())
    assert exported["architectures"] == ["LlamaForCausalLM"] and exported["vocab_size"] == padded
    converted = open_hf_dir(from_args)
    _assert_same_weights(converted, original, padded=padded)
    assert_close(megatron, _hf_logits(from_args, tokens), what="megatron-core's logits against HF's", rtol=TOL)


def test_megatron_lm_moe_checkpoint_at_ep2_converts_to_hf_bit_exactly(tmp_path):
    """A Qwen3-MoE GPTModel (sequential experts, a dense layer between MoE layers) saved by
    megatron-core at (tp, pp, dp, ep) = (1, 2, 2, 2): experts under megatron-core's sharded keys
    with the global expert axis, per-layer keys (a list --moe-layer-freq makes the layers
    non-homogeneous). The CLI converts it from Megatron's args alone, bit-exactly."""
    from tests.helpers.models import save_tokenizer
    from tests.helpers.models import qwen3_moe
    from tests.helpers.megatron_ranks import megatron_lm_moe_args

    model = qwen3_moe(seed=5, num_layers=4)  # layers 0, 2, 3 MoE, layer 1 dense
    hub = tmp_path / "hub"
    model.save_pretrained(str(hub))  # the hub form: one tensor per expert and projection
    save_tokenizer(hub)
    config = json.loads((hub / "config.json").read_text())
    tp, pp, ep, dp = 1, 2, 2, 2
    args = megatron_lm_moe_args(config, tp=tp, pp=pp, ep=ep)
    tokens = _tokens(tmp_path / "tokens.safetensors")
    save = tmp_path / "megatron_save"
    job = {"tp": tp, "pp": pp, "ep": ep, "args": vars(args), "vocab_size": config["vocab_size"], "save": str(save),
           "hf_weights": str(hub / "model.safetensors"), "tokens": str(tmp_path / "tokens.safetensors"),
           "logits": str(tmp_path / "logits.safetensors")}  # fmt: skip
    spawn(producer_rank, world_size=tp * pp * dp, job=job)
    megatron = load_file(job["logits"])["logits"]
    padded = args.padded_vocab_size

    # megatron-core's layout, as saved: experts stacked on a global expert axis, fc1 [gate; up]
    # per expert, the MoE layer's pre-MLP norm under the local spec's fused name.
    stored = DcpReader(save / "iter_0000100").tensors
    experts = "decoder.layers.{}.mlp.experts.experts.linear_fc{}.weight"
    assert stored[experts.format(0, 1)].shape == (4, 2 * 24, 32) and stored[experts.format(3, 2)].shape == (4, 32, 24)
    assert stored["decoder.layers.2.mlp.router.weight"].shape == (4, 32)
    assert "decoder.layers.2.mlp.linear_fc1.layer_norm_weight" in stored and "decoder.layers.1.mlp.linear_fc1.weight" in stored
    assert not any(key.startswith("decoder.layers.mlp") for key in stored) and experts.format(1, 1) not in stored
    # The package's writer stores the same keys and shapes, plus the Transformer Engine spec's
    # name of each MoE layer's pre-MLP norm.
    hf_to_mcore(hub, tmp_path / "ours", tp=tp, pp=pp, ep=ep, fmt="torch_dist", log=lambda _m: None)
    ours = DcpReader(tmp_path / "ours" / "release")
    te_norms = {f"decoder.layers.{layer}.pre_mlp_layernorm.weight" for layer in (0, 2, 3)}
    assert set(ours.tensors) == set(stored) | te_norms
    assert all(ours.tensors[key].shape == info.shape for key, info in stored.items())
    assert set(ours.objects) == {key for key in DcpReader(save / "iter_0000100").objects if not key.startswith("rng_state")}

    from_args = tmp_path / "hf_from_args"
    _mcore_to_hf_cli(save, from_args)
    exported = json.loads((from_args / "config.json").read_text())
    assert exported["architectures"] == ["Qwen3MoeForCausalLM"] and exported["mlp_only_layers"] == [1]
    assert exported["num_experts"] == 4 and exported["moe_intermediate_size"] == 24 and exported["head_dim"] == 16
    original, converted = load_file(str(hub / "model.safetensors")), open_hf_dir(from_args)
    assert sorted(converted.names) == sorted(original)
    _assert_same_weights(converted, original, padded=padded)
    assert_close(megatron, _hf_logits(from_args, tokens), what="megatron-core's logits against HF's", rtol=TOL)


def test_megatron_core_loads_our_moe_torch_dist_at_another_ep(tmp_path):
    """The package's torch_dist of a Qwen3-MoE (every layer MoE, so megatron-core's stacked
    layout; top-k of the softmax, not renormalised), written at (tp, pp, ep) = (2, 2, 1), experts
    split over tp: megatron-core's dist_checkpointing.load reads it into a GPTModel at
    (tp, pp, dp, ep) = (1, 2, 2, 2), and its logits equal the HF model's."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tests.helpers.models import MOE_COMMON, small_init

    config = Qwen3MoeConfig(**MOE_COMMON, intermediate_size=48, moe_intermediate_size=24, head_dim=16, num_experts=4,
                            num_experts_per_tok=2, norm_topk_prob=False, tie_word_embeddings=False)
    model = small_init(Qwen3MoeForCausalLM(config), 6).float().eval()
    hf_dir = save_hf(model, tmp_path / "hf")
    out = tmp_path / "torch_dist"
    hf_to_mcore(hf_dir, out, tp=2, pp=2, ep=1, fmt="torch_dist", log=lambda _m: None)
    assert DcpReader(out / "release").tensors["decoder.layers.mlp.experts.experts.linear_fc1.weight"].shape == (2, 4, 48, 32)
    tokens = _tokens(tmp_path / "tokens.safetensors")
    job = {"checkpoint": str(out / "release"), "tp": 1, "pp": 2, "ep": 2,
           "tokens": str(tmp_path / "tokens.safetensors"), "logits": str(tmp_path / "logits.safetensors")}  # fmt: skip
    spawn(consumer_rank, world_size=4, job=job)
    _assert_logits_are_hf(load_file(job["logits"])["logits"], model, tokens)


def _megatron_logits_of_our_torch_dist(tmp_path: Path, model, *, written: dict, loaded: dict) -> torch.Tensor:
    """Write `model`'s torch_dist with the converter at `written` (tp, pp, ep), load it with
    megatron-core's dist_checkpointing into a GPTModel built from the checkpoint's own args at
    `loaded`, and return its logits on fixed tokens (strict load: no key missing or unexpected)."""
    hf_dir = save_hf(model, tmp_path / "hf")
    out = tmp_path / "torch_dist"
    hf_to_mcore(hf_dir, out, **written, fmt="torch_dist", log=lambda _m: None)
    _tokens(tmp_path / "tokens.safetensors")
    job = {"checkpoint": str(out / "release"), **loaded,
           "tokens": str(tmp_path / "tokens.safetensors"), "logits": str(tmp_path / "logits.safetensors")}  # fmt: skip
    world = loaded["tp"] * loaded["pp"] * loaded.get("dp", 1)
    spawn(consumer_rank, world_size=world, job=job)
    return load_file(job["logits"])["logits"]


@pytest.mark.parametrize("family, loaded", [
    ("deepseek_v3", {"tp": 2, "pp": 1, "ep": 1}), ("deepseek_v3", {"tp": 1, "pp": 1, "ep": 2, "dp": 2}),
    ("glm4_moe", {"tp": 2, "pp": 1, "ep": 1}), ("glm4_moe", {"tp": 1, "pp": 1, "ep": 2, "dp": 2}),
    ("gpt_oss", {"tp": 2, "pp": 1, "ep": 1, "etp": 1}), ("gpt_oss", {"tp": 1, "pp": 1, "ep": 2, "dp": 2}),
], ids=["deepseek_v3-tp2", "deepseek_v3-ep2", "glm4_moe-tp2", "glm4_moe-ep2", "gpt_oss-tp2", "gpt_oss-ep2"])
def test_megatron_core_builds_the_new_families_from_our_args_and_loads_them(tmp_path, family, loaded):
    """DeepSeek-V3 (multi-latent attention with YaRN, a dense first layer, sigmoid routing with
    expert bias, groups, scale and a shared expert) and GLM-4.5 (partial RoPE, qkv biases, q/k
    norms, the same MoE block): the converter's torch_dist, written at one layout, is read by
    megatron-core into a GPTModel that a Megatron-LM-style builder makes from nothing but the
    checkpoint's args, at tp 2 and at ep 2, and its logits equal HF's. GPT-OSS
    (sinks, biases, the clamped quick GELU with its offset, YaRN as GPTModel's position embedding)
    with full attention in every layer: megatron-core's local attention builds its sliding-window
    mask on a CUDA device. Its experts stay whole at tp 2 (expert tp 1): megatron-core 0.16.1 adds
    the expert output bias once per expert-tp rank."""
    from tests.helpers.deepseek import deepseek_v3
    from tests.helpers.glm import glm4_moe
    from tests.helpers.gpt_oss import gpt_oss

    model = {"deepseek_v3": lambda: deepseek_v3(seed=3), "glm4_moe": lambda: glm4_moe(seed=3),
             "gpt_oss": lambda: gpt_oss(seed=3, layer_types=["full_attention"] * 4)}[family]()
    megatron = _megatron_logits_of_our_torch_dist(tmp_path, model, written={"tp": 1, "pp": 1, "ep": 1}, loaded=loaded)
    _assert_logits_are_hf(megatron, model, load_file(str(tmp_path / "tokens.safetensors"))["tokens"])


def test_megatron_core_loads_our_vpp_torch_dist_into_its_own_model_chunks(tmp_path):
    """`hf-to-mcore --format torch_dist --pp 2 --vpp 2` of a 4-layer Qwen2 (one layer per virtual
    stage; qkv biases; tied embeddings, so the output layer of the last chunk of stage 1 reads the
    embedding's key, stored once by chunk 0 of stage 0): the args say
    virtual_pipeline_model_parallel_size 2 as Megatron-LM's do, and megatron-core's
    dist_checkpointing.load reads it at pp 2 x vpp 2 into GPTModels built per model chunk
    (vp_stage c, `model{c}` as Megatron-LM keys them); the forward through the four virtual
    stages in order gives HF's logits. mcore-to-hf of it gives the HF tensors bit for bit."""
    from checkpoint_convert.__main__ import main
    from checkpoint_convert.torch_dist import read_common_state
    from tests.helpers.megatron_ranks import vpp_consumer_rank

    model = qwen2_bias_tied()
    hf_dir = save_hf(model, tmp_path / "hf")
    out = tmp_path / "torch_dist"
    assert main(["hf-to-mcore", "--hf-dir", str(hf_dir), "--out", str(out), "--pp", "2", "--vpp", "2",
                 "--format", "torch_dist"]) == 0
    args, _ = read_common_state(out / "release", DcpReader(out / "release"))
    args = args["args"]
    assert (args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size,
            args.num_virtual_stages_per_pipeline_rank, args.num_layers_per_virtual_pipeline_stage) == (2, 2, 2, None)
    tokens = _tokens(tmp_path / "tokens.safetensors")
    job = {"checkpoint": str(out / "release"), "pp": 2, "vpp": 2,
           "tokens": str(tmp_path / "tokens.safetensors"), "logits": str(tmp_path / "logits.safetensors")}  # fmt: skip
    spawn(vpp_consumer_rank, world_size=2, job=job)
    _assert_logits_are_hf(load_file(job["logits"])["logits"], model, tokens)

    mcore_to_hf_dir(out, tmp_path / "back", log=lambda _m: None)
    converted = open_hf_dir(tmp_path / "back")
    for name, tensor in hf_state(model).items():
        assert torch.equal(converted.get(name), tensor), name
