"""One export source of truth, through the real command lines: a run interrupted, resumed and
finished leaves `checkpoints/latest` at its final step; `mcore-to-hf --mcore-dir OUTPUT` (the
run directory itself) exports that checkpoint, bit for bit equal to OUTPUT/hf; a larger
--max-steps continues from the final step, not from the interrupted one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from safetensors.torch import load_file

from mcore_dpo import checkpoint

REPO = Path(__file__).resolve().parents[1]
STEPS = 40  # enough that the signal, sent once step 1 is logged, lands well before the end


def _train_argv(out: Path, *, max_steps: int) -> list[str]:
    return [sys.executable, "-m", "mcore_dpo.train", "--max-steps", str(max_steps), "--global-batch-size", "8",
            "--micro-batch-size", "8", "--eval-interval", "0", "--save-interval", "100", "--output-dir", str(out)]


def _tensors(hf_dir: Path) -> dict:
    found = {}
    for path in sorted(hf_dir.glob("*.safetensors")):
        found.update(load_file(path))
    assert found, f"no safetensors in {hf_dir}"
    return found


def _assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name, tensor in a.items():
        assert tensor.dtype == b[name].dtype and tensor.equal(b[name]), name


def _export(run_dir: Path, dest: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "checkpoint_convert", "mcore-to-hf", "--mcore-dir", str(run_dir),
                           "--out", str(dest)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_interrupted_resumed_finished_run_exports_its_final_step_and_extends_from_it(tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(_train_argv(out, max_steps=STEPS), cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        metrics = out / "metrics.jsonl"
        while not (metrics.is_file() and '"step": 1' in metrics.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "slow"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        printed, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "stopped at step " in printed, printed[-3000:]
    interrupted = checkpoint.read_state(checkpoint.latest(out))["step"]
    assert interrupted < STEPS

    finished = subprocess.run(_train_argv(out, max_steps=STEPS), cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert f"(step {interrupted})" in finished.stdout
    # `latest` is never stale: it names the final step's checkpoint
    assert checkpoint.latest(out).name == checkpoint.name_of(STEPS)
    said = _export(out, tmp_path / "export-final")
    assert f"the newest checkpoint is {out / 'checkpoints' / checkpoint.name_of(STEPS)}" in said, said
    _assert_bitwise_equal(_tensors(tmp_path / "export-final"), _tensors(out / "hf"))

    extended = subprocess.run(_train_argv(out, max_steps=STEPS + 2), cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=600)
    assert extended.returncode == 0, extended.stderr[-3000:]
    assert f"resuming from {out / 'checkpoints' / checkpoint.name_of(STEPS)} (step {STEPS})" in extended.stdout, \
        extended.stdout
    assert checkpoint.latest(out).name == checkpoint.name_of(STEPS + 2)
    _export(out, tmp_path / "export-extended")
    _assert_bitwise_equal(_tensors(tmp_path / "export-extended"), _tensors(out / "hf"))
    steps = [line for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len(steps) == STEPS + 2  # each step once: nothing retrained
