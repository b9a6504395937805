"""The torch_dist format (checkpoint_convert.torch_dist): layout, args, round trips, equality
with the safetensors format, the CLI, bad input and the restricted unpickler.

Runs against megatron-core itself are in test_torch_dist_megatron.py.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from checkpoint_convert import convert
from checkpoint_convert.dcp import DcpReader
from checkpoint_convert.io import open_hf_dir
from checkpoint_convert.mcore_dir import open_mcore_dir
from checkpoint_convert.families.base import ConversionError
from checkpoint_convert.safe_pickle import RefusedPickle, load_pickle, torch_load, torch_load_file
from tests.helpers.cli import REPO, command_env, run_python
from tests.helpers.models import FAMILY_VARIANTS, llama_gqa_untied, llama3_rope_scaled, qwen2_bias_tied, save_hf
from tests.helpers.ranks import verify

QUIET = {"log": lambda _m: None}

# The fields Megatron-LM's --use-checkpoint-args copies from a checkpoint's args (dense GPT
# models): load_args_from_checkpoint in megatron/training/checkpointing.py, NVIDIA/Megatron-LM
# commit 0032978f335e0b72490147137948f9a45269f9d7 ("Model args", padded_vocab_size,
# ckpt_format and the model-parallel block read with --use-mp-args-from-checkpoint-args).
MEGATRON_LM_CHECKPOINT_ARGS = (
    "num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "num_attention_heads", "num_query_groups",
    "group_query_attention", "kv_channels", "max_position_embeddings", "position_embedding_type",
    "add_position_embedding", "use_rotary_position_embeddings", "rotary_base", "rotary_percent",
    "rotary_interleaved", "add_bias_linear", "add_qkv_bias", "squared_relu", "swiglu",
    "untie_embeddings_and_output_weights", "apply_layernorm_1p", "normalization",
    "apply_query_key_layer_scaling", "attention_dropout", "hidden_dropout", "num_experts", "mtp_num_layers",
    "padded_vocab_size", "ckpt_format", "tensor_model_parallel_size", "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage", "expert_model_parallel_size",
)  # fmt: skip


def _same_hf(a: Path, b: Path) -> None:
    source, back = open_hf_dir(a), open_hf_dir(b)
    assert back.names == source.names
    for name in source.names:
        assert torch.equal(source.get(name), back.get(name)), name


def _common(directory: Path) -> dict:
    return torch_load_file(directory / "release" / "common.pt")


# ---------------------------------------------------------------------------------------
# Layout and args
# ---------------------------------------------------------------------------------------


def test_writes_megatron_lm_layout_with_hf_files(tmp_path, hf_llama):
    out = tmp_path / "td"
    convert.hf_to_mcore(hf_llama, out, tp=2, pp=2, fmt="torch_dist", **QUIET)
    assert (out / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    release = out / "release"
    names = {p.name for p in release.iterdir()}
    assert {"metadata.json", ".metadata", "common.pt", "hf_files"} <= names
    assert {n for n in names if n.endswith(".distcp")} == {f"__{r}_0.distcp" for r in range(4)}
    assert json.loads((release / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    common = _common(out)
    assert common["checkpoint_version"] == 3.0 and common["iteration"] == 0
    assert json.loads((release / "hf_files" / "config.json").read_text()) == json.loads((hf_llama / "config.json").read_text())
    assert (release / "hf_files" / "tokenizer.json").is_file()
    keys = set(DcpReader(release).tensors)
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in keys  # TE norm names, stacked
    assert DcpReader(release).tensors["decoder.layers.mlp.linear_fc1.weight"].shape == (4, 128, 32)


@pytest.mark.parametrize(
    "factory, tp, pp",
    [(llama_gqa_untied, 2, 2), (qwen2_bias_tied, 1, 4), (llama3_rope_scaled, 2, 1)],
    ids=["llama-tp2pp2", "qwen2-tied-pp4", "llama3-rope"],
)
def test_args_carry_what_megatron_lm_reads(tmp_path, factory, tp, pp):
    model = factory()
    config = model.config
    out = tmp_path / "td"
    convert.hf_to_mcore(save_hf(model, tmp_path / "hf"), out, tp=tp, pp=pp, fmt="torch_dist", **QUIET)
    args = _common(out)["args"]
    missing = [name for name in MEGATRON_LM_CHECKPOINT_ARGS if not hasattr(args, name)]
    assert not missing, missing
    heads, groups = config.num_attention_heads, config.num_key_value_heads
    expected = {
        "num_layers": config.num_hidden_layers, "hidden_size": config.hidden_size,
        "ffn_hidden_size": config.intermediate_size, "num_attention_heads": heads, "num_query_groups": groups,
        "group_query_attention": groups != heads, "kv_channels": config.hidden_size // heads,
        "max_position_embeddings": config.max_position_embeddings, "position_embedding_type": "rope",
        "add_position_embedding": False, "normalization": "RMSNorm", "norm_epsilon": config.rms_norm_eps,
        "swiglu": True, "add_bias_linear": False, "add_qkv_bias": factory is qwen2_bias_tied, "qk_layernorm": False,
        "untie_embeddings_and_output_weights": not config.tie_word_embeddings,
        "padded_vocab_size": 128 * tp, "make_vocab_size_divisible_by": 128, "vocab_size": config.vocab_size,
        "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp, "ckpt_format": "torch_dist",
        "num_experts": None, "params_dtype": torch.float32,
    }  # fmt: skip
    assert {k: getattr(args, k) for k in expected} == expected
    rope = config.rope_parameters
    assert args.rotary_base == rope["rope_theta"]
    assert args.use_rope_scaling == (rope.get("rope_type") == "llama3")
    if args.use_rope_scaling:
        assert args.rope_scaling_factor == rope["factor"]


def _moe_args(**overrides):
    """Megatron-LM's args of a small MoE model (what its parser stores for --num-experts etc.)."""
    from argparse import Namespace

    fields = dict(num_layers=4, hidden_size=32, ffn_hidden_size=48, num_attention_heads=4, group_query_attention=True,
                  num_query_groups=2, kv_channels=16, max_position_embeddings=128, normalization="RMSNorm",
                  swiglu=True, add_bias_linear=False, position_embedding_type="rope", untie_embeddings_and_output_weights=True,
                  num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=24, moe_layer_freq=1, moe_router_pre_softmax=False,
                  moe_router_score_function="softmax", moe_router_enable_expert_bias=False, qk_layernorm=False)
    return Namespace(**{**fields, **overrides})


