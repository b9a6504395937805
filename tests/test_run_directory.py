"""One export source of truth, through the command lines (the interrupted run a process of its
own, which SIGTERM stops; the rest in this process, on the session's Ray cluster): a run
interrupted, resumed and finished leaves `checkpoints/latest` at its final step;
`mcore-to-hf --mcore-dir OUTPUT` (the run directory itself) exports that checkpoint, bit for bit
equal to OUTPUT/hf; a larger --max-steps continues from the final step, not from the
interrupted one."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from safetensors.torch import load_file

from mcore_dpo.checkpoint import layout as checkpoint
from tests.helpers.cli import start_train
from tests.helpers.ray_runs import main_in_process

STEPS = 40  # enough that the signal, sent once step 1 is logged, lands well before the end


def _train_argv(out: Path, *, max_steps: int) -> list[str]:
    return ["--max-steps", str(max_steps), "--global-batch-size", "8", "--micro-batch-size", "8", "--eval-interval", "0",
            "--save-interval", "100", "--output-dir", str(out)]


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
    """`checkpoint_convert mcore-to-hf` through its command line, in this process; what it printed."""
    import io
    from contextlib import redirect_stdout

    from checkpoint_convert.__main__ import main

    printed = io.StringIO()
    with redirect_stdout(printed):
        assert main(["mcore-to-hf", "--mcore-dir", str(run_dir), "--out", str(dest)]) == 0
    return printed.getvalue()


def test_interrupted_resumed_finished_run_exports_its_final_step_and_extends_from_it(tmp_path, ray_cluster):
    out = tmp_path / "run"
    proc = start_train(_train_argv(out, max_steps=STEPS), stderr=subprocess.STDOUT)
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

    finished = main_in_process(_train_argv(out, max_steps=STEPS), cluster=ray_cluster)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert f"(step {interrupted})" in finished.stdout
    # `latest` is never stale: it names the final step's checkpoint
    assert checkpoint.latest(out).name == checkpoint.name_of(STEPS)
    said = _export(out, tmp_path / "export-final")
    assert f"the newest checkpoint is {out / 'checkpoints' / checkpoint.name_of(STEPS)}" in said, said
    _assert_bitwise_equal(_tensors(tmp_path / "export-final"), _tensors(out / "hf"))

    extended = main_in_process(_train_argv(out, max_steps=STEPS + 2), cluster=ray_cluster)
    assert extended.returncode == 0, extended.stderr[-3000:]
    assert f"resuming from {out / 'checkpoints' / checkpoint.name_of(STEPS)} (step {STEPS})" in extended.stdout, \
        extended.stdout
    assert checkpoint.latest(out).name == checkpoint.name_of(STEPS + 2)
    _export(out, tmp_path / "export-extended")
    _assert_bitwise_equal(_tensors(tmp_path / "export-extended"), _tensors(out / "hf"))
    steps = [line for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len(steps) == STEPS + 2  # each step once: nothing retrained
