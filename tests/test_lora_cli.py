"""LoRA DPO through the command line (in this process on the session's Ray cluster; the tiny
default model and data): checkpoints that hold only the adapters, exact resume, resume at another
layout, and the exports: OUTPUT/adapter loads in PEFT with no missing or unexpected keys and gives the merged
export's logits; OUTPUT/hf equals PEFT's merge_and_unload(). `--init-adapter` resolves its rank,
alpha and targets through the parser and `run.prepare`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.ray_runs import main_in_process

STEPS = 4
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--lora-dropout", "0.0", "--lora-targets", "qkv,proj,fc1,fc2"]
COMMON = ["--max-steps", str(STEPS), "--global-batch-size", "16", "--micro-batch-size", "4", "--eval-interval", "0",
          *LORA]
TIMING = ("tokens/s", "step_time_s", "bubble_fraction", "memory/peak_gib")
RTOL = 1e-5


def _run(args: list[str], out: Path, *, cluster) -> subprocess.CompletedProcess:
    """The command line in this process, on the session's Ray cluster."""
    return main_in_process([*COMMON, *args, "--output-dir", str(out)], cluster=cluster)


def _metrics(out: Path, *, after: int = 0) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in TIMING and not k.startswith("memory/")} for row in rows if row["step"] > after]


def _adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


def _copy_checkpoint(src: Path, dst: Path, step: str = "step_00000002") -> None:
    (dst / "checkpoints").mkdir(parents=True)
    shutil.copytree(src / "checkpoints" / step, dst / "checkpoints" / step)
    (dst / "checkpoints" / "latest").write_text(step + "\n")


@pytest.fixture(scope="module")
def cache() -> Path:
    """The session's MCORE_DPO_CACHE, where the runs find the embedded default model."""
    return Path(os.environ["MCORE_DPO_CACHE"])


@pytest.fixture(scope="module")
def baseline(tmp_path_factory, ray_cluster) -> Path:
    """LoRA DPO at tp 2, a checkpoint at step 2, both exports at the end."""
    out = tmp_path_factory.mktemp("lora") / "run"
    result = _run(["--tp", "2", "--save-interval", "2"], out, cluster=ray_cluster)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def _base_dir(cache: Path) -> Path:
    from mcore_dpo.driver.defaults import DEFAULT_MODEL_NAME

    return cache / DEFAULT_MODEL_NAME


def test_checkpoint_holds_adapters_and_points_at_the_base(baseline, cache):
    from checkpoint_convert.peft_adapter import adapter_entries, lora_shape_of
    from checkpoint_convert.io import open_hf_dir
    from mcore_dpo.checkpoint.fingerprint import model_fingerprint

    ckpt = baseline / "checkpoints" / "step_00000002"
    assert not (ckpt / "model").exists()  # no copy of the base
    spec = open_hf_dir(_base_dir(cache)).spec
    shape, _ = lora_shape_of(ckpt / "adapter", spec=spec)
    expected = {peft for _, peft, _, _, _ in adapter_entries(spec, shape, pp=1, pp_rank=0)}
    for kind in ("adapter", "optim/exp_avg", "optim/exp_avg_sq"):
        tensors = load_file(str(ckpt / kind / "adapter_model.safetensors"))
        assert set(tensors) == expected, kind
        assert all(t.dtype == torch.float32 for t in tensors.values())
    assert any(t.abs().max() > 0 for k, t in load_file(str(ckpt / "optim/exp_avg_sq/adapter_model.safetensors")).items())
    base = json.loads((ckpt / "base.json").read_text())
    assert Path(base["model"]) == _base_dir(cache).resolve()
    assert base["fingerprint"] == model_fingerprint(_base_dir(cache))


def test_exact_resume(baseline, ray_cluster, tmp_path):
    out = tmp_path / "run"
    _copy_checkpoint(baseline, out)
    result = _run(["--tp", "2", "--save-interval", "2"], out, cluster=ray_cluster)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from" in result.stdout
    assert _metrics(out) == _metrics(baseline, after=2)  # the copied checkpoint is step 2's
    ours, ref = _adapter(out), _adapter(baseline)
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref)
    merged_a = load_file(str(next((out / "hf").glob("*.safetensors"))))
    merged_b = load_file(str(next((baseline / "hf").glob("*.safetensors"))))
    assert all(torch.equal(merged_a[k], merged_b[k]) for k in merged_b)