def test_megatron_lm_moe_args_map_to_qwen3_moe_and_mixtral_configs():
    from checkpoint_convert.families import spec_from_hf_config
    from checkpoint_convert.megatron_args import hf_config_from_args

    mixtral = hf_config_from_args(_moe_args(), source="common.pt", padded_vocab_size=128)
    assert mixtral["architectures"] == ["MixtralForCausalLM"]
    assert (mixtral["num_local_experts"], mixtral["num_experts_per_tok"], mixtral["intermediate_size"]) == (8, 2, 24)
    qwen = hf_config_from_args(_moe_args(qk_layernorm=True, moe_layer_freq=[1, 0, 1, 1], moe_router_pre_softmax=True),
                               source="common.pt", padded_vocab_size=128)  # fmt: skip
    assert qwen["architectures"] == ["Qwen3MoeForCausalLM"] and qwen["mlp_only_layers"] == [1]
    assert (qwen["intermediate_size"], qwen["moe_intermediate_size"], qwen["norm_topk_prob"]) == (48, 24, False)
    spec = spec_from_hf_config(qwen, source="x")
    assert spec.moe_layers == (0, 2, 3) and spec.head_dim == 16 and not spec.moe_norm_topk
    # An int --moe-layer-freq N: every Nth layer from layer 0.
    every_other = hf_config_from_args(_moe_args(qk_layernorm=True, moe_layer_freq=2), source="c", padded_vocab_size=128)
    assert every_other["mlp_only_layers"] == [1, 3]


