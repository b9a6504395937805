"""A run's processes and its work outlive nothing they should not, through the real command line:
the default run (no --output-dir) killed mid-way resumes when the same command runs again, no
process of the driver's Ray cluster survives kill -9 of the driver, a signal to the whole process
group (as `timeout`, `kill -TERM -PGID` and Ctrl-C send it) stops the run at a step boundary with
a checkpoint and leaves no process behind, and a closed stdout (`| head -1`) never ends a run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from mcore_dpo.checkpoint import layout as checkpoint
from mcore_dpo.driver import output_dir, reaper
from tests.helpers import cli
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


def test_sigterm_to_the_process_group_stops_at_a_step_with_a_checkpoint_and_leaves_nothing(tmp_path):
    """SIGTERM to the driver's whole process group, as `timeout` and `kill -TERM -PGID` send it:
    the run stops at a step boundary with a checkpoint of that step, prints the stop line and
    exits 0; 10 s later no process of its group, its session or its Ray cluster is left."""
    out = tmp_path / "run"
    driver = start_train(["--max-steps", "500", "--save-interval", "1000", "--no-packing", *SMALL, "--output-dir", str(out)],
                         env=_env(), stderr=subprocess.STDOUT, start_new_session=True)
    recorded: dict[int, int] = {}
    try:
        _wait_for_step(out / "metrics.jsonl", step=1, driver=driver)
        recorded = reaper.tree({driver.pid})  # the driver, its Ray head and everything under it
        assert "raylet" in {_name(pid) for pid in recorded}
        os.killpg(driver.pid, signal.SIGTERM)
        printed, _ = driver.communicate(timeout=300)
        time.sleep(10)
        left = {pid: _name(pid) for pid in _alive(recorded)} | _group_or_session(driver.pid)
    finally:
        if driver.poll() is None:
            driver.kill()
        for pid in _alive(recorded):
            os.kill(pid, signal.SIGKILL)
    assert driver.returncode == 0, printed[-3000:]
    assert "SIGTERM: stopping after this step" in printed, printed[-3000:]
    stopped = [line for line in printed.splitlines() if line.startswith("stopped at step ")]
    assert len(stopped) == 1 and stopped[0].endswith("; rerun the same command to resume"), printed[-3000:]
    step = int(stopped[0].split()[3].rstrip(";"))
    current = checkpoint.latest(out)
    assert current is not None and checkpoint.read_state(current)["step"] == step < 500
    assert not (out / output_dir.COMPLETE_FILE).exists()
    assert not left, f"still running 10 s after the run stopped: {left}"
    log = (out / "train.log").read_text()
    assert "SIGTERM: stopping after this step" in log and stopped[0] in log.splitlines(), log[-2000:]


def test_a_second_sigint_to_the_process_group_interrupts_at_once(tmp_path):
    """Ctrl-C twice, as the terminal sends it (SIGINT to the foreground process group), while a
    step cannot finish (rank 0 hangs in step 2): the first asks for a stop at the step boundary,
    the second interrupts at once (exit 130), and nothing of the run is left 10 s later."""
    out = tmp_path / "run"
    stdout = tmp_path / "stdout.txt"
    with open(stdout, "w") as sink:
        driver = start_train(["--max-steps", "500", "--no-packing", *SMALL, "--output-dir", str(out)], env=_env("hang:2"),
                             stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    recorded: dict[int, int] = {}
    try:
        deadline = time.monotonic() + 300
        while not (out / ".fault-hang-2").exists():  # rank 0 is stuck in step 2
            assert driver.poll() is None, stdout.read_text()[-3000:]
            assert time.monotonic() < deadline, "step 2 never started"
            time.sleep(0.2)
        recorded = reaper.tree({driver.pid})
        os.killpg(driver.pid, signal.SIGINT)
        while "SIGINT: stopping after this step" not in stdout.read_text():
            assert driver.poll() is None, stdout.read_text()[-3000:]
            assert time.monotonic() < deadline, "no stop line after the first SIGINT"
            time.sleep(0.2)
        os.killpg(driver.pid, signal.SIGINT)
        driver.wait(timeout=120)  # the hang lasts an hour: only the interrupt ends it
        time.sleep(10)
        left = {pid: _name(pid) for pid in _alive(recorded)} | _group_or_session(driver.pid)
    finally:
        if driver.poll() is None:
            driver.kill()
        for pid in _alive(recorded):
            os.kill(pid, signal.SIGKILL)
    printed = stdout.read_text()
    assert driver.returncode == 130 and printed.strip().splitlines()[-1] == "interrupted", printed[-3000:]
    assert "stopped at step" not in printed
    assert not left, f"still running 10 s after the interrupt: {left}"


def test_a_closed_stdout_does_not_end_the_run(tmp_path):
    """`python -m mcore_dpo.train ... | head -1`: head exits after the first line, every later
    write to stdout meets a closed pipe (the driver's own lines and the workers' lines Ray shows
    there, from the `say` fault hook). The run still finishes: exit 0, OUTPUT/hf, and
    OUTPUT/train.log holds every line of the run."""
    out = tmp_path / "run"
    stderr = tmp_path / "stderr.txt"
    with open(stderr, "w") as err:
        driver = start_train(["--max-steps", "3", "--global-batch-size", "8", "--micro-batch-size", "8", "--no-packing",
                              "--output-dir", str(out)], env=_env("say:1,2,3"), stderr=err, text=False)
        head = cli.start(["head", "-1"], stdin=driver.stdout, stderr=None)
        driver.stdout.close()  # head alone holds the pipe's reading end
        first, _ = head.communicate(timeout=300)
        try:
            driver.wait(timeout=600)
        finally:
            if driver.poll() is None:
                driver.kill()
    assert head.returncode == 0 and first.startswith("preparing 1 worker"), first
    assert driver.returncode == 0, stderr.read_text()[-3000:]
    assert (out / "hf" / "config.json").is_file()
    # The workers' stderr lines reached the driver's stderr: Ray did show worker output while
    # stdout was closed.
    assert "fault hook: rank 0 at step 3 on stderr" in stderr.read_text(), stderr.read_text()[-3000:]
    log = (out / "train.log").read_text().splitlines()
    # The first line, then the token store's line(s) from preparing, then the claimed directory.
    assert f"output directory: {out}" in log, log
    claimed = log.index(f"output directory: {out}")
    assert log[0] == first.strip() and all(line.startswith("data: ") for line in log[1:claimed]), log
    assert [line.split()[1] for line in log if line.startswith("step ")] == ["1/3", "2/3", "3/3"], log
    assert log[-1] == f"exported the policy to {out / 'hf'}", log


def _wait_for_step(metrics, *, step: int, driver: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not (metrics.is_file() and any(json.loads(line)["step"] >= step for line in metrics.read_text().splitlines()
                                         if line.endswith("}"))):
        assert driver.poll() is None, (driver.stdout.read() if driver.stdout else "")[-3000:]
        assert time.monotonic() < deadline, f"no step {step} within {timeout_s:.0f} s"
        time.sleep(0.2)


def _group_or_session(pid: int) -> dict[int, str]:
    """Processes alive in the process group or the session that `pid` leads."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and pid in (int(fields[2]), int(fields[3])):
            found[int(proc.name)] = _name(int(proc.name))
    return found
