"""The train CLI: bad input fails fast with one line, and the embedded default run learns.

The default run is the product's own path end to end: driver -> Ray actor -> megatron-core
engine -> metrics.jsonl / TensorBoard / hf/ export, on the tiny default model and data.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from mcore_dpo.command_line import bool_flags, resolve
from mcore_dpo.config import ConfigError, TrainConfig
from mcore_dpo.train import main
from mcore_dpo.driver import output_dir
from tests.helpers.cli import command_env, run_train
from tests.helpers.models import save_hf
from tests.helpers.ray_runs import main_in_process


@pytest.fixture(scope="module")
def good_data(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "prefs.jsonl"
    # Completions start with a space: prompt + completion is tokenized as one string.
    rows = [{"prompt": f"w{i} w{i + 1}", "chosen": f" w{i + 2}", "rejected": f" w{i + 3}"} for i in range(3, 40)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _run_bad(capsys, argv: list[str]) -> str:
    import ray

    code = main(argv)
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in err
    assert not ray.is_initialized(), "a worker group was started before the input was checked"
    return err


def test_heads_not_divisible_by_tp(capsys, hf_llama, good_data, tmp_path):
    err = _run_bad(capsys, ["--model", str(hf_llama), "--data", str(good_data), "--tp", "3", "--output-dir", str(tmp_path / "o")])
    assert "config.json" in err and ("num_attention_heads" in err or "num_key_value_heads" in err), err


def test_query_groups_not_divisible_by_tp(capsys, hf_llama, good_data, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64)
    model = save_hf(LlamaForCausalLM(config), tmp_path / "m")
    err = _run_bad(capsys, ["--model", str(model), "--data", str(good_data), "--tp", "4", "--output-dir", str(tmp_path / "o")])
    assert "num_key_value_heads" in err, err


def test_fewer_layers_than_pipeline_stages(capsys, hf_llama, good_data, tmp_path):
    err = _run_bad(capsys, ["--model", str(hf_llama), "--data", str(good_data), "--pp", "5", "--output-dir", str(tmp_path / "o")])
    assert "num_hidden_layers" in err or "pp" in err, err


def test_unsupported_architecture(capsys, hf_llama, good_data, tmp_path):
    model = _edit_config(hf_llama, tmp_path / "m", architectures=["GPT2LMHeadModel"])
    err = _run_bad(capsys, ["--model", str(model), "--data", str(good_data), "--output-dir", str(tmp_path / "o")])
    assert "GPT2LMHeadModel" in err and "config.json" in err, err


def test_grouped_gemm_experts_on_a_dense_model(capsys, hf_llama, good_data, tmp_path):
    err = _run_bad(capsys, ["--model", str(hf_llama), "--data", str(good_data), "--moe-grouped-gemm", "--output-dir", str(tmp_path / "o")])
    assert err.endswith(f"moe_grouped_gemm: {hf_llama / 'config.json'} describes a dense model (no experts)"), err


def test_data_row_without_chosen(capsys, hf_llama, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text(json.dumps({"prompt": "w3", "chosen": " w4", "rejected": " w5"}) + "\n"
                    + json.dumps({"prompt": "w3", "rejected": " w5"}) + "\n")
    err = _run_bad(capsys, ["--model", str(hf_llama), "--data", str(data), "--output-dir", str(tmp_path / "o")])
    assert "bad.jsonl:2" in err and "chosen" in err, err


def test_eval_data_without_a_usable_pair(capsys, hf_llama, good_data, tmp_path):
    """Every held-out prompt fills --max-length: one line before any worker starts, not an
    error from the workers after they started."""
    eval_data = tmp_path / "eval.jsonl"
    eval_data.write_text(json.dumps({"prompt": "w3 w4 w5 w6", "chosen": " w7", "rejected": " w8"}) + "\n")
    err = _run_bad(capsys, ["--model", str(hf_llama), "--data", str(good_data), "--eval-data", str(eval_data),
                            "--max-length", "4", "--global-batch-size", "8", "--output-dir", str(tmp_path / "o")])
    assert "eval.jsonl: no usable pairs" in err and "max_length 4" in err, err


def test_tokenizer_larger_than_model_vocabulary(capsys, hf_llama, good_data, tmp_path):
    model = _edit_config(hf_llama, tmp_path / "m")
    from safetensors.torch import load_file, save_file

    state = load_file(str(model / "model.safetensors"))
    small = 64
    state = {k: (v[:small].clone() if k in ("model.embed_tokens.weight", "lm_head.weight") else v) for k, v in state.items()}
    save_file(state, str(model / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((model / "config.json").read_text())
    config["vocab_size"] = small
    (model / "config.json").write_text(json.dumps(config))
    err = _run_bad(capsys, ["--model", str(model), "--data", str(good_data), "--output-dir", str(tmp_path / "o")])
    assert "tokenizer" in err and "vocab_size 64" in err, err


def test_unknown_flag_and_bad_values(capsys, tmp_path):
    assert "--no-such-flag" in _run_bad(capsys, ["--no-such-flag", "1"])
    assert "tp" in _run_bad(capsys, ["--tp", "0"])
    assert "ref_mode" in _run_bad(capsys, ["--ref-mode", "sideways"])
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("tp: 1\nbogus_key: 3\n")
    assert "bogus_key" in _run_bad(capsys, ["--config", str(yaml_file)])
    yaml_file.write_text("tp: two\n")
    assert "tp" in _run_bad(capsys, ["--config", str(yaml_file)])


def test_dtype_takes_the_converter_short_names_as_one_internal_name(tmp_path, capsys):
    """bf16/fp16/fp32 (the converter's old spelling) are read as bfloat16/float16/float32, from
    a flag, a YAML file or Python, so either spelling is the same run; --help says so."""
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("dtype: fp16\n")
    assert resolve(["--dtype", "bf16"])[0].dtype == "bfloat16"
    assert resolve(["--config", str(yaml_file)])[0].dtype == "float16"
    assert TrainConfig(dtype="fp32").dtype == "float32" == TrainConfig().dtype
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    assert "(fp32, bf16, fp16 are read as these)" in " ".join(capsys.readouterr().out.split())


BOOL_FIELDS = [f.name for f in dataclasses.fields(TrainConfig) if f.type in ("bool", bool)]


def test_every_boolean_field_has_a_flag_per_polarity():
    assert "no_shuffle" in BOOL_FIELDS and "resume" in BOOL_FIELDS
    assert bool_flags("no_shuffle") == ("--no-shuffle", "--shuffle")
    assert bool_flags("export_hf") == ("--export-hf", "--no-export-hf")


@pytest.mark.parametrize("name", BOOL_FIELDS)
def test_boolean_flags_parse_in_both_polarities(name, tmp_path):
    """Each boolean field through the real parser: its positive flag sets it, its negative flag
    clears it, no flag keeps the default, and the flag beats the YAML file in both directions."""
    on, off = bool_flags(name)
    default = getattr(TrainConfig(), name)
    assert getattr(resolve([on])[0], name) is True
    assert getattr(resolve([off])[0], name) is False
    assert getattr(resolve([])[0], name) is default
    yaml_file = tmp_path / "c.yaml"
    for file_value, flag, expected in ((True, off, False), (False, on, True)):
        yaml_file.write_text(f"{name}: {str(file_value).lower()}\n")
        assert getattr(resolve(["--config", str(yaml_file)])[0], name) is file_value
        assert getattr(resolve(["--config", str(yaml_file), flag])[0], name) is expected


def test_memory_interval_picks_the_counted_steps_from_the_command_line(capsys):
    config = resolve(["--memory-interval", "3"])[0]
    assert [s for s in range(1, 10) if config.accounts_memory(s)] == [1, 2, 3, 6, 9]
    assert [s for s in range(1, 10) if resolve(["--memory-interval", "0"])[0].accounts_memory(s)] == [1, 2]
    assert all(resolve(["--memory-interval", "1"])[0].accounts_memory(s) for s in range(1, 10))
    assert "memory_interval" in _run_bad(capsys, ["--memory-interval", "-1"])


@pytest.mark.parametrize("argv", [["--no-no-shuffle"], ["--no-shuf"], ["--max-step", "3"]],
                         ids=["double-negation", "abbreviated-bool", "abbreviated-int"])
def test_double_negations_and_abbreviations_are_errors(argv):
    with pytest.raises(ConfigError, match="unrecognized arguments"):
        resolve(argv)


def test_default_run_learns_and_writes_everything(tmp_path):
    """`python -m mcore_dpo.train` on the embedded default: held-out reward accuracy rises from
    chance (policy == reference at the start: every margin is 0) to >= 0.9. Padded on the CPU by
    default (the local attention's packed rows cost more than padding): config.yaml says so, and
    no fallback line is printed."""
    out = tmp_path / "run"
    proc = run_train(["--output-dir", str(out)], env=command_env(MCORE_DPO_CACHE=str(tmp_path / "cache")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["step"] >= 1]
    assert [r["step"] for r in steps] == list(range(1, 121))
    for key in ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected", "logits/chosen", "logits/rejected", "grad_norm", "lr", "tokens/s", "step_time_s",
                "bubble_fraction", "memory/peak_gib"):
        assert key in steps[0], key
    assert all(0.0 <= r["bubble_fraction"] < 1.0 for r in steps)
    # The exact memory count runs on steps 1, 2 and every --memory-interval (50) steps only.
    assert [r["step"] for r in steps if "memory/total_peak_bytes" in r] == [1, 2, 50, 100]
    assert abs(steps[0]["loss"] - 0.6931) < 1e-3  # step 1 is measured at the initial weights
    evals = [r for r in records if "eval/rewards/accuracies" in r]
    assert evals[0]["step"] == 0 and evals[0]["eval/rewards/accuracies"] <= 0.6
    assert evals[-1]["step"] == 120 and evals[-1]["eval/rewards/accuracies"] >= 0.9, evals[-1]
    assert any((out / "tensorboard").iterdir())
    assert (out / "plots" / "loss.png").is_file() and (out / "plots" / "rewards_accuracies.png").is_file()
    import yaml

    assert yaml.safe_load((out / "config.yaml").read_text())["packing"] is False
    assert not any(line.startswith("packing: ") for line in proc.stdout.splitlines()), proc.stdout
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out / "hf"))
    assert isinstance(next(model.parameters()), torch.Tensor)


def test_bf16_run_exports_a_bf16_checkpoint(tmp_path, ray_cluster):
    """--dtype bfloat16 (megatron-core keeps some norms in fp32): the export is uniformly bf16
    and loads in transformers. The same run checks more things end to end: --deterministic
    (torch's deterministic algorithms and megatron-core's deterministic mode run on the CPU too)
    and --no-shuffle reach the written config.yaml, --no-packing as packing: false and
    padded microbatches (16 pairs in 2 of 8), and a held-out set of 5 pairs (fewer than the
    global batch of 16) is evaluated at the start and the end."""
    from mcore_dpo.driver.defaults import DEFAULT_EVAL_DATA

    out = tmp_path / "run"
    small_eval = tmp_path / "eval5.jsonl"
    small_eval.write_text("".join(Path(DEFAULT_EVAL_DATA).read_text().splitlines(keepends=True)[:5]))
    proc = main_in_process(["--dtype", "bfloat16", "--tp", "2", "--max-steps", "2", "--global-batch-size", "16",
                            "--micro-batch-size", "8", "--no-shuffle", "--no-packing", "--deterministic", "--eval-data",
                            str(small_eval), "--output-dir", str(out)], cluster=ray_cluster)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import yaml

    written = yaml.safe_load((out / "config.yaml").read_text())
    assert written["no_shuffle"] is True and written["dtype"] == "bfloat16" and written["packing"] is False
    assert written["deterministic"] is True
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval/loss" in r] == [0, 2]
    assert [r["microbatches"] for r in records if "loss" in r] == [2.0, 2.0]
    from safetensors.torch import load_file

    tensors = {}
    for file in (out / "hf").glob("*.safetensors"):
        tensors.update(load_file(str(file)))
    assert tensors and {t.dtype for t in tensors.values()} == {torch.bfloat16}
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(out / "hf"))


@pytest.mark.in_fast_tier
def test_two_steps_in_process_write_metrics_a_checkpoint_and_the_export(ray_cluster, tmp_path):
    """The product's path end to end at world size 1, in this process on the session's Ray
    cluster and through the real parser: two steps, a checkpoint after each, the evaluation at
    the start and the end, and an hf/ export that transformers loads (the fast tier's one run)."""
    out = tmp_path / "run"
    done = main_in_process(["--max-steps", "2", "--global-batch-size", "16", "--micro-batch-size", "8",
                            "--save-interval", "1", "--save-interval-min", "0", "--eval-interval", "2", "--output-dir",
                            str(out)], cluster=ray_cluster)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"done: {out}" in done.stdout.splitlines(), done.stdout[-2000:]
    # joined to the session's cluster before main ran: it says so, and starts none
    assert "using the Ray cluster this process is connected to" in done.stdout.splitlines(), done.stdout[-2000:]
    assert "starting a local Ray cluster" not in done.stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
    assert [r["step"] for r in records if "eval/loss" in r] == [0, 2]
    first = next(r for r in records if r["step"] == 1 and "loss" in r)
    assert abs(first["loss"] - 0.6931) < 1e-3  # step 1 is measured at the initial weights (policy == reference)
    # A checkpoint after each step (`latest` names the final one), the completion mark at step 2.
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_00000001", "step_00000002"]
    assert json.loads((out / output_dir.COMPLETE_FILE).read_text())["step"] == 2
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(out / "hf"))
    assert isinstance(next(model.parameters()), torch.Tensor)