def test_resume_at_another_layout_without_merging(baseline, ray_cluster, tmp_path):
    """The tp-2 checkpoint (sharded optimizer) resumed at dp 2 with the replicated optimizer:
    steps 3-4 and the adapter equal the uninterrupted run's within 1e-5; --no-merge-lora
    exports only the adapter. The packed split's layout counts (token positions, padding,
    microbatches) are dp 2's own; the real tokens are the same."""
    out = tmp_path / "run"
    _copy_checkpoint(baseline, out)
    result = _run(["--dp", "2", "--no-merge-lora", "--no-distributed-optimizer"], out, cluster=ray_cluster)
    assert result.returncode == 0, result.stderr[-3000:]
    assert not (out / "hf").exists() and (out / "adapter" / "adapter_config.json").is_file()
    ours, ref = _metrics(out), _metrics(baseline, after=2)
    assert [m["step"] for m in ours] == [m["step"] for m in ref]
    for a, b in zip(ours, ref):
        for key in b:
            if key in ("tokens/padded", "padding_fraction", "microbatches"):  # split by tokens over dp ranks
                continue
            assert abs(a[key] - b[key]) <= RTOL * max(1.0, abs(b[key])), (a["step"], key, a[key], b[key])
    wa, wb = _adapter(out), _adapter(baseline)
    for name in wb:
        assert (wa[name] - wb[name]).abs().max() <= RTOL * wb[name].abs().max(), name


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_exports_load_in_peft_and_match(baseline, cache):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(_base_dir(cache)), dtype=torch.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(base, str(baseline / "adapter"))
    assert not [w for w in caught if "missing" in str(w.message).lower() or "unexpected" in str(w.message).lower()]
    saved = set(_adapter(baseline))
    loaded = {n.replace(".default.weight", ".weight") for n, _ in model.named_parameters() if "lora_" in n}
    assert loaded == saved  # no missing, no unexpected keys
    for name, value in _adapter(baseline).items():  # and the values are the file's
        param = dict(model.named_parameters())[name.replace(".weight", ".default.weight")]
        assert torch.equal(param.detach(), value)
    assert any(v.abs().max() > 0 for k, v in _adapter(baseline).items() if "lora_B" in k)  # trained, not the init
    ids = torch.randint(3, base.config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    merged_export = AutoModelForCausalLM.from_pretrained(str(baseline / "hf"), dtype=torch.float32)
    engine = _logits(merged_export, ids)
    with_adapter = _logits(model, ids)
    scale = with_adapter.abs().max()
    assert (engine - with_adapter).abs().max() <= RTOL * scale
    base_only = AutoModelForCausalLM.from_pretrained(str(_base_dir(cache)), dtype=torch.float32)
    assert (_logits(base_only, ids) - with_adapter).abs().max() > 100 * RTOL * scale  # the adapter does something
    merged = model.merge_and_unload()
    assert (_logits(merged, ids) - engine).abs().max() <= RTOL * scale
    export_weights = dict(merged_export.named_parameters())
    for name, param in merged.named_parameters():
        if name in export_weights:
            ref = param.detach()
            assert (export_weights[name].detach() - ref).abs().max() <= RTOL * ref.abs().max(), name


def test_init_adapter_through_the_command_line(baseline, cache, monkeypatch):
    """--init-adapter alone: the parser takes it and `prepare` reads rank, alpha and targets from
    the adapter (here the baseline's export)."""
    from mcore_dpo.command_line import resolve
    from mcore_dpo.driver.run import prepare

    monkeypatch.setenv("MCORE_DPO_CACHE", str(cache))
    config, _ = resolve(["--init-adapter", str(baseline / "adapter")])
    prep = prepare(config)
    assert (prep.config.lora_rank, prep.config.lora_alpha, prep.config.lora_targets) == (4, 8.0, "qkv,proj,fc1,fc2")


@pytest.mark.parametrize("flags,message", [
    (["--lora-rank", "2", "--lora-alpha", "8", "--lora-targets", "qkv,proj,fc1,fc2"],
     "the checkpoint's adapters have rank 4 on qkv,proj,fc1,fc2, this run asks for rank 2"),
    ([], "the checkpoint holds LoRA adapters but this run trains full weights"),
], ids=["another-rank", "lora-off"])
def test_resume_cannot_change_the_adapters_shape(baseline, cache, tmp_path, monkeypatch, capsys, flags, message):
    """Even with --resume-with-changes: one line naming the checkpoint, before any worker starts."""
    import ray

    from mcore_dpo.train import main

    monkeypatch.setenv("MCORE_DPO_CACHE", str(cache))
    out = tmp_path / "run"
    _copy_checkpoint(baseline, out)
    common = COMMON[: len(COMMON) - len(LORA)]  # COMMON ends with LORA
    code = main([*common, "--tp", "2", *flags, "--resume-with-changes", "--output-dir", str(out)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "trainer_state.json: " in err and message in err, err
    assert not ray.is_initialized()
