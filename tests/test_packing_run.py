"""--packing through the command line (in this process) at tp 4 x pp 2 (8 Ray actors), equal to
one rank, and an exact resume.

One uninterrupted run of 2 steps saves a checkpoint at step 1; its 8 ranks run as 8 Ray actors
(processes of their own), and its losses equal those of the same command at tp 1 x pp 1 within
1e-5. A copy of its step-1 checkpoint is then resumed with the same command. Step 2 and the
exported weights must be bit-identical: the token-balanced split, the packed rows and the
interleaved reference (step 1 carries one of step 2's reference forwards out of a step whose
microbatch count differs; the resumed run recomputes it) are all functions of the data order,
which the checkpoint's step fixes.
Kept to the fewest steps and pairs that still change the microbatch count between the two
steps, and without evaluation (`--data` given, so no held-out set is added).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import torch
from safetensors.torch import load_file

from mcore_dpo.driver import defaults
from tests.helpers.ray_runs import main_in_process

TIMING = ("tokens/s", "step_time_s", "bubble_fraction", "memory/peak_gib")
# The embedded data's first two 4-pair batches hold 108 and 94 tokens: a budget of 96 splits
# them into 2 microbatches and 1.
ARGV = ["--tp", "4", "--pp", "2", "--packing", "--max-tokens-per-microbatch", "96", "--max-length", "32",
        "--max-steps", "2", "--global-batch-size", "4", "--save-interval", "1", "--eval-interval", "0",
        "--data", defaults.DEFAULT_TRAIN_DATA]


def _run(out: Path, cluster, *, layout: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """The command line in this process, on the session's Ray cluster (8 CPUs: the 8 actors)."""
    return main_in_process([*ARGV, *layout, "--output-dir", str(out)], cluster=cluster)


def _steps(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: {k: v for k, v in row.items() if k not in TIMING and not k.startswith("memory/")} for row in rows if "loss" in row}


def _weights(out: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted((out / "hf").glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


# This launch is also the suite's one `--tp 4 --pp 2` run as 8 Ray actors checked against a
# single rank (it used to be a launch of its own in tests/test_ray_launch.py, with the same
# assertions on another batch); scripts/compat_check.sh runs it for that.
def test_packing_at_tp4_pp2_equals_tp1_pp1_and_resumes_exactly(tmp_path, ray_cluster):
    straight = tmp_path / "straight"
    result = _run(straight, ray_cluster)
    assert result.returncode == 0, result.stderr[-3000:]
    workers = json.loads((straight / "workers.json").read_text())
    assert sorted(workers) == sorted(f"policy/tp{t}-pp{p}-dp0" for t in range(4) for p in range(2))
    assert len({w["pid"] for w in workers.values()}) == 8
    steps = _steps(straight)
    assert sorted(steps) == [1, 2]
    for m in steps.values():
        assert m["tokens/real"] <= m["tokens/padded"] and m["padding_fraction"] < 0.1, m
        assert m["microbatches"] >= 1
    assert [steps[k]["microbatches"] for k in (1, 2)] == [2, 1]

    single = tmp_path / "tp1pp1"
    result = _run(single, ray_cluster, layout=("--tp", "1", "--pp", "1"))
    assert result.returncode == 0, result.stderr[-3000:]
    one = _steps(single)
    assert sorted(one) == [1, 2]
    for k in (1, 2):
        assert abs(steps[k]["loss"] - one[k]["loss"]) <= 1e-5, (k, steps[k]["loss"], one[k]["loss"])

    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "step_00000001", resumed / "checkpoints" / "step_00000001")
    (resumed / "checkpoints" / "latest").write_text("step_00000001\n")
    result = _run(resumed, ray_cluster)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from" in result.stdout
    again = _steps(resumed)
    assert sorted(again) == [2]
    assert again[2] == steps[2], f"step 2 after resume: {again[2]} != {steps[2]}"
    want, got = _weights(straight), _weights(resumed)
    assert want.keys() == got.keys() and want
    for name in want:
        assert torch.equal(want[name], got[name]), name
