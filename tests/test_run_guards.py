"""Nothing silently wrong in a run: a non-finite loss or gradient norm stops it (exit 2, the step
not saved, nothing exported); one run per output directory (a lock, taken over from a dead
driver); I/O failures of the driver and the ranks in one line naming the path; plots that never
fail a finished run; one copy of the final weights. Through the command line, with the tiny
default (about 25 s a run); unit tests of the pure parts first."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mcore_dpo import io_errors
from mcore_dpo.driver.metrics_log import first_non_finite
from mcore_dpo.driver.run_lock import LOCK_FILE, LockHeld, RunLock
from tests.helpers.cli import command_env, run_train, start_train, train_input_error
from tests.helpers.faults import with_fault, with_io_fault


def _one_error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    return lines[0]


# ----------------------------------------------------------------------------- pure parts


def test_first_non_finite_names_the_metric():
    assert first_non_finite({"loss": 0.69, "grad_norm": 1.0, "lr": 1e-3}) is None
    assert first_non_finite({"loss": float("nan"), "grad_norm": 1.0})[0] == "loss"
    name, value = first_non_finite({"loss": 0.5, "grad_norm": float("inf")})
    assert name == "grad_norm" and math.isinf(value)
    assert first_non_finite({"loss": 0.5, "tokens/s": float("nan")}) is None  # only what the step must keep finite


def test_the_lock_refuses_a_second_holder_and_takes_over_a_dead_ones(tmp_path):
    out = tmp_path / "out"
    first = RunLock(out)
    first.acquire()
    with pytest.raises(LockHeld, match=rf"in use by another run \(host \S+ PID {os.getpid()} since .*{LOCK_FILE}"):
        RunLock(out).acquire()
    first.release()
    assert (out / LOCK_FILE).read_text() == ""  # a clean exit leaves no holder
    # A record left by a process that is gone (kill -9): its flock went with it.
    (out / LOCK_FILE).write_text(json.dumps({"host": "n1", "pid": 2**22 + 7, "started": 0}) + "\n")
    said = []
    with RunLock(out, log=said.append):
        assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert said == [f"output_dir: taking over {out / LOCK_FILE} from host n1 PID {2**22 + 7} since 1970-01-01 00:00:00 "
                    "UTC (its process is gone)"]


def test_io_errors_name_the_path():
    assert io_errors.describe(OSError(28, "No space left on device", "/o/hf")) == \
        "/o/hf: No space left on device [ENOSPC]"
    with pytest.raises(OSError) as raised:
        with io_errors.naming("/o/checkpoints/step_2"):
            raise OSError(30, "Read-only file system")  # os.write names no file
    assert io_errors.describe(raised.value) == "/o/checkpoints/step_2: Read-only file system [EROFS]"
    with pytest.raises(OSError) as raised:
        with io_errors.naming("/o/x"):
            raise OSError(13, "Permission denied", "/o/x/y")
    assert raised.value.filename == "/o/x/y"  # a file name already given is kept


# ----------------------------------------------------------------------------- through the command line


def test_a_diverging_run_stops_at_the_first_non_finite_step(tmp_path):
    """--lr 1e9: step 1 is finite, step 2's loss is NaN. The run stops there with exit 2 and one
    line naming the step and the metric; the newest checkpoint is step 1's, all finite; no hf/
    export and no complete.json (a rerun does not say "already complete")."""
    out = tmp_path / "out"
    result = run_train(["--lr", "1e9", "--max-steps", "6", "--save-interval", "1", "--output-dir", str(out)])
    assert result.returncode == 2, result.stderr[-3000:]
    line = _one_error_line(result)
    assert line.startswith("error: step 2: loss is nan (non-finite)"), line
    assert "step_00000001" in line, line
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000001"
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.is_dir()) == ["step_00000001"]
    for shard in (out / "checkpoints" / "step_00000001").rglob("*.safetensors"):
        for name, tensor in load_file(shard).items():
            assert torch.isfinite(tensor).all(), f"{shard}: {name}"
    assert not (out / "hf").exists() and not (out / "complete.json").exists()
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]  # step 2's NaN line is kept for the record
    assert line.removeprefix("error: ") in (out / "train.log").read_text()


def test_a_second_run_in_the_same_directory_is_refused_and_a_dead_drivers_lock_taken_over(tmp_path):
    """Two drivers on one OUTPUT: the second is refused in one line naming the first's PID and
    changes nothing (the first finishes its steps in order). After kill -9 of a driver, the same
    command takes the lock over, says so, and resumes."""
    out = tmp_path / "out"
    args = ["--max-steps", "6", "--save-interval", "1", "--output-dir", str(out)]
    first = start_train(args, env=with_fault(command_env(), "pace:1"))
    try:
        deadline = time.monotonic() + 120
        while not (out / "checkpoints" / "latest").is_file():
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()[1][-3000:]
            time.sleep(0.5)
        second = run_train(args)
        assert second.returncode == 2, second.stderr[-3000:]
        line = _one_error_line(second)
        assert f"is in use by another run (host " in line and f"PID {first.pid} since" in line, line
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
            first.communicate()
    third = run_train(args)
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"from host " in third.stdout and f"PID {first.pid}" in third.stdout and "(its process is gone)" in third.stdout
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and steps[-1] == 6 and len(steps) == len(set(steps)), steps


def test_an_output_dir_under_a_file_is_one_line(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    err = train_input_error(capsys, ["--max-steps", "1", "--output-dir", str(blocker / "sub")])
    assert err.startswith(f"error: output_dir: cannot use {blocker / 'sub'}") and "[ENOTDIR]" in err, err


def test_a_read_only_output_dir_is_one_line(tmp_path):
    """EROFS on the output directory (root ignores file modes, so the fault hooks make the file
    system refuse): exit 2 at start-up, one line naming the directory."""
    out = tmp_path / "ro"
    result = run_train(["--max-steps", "1", "--output-dir", str(out)], env=with_io_fault(command_env(), f"EROFS:{re.escape(str(out))}"))
    assert result.returncode == 2, result.stderr[-3000:]
    line = _one_error_line(result)
    assert str(out) in line and "Read-only file system [EROFS]" in line, line


def test_a_full_disk_during_the_export_is_one_line_and_plots_never_fail_a_run(tmp_path):
    """ENOSPC when the export writes hf/: exit 1, one line naming the path, the checkpoints kept
    and no staging shards left. ENOSPC in plots/ only warns: the run is complete."""
    out = tmp_path / "out"
    args = ["--max-steps", "2", "--output-dir", str(out)]
    result = run_train(args, env=with_io_fault(command_env(), r"ENOSPC:/\.hf\.tmp-"))
    assert result.returncode == 1, result.stderr[-3000:]
    line = _one_error_line(result)
    assert "/.hf.tmp-" in line and "No space left on device [ENOSPC]" in line, line
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    assert not (out / "hf").exists() and not (out / "complete.json").exists()
    assert not [p.name for p in (out / "checkpoints").iterdir() if ".partial-" in p.name]

    plots_out = tmp_path / "plots_out"
    result = run_train(["--max-steps", "2", "--output-dir", str(plots_out)],
                       env=with_io_fault(command_env(), f"ENOSPC:{re.escape(str(plots_out / 'plots'))}"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "warning: plots not written (" in result.stdout and "[ENOSPC]" in result.stdout, result.stdout[-2000:]
    assert (plots_out / "complete.json").is_file() and (plots_out / "hf" / "config.json").is_file()
    # One copy of the final weights: the checkpoints and hf/, no staging directory of the export.
    assert sorted(p.name for p in (plots_out / "checkpoints").iterdir()) == ["latest", "step_00000002"]


def test_a_full_disk_on_a_rank_names_the_file(tmp_path):
    """ENOSPC while a rank writes its checkpoint shard, reported without a file name (as a failed
    write is): the one error line names the checkpoint being written."""
    out = tmp_path / "out"
    result = run_train(["--max-steps", "2", "--save-interval", "1", "--output-dir", str(out)],
                       env=with_io_fault(command_env(), r"ENOSPC!:/step_00000002\.partial-\w+/model/tp0_pp0"))
    assert result.returncode == 1, result.stderr[-3000:]
    line = _one_error_line(result)
    assert "step_00000002.partial-" in line and "No space left on device" in line, line
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000001"