@pytest.mark.parametrize("overrides, message", [
    ({"moe_router_score_function": "sigmoid"}, "field 'args.moe_router_score_function' is 'sigmoid'; only 'softmax'"),
    ({"moe_router_enable_expert_bias": True}, "field 'args.moe_router_enable_expert_bias' is True"),
    ({"moe_shared_expert_intermediate_size": 64}, "field 'args.moe_shared_expert_intermediate_size' is 64"),
    ({"moe_layer_freq": [1, 0, 1, 1]}, "Mixtral (no q/k layernorm) has experts on every layer"),
    ({"moe_router_pre_softmax": True}, "field 'args.moe_router_pre_softmax' is True; Mixtral"),
    ({"moe_layer_freq": [1, 0]}, "field 'args.moe_layer_freq' is [1, 0]; expected an int >= 1 or 4 0/1 values"),
], ids=["sigmoid-router", "expert-bias", "shared-experts", "mixtral-dense-layer", "mixtral-pre-softmax", "freq-length"])
def test_megatron_lm_moe_args_it_cannot_map_are_one_line(overrides, message):
    from checkpoint_convert.megatron_args import hf_config_from_args

    with pytest.raises(ConversionError) as error:
        hf_config_from_args(_moe_args(**overrides), source="ckpt/common.pt", padded_vocab_size=128)
    assert str(error.value).startswith("ckpt/common.pt: ") and message in str(error.value) and "\n" not in str(error.value)


