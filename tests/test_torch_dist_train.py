"""`python -m mcore_dpo.train --model DIR --tokenizer DIR` on a torch_dist checkpoint that
carries no HF files (as Megatron-LM, Megatron-Bridge and ms-swift write them): the model
comes from the checkpoint's args, the tokenizer from --tokenizer."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
from pathlib import Path

import torch

from checkpoint_convert.convert import hf_to_mcore
from checkpoint_convert.safe_pickle import torch_load_file
from mcore_dpo.config import TrainConfig
from mcore_dpo.model.builder import open_weights
from mcore_dpo.driver.run import InputError, prepare
from tests.helpers.faults import fault_env
from tests.helpers.models import llama_gqa_untied, save_hf
from tests.helpers.ray_runs import main_in_process


def _foreign_checkpoint(tmp_path: Path) -> tuple[Path, Path]:
    """A torch_dist save directory without hf_files/, whose args lack the unpadded vocabulary."""
    hf_dir = save_hf(llama_gqa_untied(), tmp_path / "hf")
    save = tmp_path / "megatron"
    hf_to_mcore(hf_dir, save, tp=1, pp=1, fmt="torch_dist", log=lambda _m: None)
    shutil.rmtree(save / "release" / "hf_files")
    common = torch_load_file(save / "release" / "common.pt")
    del common["args"].vocab_size
    torch.save(common, save / "release" / "common.pt")
    return hf_dir, save


def _data(path: Path) -> Path:
    rows = [{"prompt": f"w{i} w{i + 1}", "chosen": f"w{i + 2}", "rejected": f"w{i + 3}"} for i in range(3, 40)]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_train_accepts_a_megatron_checkpoint_with_tokenizer(tmp_path, ray_cluster):
    hf_dir, save = _foreign_checkpoint(tmp_path)
    data = _data(tmp_path / "prefs.jsonl")
    # Before any process: no tokenizer in the checkpoint and none given is one clear error ...
    try:
        prepare(TrainConfig(model=str(save), data=str(data), global_batch_size=8, micro_batch_size=8))
        raise AssertionError("expected an InputError")
    except InputError as error:
        assert "--tokenizer" in str(error)
    # ... and with --tokenizer the weights read through HF names are the source model's
    # (the vocabulary is Megatron's padded one, with zero rows after the real ones).
    weights, source = open_weights(str(save)), open_weights(str(hf_dir))
    assert weights.spec.vocab_size == 128 and weights.spec.architecture == "LlamaForCausalLM"
    for name in source.names:
        got, want = weights.get(name), source.get(name)
        if got.shape != want.shape:
            assert torch.equal(got[: want.shape[0]], want) and torch.count_nonzero(got[want.shape[0]:]) == 0, name
        else:
            assert torch.equal(got, want), name
    out = tmp_path / "run"
    argv = ["--model", str(save), "--tokenizer", str(hf_dir), "--data", str(data), "--max-steps", "1",
            "--global-batch-size", "8", "--micro-batch-size", "8", "--output-dir", str(out)]  # fmt: skip
    proc = main_in_process(argv, cluster=ray_cluster)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in steps if r["step"] == 1)
    assert abs(first["loss"] - math.log(2)) < 1e-4  # the reference is the same checkpoint
    assert math.isfinite(first["logps/chosen"]) and first["logps/chosen"] < 0
    exported = json.loads((out / "hf" / "config.json").read_text())
    assert exported["vocab_size"] == 128
    assert (out / "hf" / "tokenizer.json").is_file()  # the --tokenizer files travel with the result


# --- training checkpoints in Megatron-LM's format (--save-format torch_dist) -----------------

STEPS = 4
TORCH_DIST_RUN = ["--max-steps", str(STEPS), "--global-batch-size", "16", "--micro-batch-size", "4", "--eval-interval",
                  "0", "--pp", "2", "--save-format", "torch_dist"]  # fmt: skip
TIMING = ("tokens/s", "step_time_s", "bubble_fraction", "memory/peak_gib")  # measured, not computed


def _train(args: list[str], out: Path, *, cluster, fault: str | None = None) -> subprocess.CompletedProcess:
    """The command line in this process, on the session's Ray cluster."""
    return main_in_process([*TORCH_DIST_RUN, *args, "--output-dir", str(out)], cluster=cluster,
                           env=fault_env(fault) if fault else None)


def _metrics(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in TIMING and not k.startswith("memory/")} for row in rows]


