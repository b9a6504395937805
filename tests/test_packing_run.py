"""--packing through the real command line at tp 4 x pp 2 (8 Ray actors), and an exact resume.

One uninterrupted run of 3 steps saves a checkpoint at step 2; a copy of it is then resumed
with the same command. Step 3 and the exported weights must be bit-identical: the token-balanced split, the packed rows and the interleaved reference
(recomputed for the first batch after a resume, then carried between steps whose microbatch
counts differ) are all functions of the data order, which the checkpoint's step fixes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mcore_dpo import defaults

REPO = Path(__file__).resolve().parents[1]
TIMING = ("tokens/s", "step_time_s", "bubble_fraction", "memory/peak_gib")
# The embedded data's first three 16-pair batches hold 404, 422 and 404 tokens: a budget of 150
# splits them into 3, 4 and 3 microbatches.
ARGV = ["--tp", "4", "--pp", "2", "--packing", "--max-tokens-per-microbatch", "150", "--max-steps", "3",
        "--global-batch-size", "16", "--save-interval", "2", "--eval-interval", "0"]


def _run(out: Path, cache: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", MCORE_DPO_CACHE=str(cache))
    # 8 held-out pairs instead of the embedded 200: evaluation (start and end) is not under test.
    eval_data = cache.parent / "eval8.jsonl"
    if not eval_data.exists():
        lines = Path(defaults.DEFAULT_EVAL_DATA).read_text().splitlines()[:8]
        eval_data.write_text("\n".join(lines) + "\n")
    return subprocess.run([sys.executable, "-m", "mcore_dpo.train", *ARGV, "--eval-data", str(eval_data),
                           "--output-dir", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def _steps(out: Path) -> dict[int, dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: {k: v for k, v in row.items() if k not in TIMING and not k.startswith("memory/")} for row in rows if "loss" in row}


def _weights(out: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted((out / "hf").glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


@pytest.mark.slow
def test_packing_at_tp4_pp2_and_exact_resume(tmp_path):
    cache = tmp_path / "cache"
    straight = tmp_path / "straight"
    result = _run(straight, cache)
    assert result.returncode == 0, result.stderr[-3000:]
    steps = _steps(straight)
    assert sorted(steps) == [1, 2, 3]
    for m in steps.values():
        assert m["tokens/real"] <= m["tokens/padded"] and m["padding_fraction"] < 0.1, m
        assert m["microbatches"] >= 1
    assert [steps[k]["microbatches"] for k in (1, 2, 3)] == [3, 4, 3]

    resumed = tmp_path / "resumed"
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(straight / "checkpoints" / "step_00000002", resumed / "checkpoints" / "step_00000002")
    (resumed / "checkpoints" / "latest").write_text("step_00000002\n")
    result = _run(resumed, cache)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resuming from" in result.stdout
    again = _steps(resumed)
    assert again[3] == steps[3], f"step 3 after resume: {again[3]} != {steps[3]}"
    want, got = _weights(straight), _weights(resumed)
    assert want.keys() == got.keys() and want
    for name in want:
        assert torch.equal(want[name], got[name]), name