# ---------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", [(1, 1), (2, 2), (1, 4)], ids=lambda t: f"tp{t[0]}pp{t[1]}")
@pytest.mark.parametrize("family", sorted(FAMILY_VARIANTS))
def test_hf_torch_dist_hf_round_trip_is_bit_exact(tmp_path, family, layout):
    hf_dir = save_hf(FAMILY_VARIANTS[family](), tmp_path / "hf")
    convert.hf_to_mcore(hf_dir, tmp_path / "td", tp=layout[0], pp=layout[1], fmt="torch_dist", **QUIET)
    convert.mcore_to_hf_dir(tmp_path / "td", tmp_path / "back", **QUIET)
    _same_hf(hf_dir, tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["architectures"] == json.loads(
        (hf_dir / "config.json").read_text()
    )["architectures"]


@pytest.mark.parametrize("layout", [(1, 1, 1), (2, 2, 1), (2, 1, 2), (1, 2, 4)], ids=lambda t: "tp{}pp{}ep{}".format(*t))
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_hf_torch_dist_hf_round_trip_is_bit_exact(tmp_path, family, layout):
    """Qwen3-MoE with a dense layer among its MoE layers (megatron-core's per-layer keys) and
    Mixtral (tied; every layer MoE: stacked keys [L, E, ...]); the experts' tensors equal the
    HF ones on the global expert axis, and reshard to the safetensors ep layout is identical to
    converting the HF directory there."""
    from tests.helpers.models import mixtral, qwen3_moe

    model = qwen3_moe(seed=3, num_layers=4) if family == "qwen3_moe" else mixtral(seed=3)
    hf_dir = save_hf(model, tmp_path / "hf")
    tp, pp, ep = layout
    convert.hf_to_mcore(hf_dir, tmp_path / "td", tp=tp, pp=pp, ep=ep, fmt="torch_dist", **QUIET)
    convert.mcore_to_hf_dir(tmp_path / "td", tmp_path / "back", **QUIET)
    _same_hf(hf_dir, tmp_path / "back")
    reader, hf = DcpReader(tmp_path / "td" / "release"), open_hf_dir(tmp_path / "back")
    if family == "mixtral":
        fc2 = reader.read("decoder.layers.mlp.experts.experts.linear_fc2.weight")
        assert fc2.shape[:2] == (2, 4) and torch.equal(fc2[1, 3], hf.get("model.layers.1.block_sparse_moe.experts.3.w2.weight"))
    else:
        fc1 = reader.read("decoder.layers.2.mlp.experts.experts.linear_fc1.weight")
        gate, up = hf.get("model.layers.2.mlp.experts.1.gate_proj.weight"), hf.get("model.layers.2.mlp.experts.1.up_proj.weight")
        assert torch.equal(fc1[1], torch.cat([gate, up]))
        assert "decoder.layers.1.mlp.linear_fc1.weight" in reader.tensors
    args = _common(tmp_path / "td")["args"]
    assert (args.num_experts, args.expert_model_parallel_size) == (4, ep)
    assert args.moe_layer_freq == (1 if family == "mixtral" else [1, 0, 1, 1])
    if layout == (2, 1, 2):
        convert.hf_to_mcore(hf_dir, tmp_path / "st", tp=tp, pp=pp, ep=ep, **QUIET)
        convert.reshard(tmp_path / "td", tmp_path / "td_to_st", tp=tp, pp=pp, ep=ep, fmt="safetensors", **QUIET)
        _equal(_shards(tmp_path / "td_to_st"), _shards(tmp_path / "st"))


def _dcp_tensors(directory: Path) -> dict[str, torch.Tensor]:
    reader = DcpReader(directory / "release")
    return {key: reader.read(key) for key in reader.tensors}


def _shards(directory: Path) -> dict[str, torch.Tensor]:
    checkpoint = open_mcore_dir(directory)
    return {
        f"tp{t}pp{p}/{name}": tensor
        for p in range(checkpoint.meta.pp)
        for t in range(checkpoint.meta.tp)
        for name, tensor in checkpoint.shard(t, p).items()
    }


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("factory", [llama_gqa_untied, qwen2_bias_tied], ids=["llama", "qwen2-tied"])
def test_torch_dist_and_safetensors_formats_convert_into_each_other_identically(tmp_path, factory):
    hf_dir = save_hf(factory(), tmp_path / "hf")
    convert.hf_to_mcore(hf_dir, tmp_path / "st", tp=2, pp=2, **QUIET)
    convert.hf_to_mcore(hf_dir, tmp_path / "td", tp=2, pp=2, fmt="torch_dist", **QUIET)
    convert.reshard(tmp_path / "st", tmp_path / "st_to_td", tp=2, pp=2, fmt="torch_dist", **QUIET)
    convert.reshard(tmp_path / "td", tmp_path / "td_to_st", tp=2, pp=2, fmt="safetensors", **QUIET)
    _equal(_dcp_tensors(tmp_path / "st_to_td"), _dcp_tensors(tmp_path / "td"))
    _equal(_shards(tmp_path / "td_to_st"), _shards(tmp_path / "st"))
    # A reshard keeps the input's format unless told otherwise.
    convert.reshard(tmp_path / "td", tmp_path / "td_pp4", tp=1, pp=4, **QUIET)
    assert (tmp_path / "td_pp4" / "latest_checkpointed_iteration.txt").is_file()
    assert _common(tmp_path / "td_pp4")["args"].pipeline_model_parallel_size == 4


def test_reads_other_writers_key_variants(tmp_path, hf_llama):
    """A checkpoint whose model keys carry a wrapper prefix ('module.'), per-layer keys
    (decoder.layers.N....) with local-spec norm names, and optimizer entries beside the model,
    with no HF files: read with --hf-config, it converts back bit-exactly."""
    from checkpoint_convert.dcp import DcpWriter

    td = tmp_path / "td"
    convert.hf_to_mcore(hf_llama, td, tp=2, pp=1, fmt="torch_dist", **QUIET)
    source = DcpReader(td / "release")
    variant = tmp_path / "variant" / "iter_0000007"
    variant.mkdir(parents=True)
    writer = DcpWriter(variant)
    for key, info in source.tensors.items():
        tensor = source.read(key)
        if key.startswith("decoder.layers."):
            suffix = key.removeprefix("decoder.layers.").replace("self_attention.linear_qkv.layer_norm_weight", "input_layernorm.weight")
            for layer in range(info.shape[0]):
                name = f"module.decoder.layers.{layer}.{suffix}"
                writer.declare(name, shape=info.shape[1:], dtype=info.dtype)
                writer.write_chunk(name, tensor[layer], offsets=(0,) * (len(info.shape) - 1), file="__0_0.distcp")
        else:
            writer.declare(f"module.{key}", shape=info.shape, dtype=info.dtype)
            writer.write_chunk(f"module.{key}", tensor, offsets=(0,) * len(info.shape), file="__0_0.distcp")
    writer.declare("optimizer.state.exp_avg.module.decoder.final_layernorm.weight", shape=(32,), dtype=torch.float32)
    writer.write_chunk("optimizer.state.exp_avg.module.decoder.final_layernorm.weight", torch.zeros(32), offsets=(0,), file="__1_0.distcp")
    writer.write_object("rng_state/shard_0.0_1.2", [{"seed": 1}], file="__1_0.distcp")
    writer.finish()
    common = _common(td)
    del common["args"].vocab_size
    torch.save({**common, "iteration": 7}, variant / "common.pt")
    (tmp_path / "variant" / "latest_checkpointed_iteration.txt").write_text("7")
    convert.mcore_to_hf_dir(tmp_path / "variant", tmp_path / "back", hf_config_dir=hf_llama, **QUIET)
    _same_hf(hf_llama, tmp_path / "back")
    # An unmapped model tensor is an error, not silently dropped.
    writer = DcpWriter(variant)
    for key in source.tensors:
        writer.declare(key, shape=source.tensors[key].shape, dtype=source.tensors[key].dtype)
        writer.write_chunk(key, source.read(key), offsets=(0,) * len(source.tensors[key].shape), file="__0_0.distcp")
    writer.declare("decoder.layers.self_attention.q_layernorm.weight", shape=(4, 4), dtype=torch.float32)
    writer.write_chunk("decoder.layers.self_attention.q_layernorm.weight", torch.ones(4, 4), offsets=(0, 0), file="__0_0.distcp")
    writer.finish()
    with pytest.raises(ConversionError, match="q_layernorm.weight' is not part of"):
        open_mcore_dir(tmp_path / "variant", hf_config_dir=hf_llama)


# ---------------------------------------------------------------------------------------
# CLI and bad input
# ---------------------------------------------------------------------------------------


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    """The converter's command line, in this process (exit code, stdout, stderr)."""
    from checkpoint_convert.__main__ import main

    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_cli_writes_reshards_verifies_and_exports_torch_dist(tmp_path, hf_llama, capsys):
    td, td2, back = tmp_path / "td", tmp_path / "td2", tmp_path / "back"
    code, _, err = _cli(capsys, "hf-to-mcore", "--hf-dir", str(hf_llama), "--out", str(td), "--tp", "2", "--pp", "2", "--format", "torch_dist")
    assert code == 0, err
    code, _, err = _cli(capsys, "reshard", "--mcore-dir", str(td), "--out", str(td2), "--tp", "1", "--pp", "4", "--format", "torch_dist")
    assert code == 0, err
    assert _common(td2)["args"].pipeline_model_parallel_size == 4
    code = verify(["--hf-dir", str(hf_llama), "--mcore-dir", str(td2), "--atol", "1e-5"])  # spawns its ranks
    captured = capsys.readouterr()
    out, err = captured.out, captured.err
    assert code == 0, err
    assert "max |dlogit|" in out
    code, _, err = _cli(capsys, "mcore-to-hf", "--mcore-dir", str(td2), "--out", str(back))
    assert code == 0, err
    _same_hf(hf_llama, back)


def _bad(capsys, *argv: str) -> str:
    code, _, err = _cli(capsys, *argv)
    err = err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_truncated_chunk_file_and_bad_tracker_are_one_line_errors(tmp_path, hf_llama, capsys):
    td = tmp_path / "td"
    convert.hf_to_mcore(hf_llama, td, tp=1, pp=1, fmt="torch_dist", **QUIET)
    chunk = td / "release" / "__0_0.distcp"
    chunk.write_bytes(chunk.read_bytes()[:-100])
    err = _bad(capsys, "mcore-to-hf", "--mcore-dir", str(td), "--out", str(tmp_path / "back"))
    assert "__0_0.distcp" in err and "truncated" in err
    assert not (tmp_path / "back").exists()
    (td / "latest_checkpointed_iteration.txt").write_text("latest please")
    err = _bad(capsys, "mcore-to-hf", "--mcore-dir", str(td), "--out", str(tmp_path / "back"))
    assert "latest_checkpointed_iteration.txt" in err


@pytest.mark.parametrize("family, field", [
    ("deepseek_v3", "args.multi_latent_attention"), ("gpt_oss", "args.softmax_type"), ("gemma3", "args.window_size"),
    ("glm4_moe", "args.rotary_percent"),
])
def test_new_families_args_alone_are_one_line_asking_for_the_hf_config(tmp_path, capsys, family, field):
    """The args of a family Megatron-LM's args cannot name (or this package cannot read from
    args) are written, but without hf_files/ a read refuses in one line naming the first such
    field; with --hf-config the same checkpoint converts back bit for bit."""
    from tests.helpers.deepseek import deepseek_v3
    from tests.helpers.gemma import gemma3
    from tests.helpers.glm import glm4_moe
    from tests.helpers.gpt_oss import gpt_oss

    model = {"deepseek_v3": deepseek_v3, "gpt_oss": gpt_oss, "gemma3": gemma3, "glm4_moe": glm4_moe}[family](seed=2)
    hf = save_hf(model, tmp_path / "hf")
    td = tmp_path / "td"
    convert.hf_to_mcore(hf, td, tp=1, pp=1, fmt="torch_dist", **QUIET)
    shutil.rmtree(td / "release" / "hf_files")
    err = _bad(capsys, "mcore-to-hf", "--mcore-dir", str(td), "--out", str(tmp_path / "back"))
    assert f"field '{field}'" in err and ("--hf-config" in err or family == "glm4_moe")
    assert not (tmp_path / "back").exists()
    convert.mcore_to_hf_dir(td, tmp_path / "back", hf_config_dir=hf, **QUIET)
    _same_hf(hf, tmp_path / "back")


# ---------------------------------------------------------------------------------------
# The restricted unpickler
# ---------------------------------------------------------------------------------------


class _RunsCode:
    """Unpickling this would create the marker file through os.system."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_singleton_local_shards_layout_is_one_line(tmp_path, hf_llama, capsys):
    """megatron-core's singleton_local_shards layout splits each fc1 into weight_w / weight_v
    (per-layer keys): not read, and said so in one line."""
    from checkpoint_convert.dcp import DcpWriter

    td = tmp_path / "td"
    convert.hf_to_mcore(hf_llama, td, tp=1, pp=1, fmt="torch_dist", **QUIET)
    source = DcpReader(td / "release")
    variant = tmp_path / "variant" / "release"
    variant.mkdir(parents=True)
    shutil.copy2(td / "release" / "common.pt", variant / "common.pt")
    writer = DcpWriter(variant)
    for key, info in source.tensors.items():
        tensor = source.read(key)
        for layer in range(info.shape[0]) if key.startswith("decoder.layers.") else [None]:
            name = key if layer is None else key.replace("decoder.layers.", f"decoder.layers.{layer}.")
            value = tensor if layer is None else tensor[layer]
            parts = zip(("_w", "_v"), value.chunk(2)) if key.endswith("linear_fc1.weight") else [("", value)]
            for suffix, part in parts:
                writer.declare(name + suffix, shape=part.shape, dtype=part.dtype)
                writer.write_chunk(name + suffix, part, offsets=(0,) * part.dim(), file="__0_0.distcp")
    writer.finish()
    (tmp_path / "variant" / "latest_checkpointed_iteration.txt").write_text("release")
    err = _bad(capsys, "mcore-to-hf", "--mcore-dir", str(tmp_path / "variant"), "--out", str(tmp_path / "back"),
               "--hf-config", str(hf_llama))  # fmt: skip
    assert "singleton_local_shards" in err and not (tmp_path / "back").exists()


def test_code_in_metadata_pickle_is_refused_and_never_runs(tmp_path, hf_llama, capsys):
    td, marker = tmp_path / "td", tmp_path / "PWNED"
    convert.hf_to_mcore(hf_llama, td, tp=1, pp=1, fmt="torch_dist", **QUIET)
    (td / "release" / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))
    err = _bad(capsys, "mcore-to-hf", "--mcore-dir", str(td), "--out", str(tmp_path / "back"))
    assert ".metadata" in err and "'posix.system'" in err and "refusing" in err
    assert not marker.exists()
    assert not (tmp_path / "back").exists()


def test_code_in_common_pt_is_refused_and_never_runs(tmp_path, hf_llama, capsys):
    td, marker = tmp_path / "td", tmp_path / "PWNED"
    convert.hf_to_mcore(hf_llama, td, tp=1, pp=1, fmt="torch_dist", **QUIET)
    common = _common(td)
    common["args"].evil = _RunsCode(marker)
    torch.save(common, td / "release" / "common.pt")
    err = _bad(capsys, "reshard", "--mcore-dir", str(td), "--out", str(tmp_path / "o"), "--tp", "1", "--pp", "1")
    assert "common.pt" in err and "'posix.system'" in err
    assert not marker.exists()


def _resave_in_megatron_core_019_layout(source: Path, out: Path, common: object) -> Path:
    """The tensors of torch_dist checkpoint `source`, saved again by torch.distributed.checkpoint
    itself the way megatron-core 0.19 saves (its serialization.save and torch strategy, 0.19.2):
    no common.pt; the common state is the ShardedObject "common_state" of global shape (1,) at
    offset (0,), i.e. the object `common_state/shard_0_1` holding torch.save([common]); and
    metadata.json names only the sharded backend. No hf_files/: a checkpoint of Megatron-LM's."""
    import torch.distributed.checkpoint as dcp

    reader = DcpReader(source / "release")
    state = {key: reader.read(key) for key in reader.tensors}
    # A non-tensor value is stored as its torch.save bytes (not flattened: kept whole).
    state["common_state/shard_0_1"] = [common]
    iteration = out / "iter_0000100"
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(iteration)), planner=dcp.DefaultSavePlanner(flatten_state_dict=False))
    (iteration / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    (out / "latest_checkpointed_iteration.txt").write_text("100")
    return iteration


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_reads_the_common_state_object_of_megatron_core_019(tmp_path, hf_llama, capsys):
    td = tmp_path / "td"
    convert.hf_to_mcore(hf_llama, td, tp=2, pp=2, fmt="torch_dist", **QUIET)
    common = {**_common(td), "iteration": 100}
    new = tmp_path / "megatron019"
    iteration = _resave_in_megatron_core_019_layout(td, new, common)
    assert not (iteration / "common.pt").exists() and "common_state/shard_0_1" in DcpReader(iteration).objects

    # From the args in the object alone (CLI), as for any Megatron-LM checkpoint without hf_files/:
    # the padded vocabulary rows are zero, the rest is the source model bit for bit.
    back = tmp_path / "back"
    code, _, err = _cli(capsys, "mcore-to-hf", "--mcore-dir", str(new), "--out", str(back))
    assert code == 0, err
    source, exported = open_hf_dir(hf_llama), open_hf_dir(back)
    vocab = json.loads((hf_llama / "config.json").read_text())["vocab_size"]
    for name in source.names:
        got, want = exported.get(name), source.get(name)
        if got.shape != want.shape:
            assert torch.equal(got[:vocab], want) and torch.count_nonzero(got[vocab:]) == 0, name
        else:
            assert torch.equal(got, want), name
    assert open_mcore_dir(new).iteration == 100

    # Code in the object is refused by the restricted unpickler and never runs.
    marker = tmp_path / "PWNED"
    common["args"].evil = _RunsCode(marker)
    evil = tmp_path / "evil"
    _resave_in_megatron_core_019_layout(td, evil, common)
    err = _bad(capsys, "mcore-to-hf", "--mcore-dir", str(evil), "--out", str(tmp_path / "o"))
    assert "common_state/shard_0_1" in err and "'posix.system'" in err and "refusing" in err
    assert not marker.exists() and not (tmp_path / "o").exists()

    # Neither common.pt nor the object: one line that names both.
    (td / "release" / "common.pt").unlink()
    err = _bad(capsys, "mcore-to-hf", "--mcore-dir", str(td), "--out", str(tmp_path / "o"))
    assert "common.pt is missing" in err and "'common_state/shard_0_1'" in err


def test_restricted_unpickler_refuses_code_in_tensor_chunks_and_keeps_data(tmp_path):
    import io

    marker = tmp_path / "PWNED"
    buffer = io.BytesIO()
    torch.save({"tensor": _RunsCode(marker)}, buffer)
    with pytest.raises(RefusedPickle, match=r"^chunk: refusing to unpickle 'posix.system'"):
        torch_load(buffer.getvalue(), source="chunk")
    for payload in (pickle.dumps(eval), pickle.dumps(getattr), pickle.dumps(subprocess.Popen)):
        with pytest.raises(RefusedPickle):
            load_pickle(payload, source="x")
    assert not marker.exists()
    # What the format needs still loads: tensors (a view saves its storage), Namespace, dtypes.
    buffer = io.BytesIO()
    value = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4)[1:]
    from argparse import Namespace

    torch.save({"t": value, "args": Namespace(params_dtype=torch.bfloat16, path=Path("/x"))}, buffer)
    loaded = torch_load(buffer.getvalue(), source="ok")
    assert torch.equal(loaded["t"], value) and loaded["args"].params_dtype == torch.bfloat16
    with pytest.raises(ConversionError, match="not a readable checkpoint pickle"):
        load_pickle(b"\x80\x04garbage", source="bad")


