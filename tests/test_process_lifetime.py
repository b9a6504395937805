"""A run's processes and its work outlive nothing they should not, through the real command line:
the default run (no --output-dir) killed mid-way resumes when the same command runs again, and no
process of the driver's Ray cluster survives kill -9 of the driver."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from mcore_dpo import output_dir, reaper
from tests.helpers.cli import REPO, command_env, run_train, start_train
from tests.helpers.faults import with_fault

SMALL = ["--global-batch-size", "8", "--micro-batch-size", "8", "--eval-interval", "0", "--no-export-hf"]


def _env(fault: str | None = None) -> dict:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return with_fault(command_env(PYTHONPATH=path), fault)


def test_the_default_run_killed_mid_way_resumes_when_the_same_command_runs_again(tmp_path):
    """No --output-dir, checkpoints every 2 steps: rank 0 dies at the start of step 3 (through the
    fault hooks), and the same command, run again, continues that run's directory from step 2."""
    command = ["--max-steps", "4", "--save-interval", "2", *SMALL]
    killed = run_train(command, cwd=tmp_path, env=_env("step:3"), timeout=600)
    assert killed.returncode == 1 and "died" in killed.stderr.strip().splitlines()[-1], killed.stderr[-3000:]
    (out,) = (tmp_path / "outputs").iterdir()
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    assert not (out / output_dir.COMPLETE_FILE).exists()

    resumed = run_train(command, cwd=tmp_path, env=_env(), timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "continuing there" in resumed.stdout and "resuming from" in resumed.stdout, resumed.stdout
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == [out.name]  # no second directory
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2, 3, 4]  # 0: the held-out evaluation before training
    assert json.loads((out / output_dir.COMPLETE_FILE).read_text())["step"] == 4

    again = run_train(command, cwd=tmp_path, env=_env(), timeout=600)
    assert again.returncode == 0 and "already complete at step 4" in again.stdout, again.stdout + again.stderr

    # What the runs printed, captured (not a terminal): the first line says what starts, no ANSI
    # codes, none of megatron-core's known-harmless warnings.
    for done in (killed, resumed, again):
        assert done.stdout.startswith("preparing 1 worker (tp 1 x pp 1 x dp 1) on a local Ray cluster"), done.stdout[:300]
        printed = done.stdout + done.stderr
        assert "\x1b[" not in printed, printed[-3000:]
        assert "Transformer Engine and Apex are not installed" not in printed and "Apex is not installed" not in printed


def test_no_ray_process_survives_kill_9_of_the_driver(tmp_path):
    """The driver's local Ray cluster (GCS, raylet, agents, workers) is gone within a bounded
    wait after the driver is killed with SIGKILL."""
    out = tmp_path / "run"
    driver = start_train(["--max-steps", "500", *SMALL, "--output-dir", str(out)], env=_env(), stdout=subprocess.DEVNULL)
    recorded: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 300
        while not (out / "workers.json").is_file():  # the worker group is up
            assert driver.poll() is None, driver.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "no worker group within 300 s"
            time.sleep(0.2)
        recorded = reaper.tree({driver.pid})
        recorded.pop(driver.pid)
        worker_pids = {w["pid"] for w in json.loads((out / "workers.json").read_text()).values()}
        names = {_name(pid) for pid in recorded}
        assert worker_pids <= recorded.keys() and "raylet" in names, names  # the tree holds the cluster
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
        deadline = time.monotonic() + 30
        while _alive(recorded) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = {pid: _name(pid) for pid in _alive(recorded)}
        assert not left, f"still running 30 s after kill -9 of the driver: {left}"
    finally:
        if driver.poll() is None:
            driver.kill()
        for pid in _alive(recorded):  # whatever the assertion found, end it
            os.kill(pid, signal.SIGKILL)


def _alive(recorded: dict[int, int]) -> list[int]:
    """The recorded processes still running as themselves (same pid and start time, not zombies)."""
    alive = []
    for pid, start in recorded.items():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[19]) == start and fields[0] != "Z":
            alive.append(pid)
    return alive


def _name(pid: int) -> str:
    try:
        text = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""
    return os.path.basename(text.split()[0]) if text.strip() else ""