def _hf_weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted((out / "hf").glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def test_torch_dist_training_checkpoints(tmp_path, ray_cluster):
    """--save-format torch_dist through the command line (in this process) at tp1 pp2: rotation and
    both pointers (the last step is saved too, so both name it); a run
    killed at step 3 resumes from iter_0000002 bit-exactly; megatron-core's own
    dist_checkpointing.load reads model and optimizer state at tp2 pp1 and gets what this
    project's restricted reader gets; mcore-to-hf converts the save directory."""
    from safetensors.torch import load_file, save_file
    from tests.helpers.megatron_ranks import spawn, training_consumer_rank

    from checkpoint_convert.mapping import hf_to_mcore_shard
    from mcore_dpo.checkpoint.torch_dist import open_part

    base = tmp_path / "base"
    result = _train(["--save-interval", "1", "--keep-last", "2"], base, cluster=ray_cluster)
    assert result.returncode == 0, result.stderr[-3000:]
    ckpts = base / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == ["iter_0000003", "iter_0000004"]
    assert (ckpts / "latest").read_text().strip() == "iter_0000004"
    assert (ckpts / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    iter_dir = ckpts / "iter_0000004"
    assert json.loads((iter_dir / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    common = torch_load_file(iter_dir / "common.pt")
    assert common["iteration"] == 4 and common["checkpoint_version"] == 3.0
    assert common["args"].pipeline_model_parallel_size == 2 and common["args"].num_layers == 4
    assert common["content_metadata"]["distrib_optim_sharding_type"] == "fully_sharded_model_space"

    # Killed at step 3 (after the step-2 checkpoint), resumed by running the same command line again.
    out = tmp_path / "run"
    killed = _train(["--save-interval", "2"], out, cluster=ray_cluster, fault="step:3")
    assert killed.returncode != 0 and "died" in killed.stderr.strip().splitlines()[-1]
    assert (out / "checkpoints" / "latest").read_text().strip() == "iter_0000002"
    assert (out / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    resumed = _train(["--save-interval", "2"], out, cluster=ray_cluster)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout and "iter_0000002" in resumed.stdout
    assert _metrics(out) == _metrics(base)
    ours, ref = _hf_weights(out), _hf_weights(base)
    assert ours.keys() == ref.keys()
    for name in ref:
        assert torch.equal(ours[name], ref[name]), name

    # Megatron side, at another layout (tp2 pp1; divisor 64 keeps the writer's padded vocabulary).
    tp, pp, divisor = 2, 1, 64
    tokens = torch.randint(0, 127, (2, 12), generator=torch.Generator().manual_seed(0))
    save_file({"tokens": tokens}, str(tmp_path / "tokens.safetensors"))
    job = {"checkpoint": str(iter_dir), "tp": tp, "pp": pp, "divisor": divisor,
           "tokens": str(tmp_path / "tokens.safetensors"),
           "logits": str(tmp_path / "logits.safetensors"), "state": str(tmp_path / "state_rank{rank}.safetensors")}
    spawn(training_consumer_rank, world_size=tp * pp, job=job)
    model_view = open_weights(str(iter_dir))
    for rank in range(tp):
        loaded = load_file(job["state"].format(rank=rank))
        parts = {"model": model_view, "fp32_param": open_part(iter_dir, "model"),
                 "exp_avg": open_part(iter_dir, "exp_avg"), "exp_avg_sq": open_part(iter_dir, "exp_avg_sq")}
        for part, view in parts.items():
            expected = hf_to_mcore_shard(model_view.spec, tp=tp, tp_rank=rank, pp=pp, pp_rank=0, get=view.get,
                                         divisor=divisor)  # fmt: skip
            for name, tensor in expected.items():
                assert torch.equal(loaded[f"{part}/{name}"], tensor), (rank, part, name)
        for name in expected:  # an fp32 run: the masters are the weights
            assert torch.equal(loaded[f"fp32_param/{name}"], loaded[f"model/{name}"]), name
        assert loaded["exp_avg_sq/decoder.final_layernorm.weight"].abs().sum() > 0  # trained state, not zeros

    # mcore-to-hf reads the save directory (Megatron-LM's pointer) and its logits are Megatron's.
    from tests.helpers.models import exported_logits

    reference = exported_logits(ckpts, tmp_path / "hf_step4", tokens)
    megatron = load_file(job["logits"])["logits"]
    assert (megatron[..., :127] - reference).abs().max().item() <= 1e-5


def test_save_format_flag_values_and_refusals():
    """--save-format through the CLI's parser: the allowed values are listed in --help; an
    unknown value and a combination not yet stored are one line naming the field."""
    from mcore_dpo.command_line import build_parser, resolve
    from mcore_dpo.config import ConfigError

    help_text = build_parser().format_help()
    block = help_text[help_text.index("--save-format"):].split("\n  --", 1)[0]
    assert "safetensors" in block and "torch_dist" in block and "(default: safetensors)" in " ".join(block.split())
    config, _ = resolve(["--save-format", "torch_dist"])
    assert config.save_format == "torch_dist"
    assert resolve([])[0].save_format == "safetensors"
    for argv, words in ((["--save-format", "megatron"], "'megatron' is not safetensors or torch_dist"),
                        (["--save-format", "torch_dist", "--sync-ref-model"], "--sync-ref-model"),
                        (["--save-format", "torch_dist", "--lora-rank", "4"], "LoRA checkpoints are PEFT adapter files")):
        try:
            resolve(argv)
            raise AssertionError(f"expected a ConfigError for {argv}")
        except ConfigError as error:
            message = str(error)
            assert message.startswith("save_format: ") and words in message and "\n" not in message, message