# ---------------------------------------------------------------------------------------
# Streaming: peak memory of a torch_dist round trip, in a fresh process
# ---------------------------------------------------------------------------------------

_MEMORY_SCRIPT = """
import json, sys
def peak_bytes():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
from checkpoint_convert.convert import hf_to_mcore, mcore_to_hf_dir
import checkpoint_convert.torch_dist, torch, torch.distributed.checkpoint  # imports are not conversion memory
torch.zeros(1).sum()
hf, mcore, back = sys.argv[1:4]
baseline = peak_bytes()
hf_to_mcore(hf, mcore, tp=2, pp=2, fmt="torch_dist", log=lambda _m: None)
after_forward = peak_bytes()
mcore_to_hf_dir(mcore, back, log=lambda _m: None)
print(json.dumps({"baseline": baseline, "forward": after_forward, "back": peak_bytes()}))
"""


def test_torch_dist_round_trip_peak_rss_is_a_fraction_of_the_checkpoint(tmp_path):
    from checkpoint_convert.families import spec_from_hf_config
    from checkpoint_convert.mapping import hf_tensor_shapes
    from checkpoint_convert.safetensors_stream import SafetensorsWriter

    # ~200 MB fp32, written tensor by tensor: the vocabulary tensors (33 MB each) and the MLPs dominate.
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512, "num_hidden_layers": 10,
        "num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 1408, "vocab_size": 16000,
        "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "max_position_embeddings": 128, "torch_dtype": "float32",
    }  # fmt: skip
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(config))
    shapes = hf_tensor_shapes(spec_from_hf_config(config))
    gen = torch.Generator().manual_seed(1)
    with SafetensorsWriter(hf_dir / "model.safetensors", tensors=[(n, torch.float32, s) for n, s in shapes.items()]) as writer:
        for name, shape in shapes.items():
            writer.write(name, torch.randn(shape, generator=gen))
    checkpoint_bytes = (hf_dir / "model.safetensors").stat().st_size
    result = run_python(["-c", _MEMORY_SCRIPT, str(hf_dir), str(tmp_path / "td"), str(tmp_path / "back")], env=command_env(PYTHONPATH=str(REPO)),
                        timeout=300, check=True)
    peaks = json.loads(result.stdout.strip().splitlines()[-1])
    # The torch_dist reader holds one chunk's zip archive and the tensor built from it, plus the
    # previous chunk for the next row block: 27.6 % of this 184 MB checkpoint was measured (15.5 %
    # of the 1.12 GB one of docs/BENCHMARKS.md 5b, where the fixed part counts less). safetensors
    # stays under 25 % (tests/test_convert_stream.py).
    assert peaks["back"] - peaks["baseline"] <= 0.33 * checkpoint_bytes, (peaks, checkpoint_bytes)
    _same_hf(hf_dir, tmp_path / "back")
