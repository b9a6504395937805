"""checkpoint_convert CLI on real files: hf-to-mcore, reshard, mcore-to-hf, bad input, atomic output;
--vpp (the layout of a training run's model chunks) through the command line in its own process."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoint_convert.__main__ import main
from checkpoint_convert.io import open_hf_dir
from checkpoint_convert.mcore_dir import open_mcore_dir
from tests.helpers.cli import run_python
from tests.helpers.models import llama_gqa_untied, qwen2_bias_tied, save_hf



def _tree_digest(directory: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(directory.rglob("*")):
        digest.update(str(path.relative_to(directory)).encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


def _run(argv: list[str], capsys) -> tuple[int, str]:
    code = main(argv)
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    """Qwen2 (qkv bias, tied) written as three safetensors shards with an index."""
    return save_hf(qwen2_bias_tied(), tmp_path_factory.mktemp("qwen") / "hf", num_shards=3)


@pytest.fixture(scope="module")
def llama_model():
    return llama_gqa_untied()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, llama_model) -> Path:
    return save_hf(llama_model, tmp_path_factory.mktemp("llama") / "hf")


def _load_hf_dir_tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in directory.glob("*.safetensors"):
        tensors.update(load_file(str(file)))
    return tensors


def test_reshard_tp2pp2_to_tp1pp4_to_hf_is_identical(qwen_dir, tmp_path, capsys):
    before = _tree_digest(qwen_dir)
    assert _run(["hf-to-mcore", "--hf-dir", str(qwen_dir), "--out", str(tmp_path / "m22"), "--tp", "2", "--pp", "2"], capsys)[0] == 0
    assert _run(["reshard", "--mcore-dir", str(tmp_path / "m22"), "--out", str(tmp_path / "m14"), "--tp", "1", "--pp", "4"], capsys)[0] == 0
    assert _run(["mcore-to-hf", "--mcore-dir", str(tmp_path / "m14"), "--out", str(tmp_path / "hf"), "--max-shard-size", "30KB"], capsys)[0] == 0
    assert _tree_digest(qwen_dir) == before  # the input is never touched
    meta = open_mcore_dir(tmp_path / "m14").meta
    assert (meta.tp, meta.pp, meta.dtype) == (1, 4, "float32")
    source = _load_hf_dir_tensors(qwen_dir)
    exported = _load_hf_dir_tensors(tmp_path / "hf")
    assert set(exported) == set(source)
    for name, tensor in source.items():
        assert torch.equal(exported[name], tensor), name
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # --max-shard-size split the export
    assert set(index["weight_map"]) == set(source)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "hf" / name).read_bytes() == (qwen_dir / name).read_bytes()
    # The meta keeps the source config, so the exported config describes the same model.
    assert open_hf_dir(tmp_path / "hf").spec == open_hf_dir(qwen_dir).spec


def test_exported_model_loads_and_generates_like_the_original(llama_model, llama_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    assert _run(["hf-to-mcore", "--hf-dir", str(llama_dir), "--out", str(tmp_path / "m"), "--tp", "4", "--pp", "2"], capsys)[0] == 0
    assert _run(["mcore-to-hf", "--mcore-dir", str(tmp_path / "m"), "--out", str(tmp_path / "hf")], capsys)[0] == 0
    exported, info = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    prompt = torch.tensor([[1, 17, 42, 7, 99, 3]])
    settings = dict(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    original_ids = llama_model.generate(prompt, **settings)
    exported_ids = exported.eval().generate(prompt, **settings)
    assert original_ids.shape[1] == prompt.shape[1] + 12
    assert torch.equal(exported_ids, original_ids)


def test_dtype_flag_casts_and_default_keeps_source_dtype(llama_model, tmp_path, capsys):
    bf16_dir = save_hf(llama_model, tmp_path / "bf16", dtype=torch.bfloat16)
    assert _run(["hf-to-mcore", "--hf-dir", str(bf16_dir), "--out", str(tmp_path / "keep"), "--tp", "2"], capsys)[0] == 0
    assert open_mcore_dir(tmp_path / "keep").meta.dtype == "bfloat16"
    assert load_file(str(tmp_path / "keep" / "tp0_pp0" / "model.safetensors"))["output_layer.weight"].dtype == torch.bfloat16
    assert _run(["hf-to-mcore", "--hf-dir", str(bf16_dir), "--out", str(tmp_path / "fp32"), "--dtype", "fp32"], capsys)[0] == 0
    assert _run(["mcore-to-hf", "--mcore-dir", str(tmp_path / "fp32"), "--out", str(tmp_path / "hf")], capsys)[0] == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "float32"
    exported = _load_hf_dir_tensors(tmp_path / "hf")
    for name, tensor in load_file(str(bf16_dir / "model.safetensors")).items():
        assert exported[name].dtype == torch.float32
        assert torch.equal(exported[name], tensor.float()), name


def _rewrite(path: Path, change) -> None:
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _bad_missing(d: Path) -> str:
    _rewrite(d / "model.safetensors", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    return "model.layers.1.mlp.up_proj.weight"


def _bad_extra(d: Path) -> str:
    _rewrite(d / "model.safetensors", lambda t: t.update({"model.layers.9.extra.weight": torch.zeros(2)}))
    return "model.layers.9.extra.weight"


def _bad_shape(d: Path) -> str:
    _rewrite(d / "model.safetensors", lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(8, 32)}))
    return "model.layers.0.self_attn.k_proj.weight"


def _bad_architecture(d: Path) -> str:
    config = json.loads((d / "config.json").read_text())
    config["architectures"] = ["GPTNeoXForCausalLM"]
    (d / "config.json").write_text(json.dumps(config))
    return "architectures"


def _bad_truncated(d: Path) -> str:
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) - 1000])
    return "model.safetensors"


def _bad_missing_shard(d: Path) -> str:
    (d / "model-00002-of-00002.safetensors").unlink()
    return "model-00002-of-00002.safetensors"


@pytest.mark.parametrize(
    "breaker,tp,pp,num_shards",
    [
        (_bad_missing, 1, 1, 1),
        (_bad_extra, 1, 1, 1),
        (_bad_shape, 1, 1, 1),
        (_bad_architecture, 1, 1, 1),
        (_bad_truncated, 1, 1, 1),
        (_bad_missing_shard, 1, 1, 2),
        (None, 3, 1, 1),  # tp does not divide the 8 heads
        (None, 8, 1, 1),  # tp divides the 8 heads but not the 4 query groups
        (None, 1, 5, 1),  # pp larger than the 4 layers
    ],
)
def test_bad_input_one_line_exit_2_no_output(llama_model, tmp_path, capsys, breaker, tp, pp, num_shards):
    source = save_hf(llama_model, tmp_path / "hf", num_shards=num_shards)
    expected = breaker(source) if breaker else {3: "num_attention_heads", 8: "num_key_value_heads"}.get(tp, "num_hidden_layers")
    before = _tree_digest(source)
    out = tmp_path / "out"
    code, err = _run(["hf-to-mcore", "--hf-dir", str(source), "--out", str(out), "--tp", str(tp), "--pp", str(pp)], capsys)
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert expected in err
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary directory left behind
    assert _tree_digest(source) == before


def test_intermediate_size_not_divisible_by_tp(llama_model, tmp_path, capsys):
    source = save_hf(llama_model, tmp_path / "hf")
    config = json.loads((source / "config.json").read_text())
    config.update(num_attention_heads=4, num_key_value_heads=4, head_dim=8, intermediate_size=66)
    (source / "config.json").write_text(json.dumps(config))
    code, err = _run(["hf-to-mcore", "--hf-dir", str(source), "--out", str(tmp_path / "o"), "--tp", "4"], capsys)
    assert code == 2 and "intermediate_size" in err and len(err.strip().splitlines()) == 1


def test_bad_megatron_shard_names_file_and_tensor(llama_dir, tmp_path, capsys):
    mcore = tmp_path / "m"
    assert _run(["hf-to-mcore", "--hf-dir", str(llama_dir), "--out", str(mcore), "--tp", "2", "--pp", "2"], capsys)[0] == 0
    _rewrite(mcore / "tp1_pp1" / "model.safetensors", lambda t: t.pop("decoder.layers.1.mlp.linear_fc2.weight"))
    code, err = _run(["mcore-to-hf", "--mcore-dir", str(mcore), "--out", str(tmp_path / "hf")], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "tp1_pp1/model.safetensors" in err and "decoder.layers.1.mlp.linear_fc2.weight" in err
    assert not (tmp_path / "hf").exists()


def test_non_empty_target_needs_overwrite(llama_dir, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    code, err = _run(["hf-to-mcore", "--hf-dir", str(llama_dir), "--out", str(out)], capsys)
    assert code == 2 and "--overwrite" in err
    assert (out / "keep.txt").read_text() == "user data"
    assert _run(["hf-to-mcore", "--hf-dir", str(llama_dir), "--out", str(out), "--overwrite"], capsys)[0] == 0
    assert not (out / "keep.txt").exists() and (out / "tp0_pp0" / "model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_interrupt_leaves_no_partial_output(llama_dir, tmp_path, capsys, monkeypatch):
    from checkpoint_convert.safetensors_stream import SafetensorsWriter

    written = []
    real_write = SafetensorsWriter.write

    def write_then_interrupt(self, name, tensor):
        written.append(name)
        if len(written) == 5:
            raise KeyboardInterrupt
        real_write(self, name, tensor)

    monkeypatch.setattr(SafetensorsWriter, "write", write_then_interrupt)
    code, err = _run(["hf-to-mcore", "--hf-dir", str(llama_dir), "--out", str(tmp_path / "out"), "--tp", "2", "--pp", "2"], capsys)
    assert code == 130 and len(written) == 5
    assert list(tmp_path.iterdir()) == []


def test_console_entry_point_exits_2_with_one_line(tmp_path):
    result = run_python(["-m", "checkpoint_convert", "mcore-to-hf", "--mcore-dir", str(tmp_path / "nope"), "--out",
                         str(tmp_path / "o")], timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "nope" in result.stderr
    assert not (tmp_path / "o").exists()


def _help(capsys, command: str) -> str:
    """`checkpoint_convert COMMAND --help` through the real parser (in this process; the console
    entry point's own process: test_console_entry_point_exits_2_with_one_line), one line."""
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines


def _subcommand_parsers() -> dict:
    from checkpoint_convert.__main__ import _parser

    (sub,) = [a for a in _parser()._actions if a.dest == "command"]
    return sub.choices


@pytest.mark.parametrize("command", ["hf-to-mcore", "mcore-to-hf", "reshard", "verify"])
def test_help_explains_every_option_and_shows_its_default(command, capsys):
    text = _help(capsys, command)
    for action in _subcommand_parsers()[command]._actions:
        if not action.option_strings or action.option_strings == ["-h", "--help"]:
            continue
        flag = action.option_strings[0]
        assert action.help and len(action.help) > 10, f"{command} {flag} has no help text"
        shown = text[text.index(flag + " ", text.index("options:")):]
        if action.required:
            assert "(required)" in shown.split(" --")[0], (flag, shown[:200])
        elif action.default is not None and action.default is not False:
            assert f"(default: {action.default})" in shown.split(" --")[0], (flag, shown[:200])
        else:  # no value to show: the help says in words what happens without the option
            assert "(default: " in action.help, (flag, action.help)


def test_help_names_the_options_the_issue_found_bare(capsys):
    text = _help(capsys, "hf-to-mcore")
    assert "--hf-dir DIR local Hugging Face model directory to read" in text
    assert "--out DIR Megatron checkpoint directory to write (required)" in text
    assert "--tp TP tensor-parallel ranks to shard the weights over (default: 1)" in text
    assert "--pp PP pipeline stages to split the layers over (default: 1)" in text
    # train's dtype names, and the converter's older ones still accepted
    assert "--dtype {float32,bfloat16,float16}" in text and "(or fp32, bf16, fp16)" in text


def test_dtype_takes_train_names_and_short_names(llama_model, tmp_path, capsys):
    fp32_dir = save_hf(llama_model, tmp_path / "fp32")
    for flag, name, dtype in (("float16", "float16", torch.float16), ("bf16", "bfloat16", torch.bfloat16),
                              ("bfloat16", "bfloat16", torch.bfloat16)):
        out = tmp_path / f"m_{flag}"
        assert _run(["hf-to-mcore", "--hf-dir", str(fp32_dir), "--out", str(out), "--dtype", flag], capsys)[0] == 0
        assert open_mcore_dir(out).meta.dtype == name  # one internal name, whichever spelling came in
        assert load_file(str(out / "tp0_pp0" / "model.safetensors"))["output_layer.weight"].dtype == dtype
    with pytest.raises(SystemExit) as caught:
        main(["hf-to-mcore", "--hf-dir", str(fp32_dir), "--out", str(tmp_path / "bad"), "--dtype", "int8"])
    assert caught.value.code == 2
    assert "invalid choice: 'int8'" in capsys.readouterr().err and not (tmp_path / "bad").exists()


def test_a_hub_name_as_hf_dir_says_to_download_a_local_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # a relative name that is not a directory here
    code, err = _run(["hf-to-mcore", "--hf-dir", "Qwen/Qwen2.5-0.5B", "--out", "m"], capsys)
    assert code == 2
    assert err.strip() == (
        "error: Qwen/Qwen2.5-0.5B: does not exist; a local model directory is needed, not a hub name (nothing is "
        "downloaded): get one with huggingface-cli download Qwen/Qwen2.5-0.5B --local-dir Qwen2.5-0.5B, and pass "
        "that directory")
    assert not (tmp_path / "m").exists()


def test_a_missing_local_hf_dir_gets_no_hub_hint(tmp_path, capsys):
    code, err = _run(["verify", "--hf-dir", str(tmp_path / "nope"), "--mcore-dir", str(tmp_path / "m")], capsys)
    assert code == 2 and err.strip() == f"error: {tmp_path / 'nope'}: does not exist"


def _convert_cli(*argv) -> "subprocess.CompletedProcess":
    """`python -m checkpoint_convert ARGV` in its own process."""
    return run_python(["-m", "checkpoint_convert", *map(str, argv)], timeout=300)


def _rank_files(directory: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {str(p.relative_to(directory)): load_file(str(p)) for p in sorted(directory.glob("tp*_pp*/*.safetensors"))}


def test_vpp_checkpoints_through_the_command_line(llama_dir, tmp_path):
    """hf-to-mcore --tp 1 --pp 2 --vpp 2 writes what a `train --pp 2 --vpp 2` run writes and reads
    (model/chunks.py: chunk c of stage s as the file of stage 2c + s of a plain 4-stage directory,
    its meta naming the layout); mcore-to-hf gives the HF tensors back bit for bit; reshard to
    --pp 2 --vpp 1 and back to --vpp 2 loses nothing."""
    from types import SimpleNamespace

    from checkpoint_convert.mapping import hf_to_mcore_shard
    from mcore_dpo.model.chunks import rank_shard, stage_files

    vpp2, vpp1, back, hf = (tmp_path / name for name in ("vpp2", "vpp1", "back", "hf"))
    said = []
    for argv in (["hf-to-mcore", "--hf-dir", llama_dir, "--out", vpp2, "--tp", 1, "--pp", 2, "--vpp", 2],
                 ["mcore-to-hf", "--mcore-dir", vpp2, "--out", hf],
                 ["reshard", "--mcore-dir", vpp2, "--out", vpp1, "--tp", 1, "--pp", 2],
                 ["reshard", "--mcore-dir", vpp1, "--out", back, "--tp", 1, "--pp", 2, "--vpp", 2]):
        result = _convert_cli(*argv)
        assert result.returncode == 0, (argv, result.stderr[-2000:])
        said.append(result.stdout.strip().splitlines()[-1])
    assert "(safetensors, tp=1 pp=2 vpp=2 ep=1 dtype=float32)" in said[0]
    assert "(tp=1 pp=2 vpp=2 (4 stage files) ep=1)" in said[1] and "(tp=1 pp=2 vpp=2 (4 stage files) ep=1)" in said[2]
    assert said[3].endswith("(safetensors, tp=1 pp=2 vpp=2 ep=1)")
    meta = json.loads((vpp2 / "mcore_checkpoint.json").read_text())
    assert (meta["pp"], meta["virtual_pipeline"]) == (4, {"pp": 2, "vpp": 2})
    assert (open_mcore_dir(vpp2).meta.vpp, open_mcore_dir(vpp1).meta.vpp) == (2, 1)
    assert "virtual_pipeline" not in json.loads((vpp1 / "mcore_checkpoint.json").read_text())

    # The trainer's own split of its ranks' chunks into files (model/chunks.py) gives these files.
    source = open_hf_dir(llama_dir)
    layout = SimpleNamespace(pp=2, vpp=2)
    written = _rank_files(vpp2)
    assert sorted(written) == [f"tp0_pp{stage}/model.safetensors" for stage in range(4)]
    for pp_rank in range(2):
        tensors = rank_shard(lambda pp, rank: hf_to_mcore_shard(source.spec, tp=1, tp_rank=0, pp=pp, pp_rank=rank,
                                                                get=source.get),
                             layout=layout, pp_rank=pp_rank)
        for stage, shard in stage_files(tensors, layout=layout, pp_rank=pp_rank):
            stored = written[f"tp0_pp{stage}/model.safetensors"]
            assert sorted(stored) == sorted(shard), stage
            assert all(torch.equal(stored[name], tensor) for name, tensor in shard.items()), stage

    original = _load_hf_dir_tensors(llama_dir)
    exported = _load_hf_dir_tensors(hf)
    assert set(exported) == set(original)
    assert all(torch.equal(exported[name], tensor) for name, tensor in original.items())
    plain = open_mcore_dir(vpp1).hf_view()
    assert all(torch.equal(plain.get(name), tensor) for name, tensor in original.items())
    again = _rank_files(back)
    assert sorted(again) == sorted(written)
    for rel, tensors in written.items():
        assert sorted(again[rel]) == sorted(tensors) and all(torch.equal(again[rel][n], t) for n, t in tensors.items())

    # A layout field that does not multiply out to the stage files is refused in one line.
    meta["virtual_pipeline"] = {"pp": 3, "vpp": 2}
    (back / "mcore_checkpoint.json").write_text(json.dumps(meta))
    result = _convert_cli("mcore-to-hf", "--mcore-dir", back, "--out", tmp_path / "refused")
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0, result.stderr
    assert "field 'virtual_pipeline'" in result.stderr and not (tmp_path / "refused").exists()


@pytest.mark.parametrize("argv, expected", [
    (["hf-to-mcore", "--pp", "1", "--vpp", "2"], "--vpp 2 needs pipeline parallelism (pp >= 2), got pp 1"),
    (["hf-to-mcore", "--pp", "2", "--vpp", "3", "--format", "torch_dist"],
     "--vpp 3: the layer count (4) must be a multiple of pp x vpp (2 x 3 = 6)"),
], ids=["pp1", "layers-not-divisible"])
def test_vpp_refusals_are_one_line(llama_dir, tmp_path, argv, expected):
    result = _convert_cli(*argv, "--hf-dir", llama_dir, "--out", tmp_path / "out")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().count("\n") == 0 and expected in result.stderr, result.stderr
    assert list(tmp_path.iterdir()) == []
