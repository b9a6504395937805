"""The TRL 1.16 options through the command line's parser (the runs in this process): parsing and
refusals, and TR-DPO's moving reference surviving a checkpoint and resume bit-exactly
(interleaved reference at pp 2, aot)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mcore_dpo.command_line import resolve
from mcore_dpo.config import ConfigError
from tests.helpers.ray_runs import main_in_process

TIMING = ("tokens/s", "step_time_s", "bubble_fraction", "memory/peak_gib")


def test_flags_reach_the_loss_and_the_config():
    config, _ = resolve([
        "--loss-type", "sigmoid,aot", "--loss-weights", "1,0.5", "--f-divergence-type", "reverse_kl",
        "--ld-alpha", "0.25", "--sync-ref-model", "--ref-model-mixup-alpha", "0.3", "--ref-model-sync-steps", "7",
    ])
    spec = config.loss_spec()
    assert spec.loss_types == ("sigmoid", "aot") and spec.needs_batch_sort
    assert (config.ld_alpha, config.sync_ref_model, config.ref_model_mixup_alpha, config.ref_model_sync_steps) == (
        0.25, True, 0.3, 7)
    config, _ = resolve(["--loss-type", "ipo", "--f-divergence-type", "alpha_divergence",
                         "--f-alpha-divergence-coef", "0.2", "--use-weighting"])
    spec = config.loss_spec()
    assert (spec.f_divergence_type, spec.f_alpha_divergence_coef, spec.use_weighting) == ("alpha_divergence", 0.2, True)
    assert resolve(["--loss-type", "aot_unpaired"])[0].loss_spec().loss_types == ("aot_unpaired",)


@pytest.mark.parametrize("argv, message", [
    (["--ld-alpha", "1.5"], "ld_alpha: must be in [0, 1]"),
    (["--f-divergence-type", "kl"], "f_divergence_type: unknown 'kl'"),
    (["--loss-type", "bco_pair", "--f-divergence-type", "js_divergence"], "f_divergence_type: js_divergence is not"),
    (["--loss-type", "aot", "--use-weighting"], "use_weighting: not defined for aot"),
    (["--sync-ref-model", "--ref-mode", "precomputed"], "sync_ref_model: needs --ref-mode interleaved or sequential"),
    (["--sync-ref-model", "--ref-model-sync-steps", "0"], "ref_model_sync_steps: must be a positive integer"),
    (["--ref-model-mixup-alpha", "2"], "ref_model_mixup_alpha: must be in [0, 1]"),
    (["--loss-type", "sigmoid", "--label-smoothing", "0.1"], "use cdpo for label-smoothed sigmoid"),
])
def test_bad_values_are_one_line(argv, message):
    with pytest.raises(ConfigError) as info:
        resolve(argv)
    assert message in str(info.value) and "\n" not in str(info.value)


# --------------------------------------------------------------------------- TR-DPO resume
ARGS = ["--max-steps", "4", "--global-batch-size", "16", "--micro-batch-size", "4", "--eval-interval", "0",
        "--pp", "2", "--ref-mode", "interleaved", "--loss-type", "aot", "--sync-ref-model",
        "--ref-model-sync-steps", "2", "--ref-model-mixup-alpha", "0.5"]


def _run(out: Path, extra: list[str], *, cluster) -> subprocess.CompletedProcess:
    """The command line in this process, on the session's Ray cluster."""
    return main_in_process([*ARGS, *extra, "--output-dir", str(out)], cluster=cluster)


def _metrics(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in TIMING and not k.startswith("memory/")} for row in rows]


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(directory.rglob("*.safetensors")):
        tensors.update({f"{file.relative_to(directory)}:{k}": v for k, v in load_file(str(file)).items()})
    return tensors


def test_trdpo_resume_across_a_sync_is_bit_exact(tmp_path_factory, ray_cluster):
    """The step-3 checkpoint of an uninterrupted run, resumed with the same command: step 4 (a
    sync step) and the exported weights equal the uninterrupted run's bit for bit. The run
    resumes from a copy of that checkpoint rather than after a kill: a killed run writes the
    same checkpoint, and a kill followed by a rerun of the same command is covered at pp 2 by
    tests/test_resume.py::test_exact_resume_after_kill (interleaved reference, carried state)."""
    base = tmp_path_factory.mktemp("base") / "run"
    result = _run(base, ["--save-interval", "3"], cluster=ray_cluster)
    assert result.returncode == 0, result.stderr[-3000:]
    # The step-3 checkpoint holds the reference as mixed at step 2, not the source model's.
    ckpt = base / "checkpoints" / "step_00000003"
    reference, model = _tensors(ckpt / "reference"), _tensors(ckpt / "model")
    assert reference.keys() == model.keys()
    assert any(not torch.equal(reference[k], model[k]) for k in reference)

    out = tmp_path_factory.mktemp("resumed") / "run"
    shutil.copytree(ckpt, out / "checkpoints" / ckpt.name)
    (out / "checkpoints" / "latest").write_text(ckpt.name + "\n")
    resumed = _run(out, ["--save-interval", "3"], cluster=ray_cluster)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout
    assert _metrics(out) == [m for m in _metrics(base) if m["step"] == 4]
    wa, wb = _tensors(base / "hf"), _tensors(out / "hf")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
