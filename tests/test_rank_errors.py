"""A rank's failure reaches the user as its cause, and a local Ray cluster leaves nothing behind.

Through the real command line: a rank that fails at start-up, and one that fails inside a step,
end the run with one line naming the rank and its own exception (type and whole first line of
the message, no ANSI codes, none of Ray's wrapping), and OUTPUT/train.log holds that line and
the rank's traceback. A run with HOME pointed at a fresh directory prints no token-authentication
warning and writes nothing under ~/.ray. Without processes: the sweep of the local clusters'
temporary directories removes those of dead drivers and keeps every other.

The failures are injected by a sitecustomize.py each test writes (PYTHONPATH, so that the driver
and every Ray worker process load it), apart from tests/fault_hooks, whose faults kill a rank.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

from mcore_dpo.driver import local_ray, reaper
from tests.helpers.cli import REPO, command_env, run_train

SMALL = ["--global-batch-size", "8", "--micro-batch-size", "8", "--eval-interval", "0", "--no-export-hf"]
# Past Ray's old 200-character cut: the end of the cause must reach the user.
LONG_CAUSE = "the injected failure, " + "detail " * 40 + "END-OF-CAUSE"

FAULTS = '''
"""Faults of tests/test_rank_errors.py, from RANK_ERRORS_FAULT: "startup" makes rank 0's
PolicyWorker raise as it is built, "step:N" makes rank 0 raise at the start of step N."""
import os

_FAULT = os.environ.get("RANK_ERRORS_FAULT", "")
_CAUSE = os.environ.get("RANK_ERRORS_CAUSE", "")


def _patch_worker(module):
    built = module.PolicyWorker.__init__

    def failing_init(self, *args, **kwargs):
        if kwargs.get("rank") == 0:
            from mcore_dpo.checkpoint.layout import CheckpointError

            raise CheckpointError(_CAUSE)
        built(self, *args, **kwargs)

    module.PolicyWorker.__init__ = failing_init


if _FAULT == "startup":
    import importlib.abc
    import importlib.machinery
    import sys

    class _PatchOnImport(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name != "mcore_dpo.rank.worker":
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _patch_worker(module)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, _PatchOnImport())

if _FAULT.startswith("step:"):
    try:
        from mcore_dpo import hooks
    except ImportError:  # a helper process of Ray's without the project on its path
        hooks = None

    def _fail(*, step, rank, output_dir):
        if rank == 0 and step == int(_FAULT.partition(":")[2]):
            raise RuntimeError(_CAUSE)

    if hooks is not None:
        hooks.register("train_step", _fail)
'''


def _env(tmp_path: Path, fault: str, **changes: str) -> dict:
    hooks_dir = tmp_path / "faults"
    hooks_dir.mkdir(exist_ok=True)
    (hooks_dir / "sitecustomize.py").write_text(FAULTS)
    path = os.pathsep.join(p for p in (str(hooks_dir), str(REPO), os.environ.get("PYTHONPATH")) if p)
    return command_env(PYTHONPATH=path, RANK_ERRORS_FAULT=fault, RANK_ERRORS_CAUSE=LONG_CAUSE, **changes)


def _assert_one_line_with_the_cause(result, out: Path, *, rank: str, type_name: str) -> None:
    printed = result.stdout + result.stderr
    assert result.returncode == 1, printed[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last == f"error: {rank} failed: {type_name}: {LONG_CAUSE}", printed[-3000:]
    assert "\x1b[" not in printed and "ray::" not in printed, printed[-3000:]
    assert "Traceback" not in printed, printed[-3000:]  # the traceback goes to train.log, not the terminal
    log = (out / "train.log").read_text()
    assert last in log.splitlines(), log[-3000:]
    traceback = log[log.index(last):]
    assert "Traceback (most recent call last):" in traceback and f"{type_name}: {LONG_CAUSE}" in traceback, log[-3000:]
    assert "\x1b[" not in log


def test_a_rank_failing_at_start_up_names_its_cause(tmp_path):
    """Rank 0 of two raises while it is built (as a corrupt checkpoint file makes it): the line
    was `failed: the worker process died (The actor died because of an error raised in its
    creation task, [36mray::…` cut at 200 characters, and the cause only sometimes on the
    terminal as Ray's traceback, never in train.log."""
    out = tmp_path / "run"
    result = run_train(["--tp", "2", "--max-steps", "1", *SMALL, "--output-dir", str(out)],
                       env=_env(tmp_path, "startup"), timeout=600)
    _assert_one_line_with_the_cause(result, out, rank="policy/tp0-pp0-dp0", type_name="CheckpointError")


def test_a_rank_failing_inside_a_step_names_its_cause(tmp_path):
    """Rank 0 of two raises at the start of step 2, its peer waits in a collective: the line
    names rank 0 and its exception, and train.log has the traceback."""
    out = tmp_path / "run"
    result = run_train(["--tp", "2", "--max-steps", "3", *SMALL, "--output-dir", str(out)],
                       env=_env(tmp_path, "step:2"), timeout=600)
    _assert_one_line_with_the_cause(result, out, rank="policy/tp0-pp0-dp0", type_name="RuntimeError")
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 1, steps  # step 0: the evaluation before training


def test_a_torch_dist_resume_with_a_pickle_payload_says_refusing_to_unpickle(tmp_path):
    """A torch_dist checkpoint whose `.metadata` pickle would run code, without a manifest (as one
    written before manifests, which resumes unchecked): the rank's restricted unpickler refuses
    it, the payload never runs, and the driver's one line says so (the line used to read only
    "the worker process died").

    Its first run, on a local cluster of its own with a HOME of its own: Ray's own start of a
    local cluster warns that token authentication is on and writes the token to
    ~/.ray/auth_token; the driver's local cluster keeps its token in memory."""
    import pickle

    out, marker = tmp_path / "run", tmp_path / "payload-ran"
    args = ["--max-steps", "2", "--save-interval", "1", "--save-format", "torch_dist", "--output-dir", str(out)]
    home = tmp_path / "home"
    home.mkdir()
    env = command_env(HOME=str(home))
    for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(name, None)
    first = run_train(args, env=env)
    printed = first.stdout + first.stderr
    assert first.returncode == 0, printed[-3000:]
    assert "Token authentication" not in printed and "auth_token" not in printed, printed[-3000:]
    assert not (home / ".ray").exists(), sorted(p.name for p in (home / ".ray").rglob("*"))
    newest = out / "checkpoints" / "iter_0000002"
    (newest / "manifest.json").unlink()
    (newest / ".metadata").write_bytes(pickle.dumps(_RunsCode(str(marker))))
    result = run_train([*args[:1], "3", *args[2:]])
    assert result.returncode == 1, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last == (f"error: policy/tp0-pp0-dp0 failed: RefusedPickle: {newest / '.metadata'}: refusing to unpickle "
                    "'posix.system' (not an allowed checkpoint class)"), result.stderr[-3000:]
    assert not marker.exists()


class _RunsCode:
    """A pickle that would create `path` when loaded by a plain unpickler."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


# ----------------------------------------------------------------------------- temporary directories


def _cluster_dir(parent: Path, suffix: str, *, owner: dict | None, age_s: float = 3600) -> Path:
    path = parent / f"{local_ray.PREFIX}{suffix}"
    (path / "session_latest").mkdir(parents=True)
    if owner is not None:
        (path / local_ray.OWNER_FILE).write_text(json.dumps(owner))
    old = os.stat(path).st_mtime - age_s
    os.utime(path, (old, old))
    return path


def _owner(pid: int, start_ticks: int | None, **changes) -> dict:
    return {"host": socket.gethostname(), "pid_namespace": os.readlink("/proc/self/ns/pid"), "pid": pid,
            "start_ticks": start_ticks, **changes}


def test_the_sweep_removes_the_directories_of_dead_drivers_only(tmp_path, monkeypatch):
    me = os.getpid()
    my_start = reaper.stat(me)[1]
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    stale = {
        "dead": _cluster_dir(tmp_path, "dead", owner=_owner(pid_max + 1, 12345)),  # a pid that cannot exist
        "reused": _cluster_dir(tmp_path, "reused", owner=_owner(me, my_start + 1)),  # the pid of another process now
        "old-unrecorded": _cluster_dir(tmp_path, "oldunrec", owner=None),
    }
    kept = {
        "live": _cluster_dir(tmp_path, "live", owner=_owner(me, my_start)),
        "other-host": _cluster_dir(tmp_path, "otherhost", owner=_owner(pid_max + 1, 1, host="elsewhere")),
        "other-pid-namespace": _cluster_dir(tmp_path, "otherns", owner=_owner(pid_max + 1, 1, pid_namespace="pid:[1]")),
        "unreadable-record": _cluster_dir(tmp_path, "unreadable", owner=None),
        "young-unrecorded": _cluster_dir(tmp_path, "young", owner=None, age_s=0),
        "unrecorded-in-use": _cluster_dir(tmp_path, "inuse", owner=None),
        "not-a-cluster": tmp_path / "something-else",
    }
    (kept["unreadable-record"] / local_ray.OWNER_FILE).write_text("{not json")
    kept["not-a-cluster"].mkdir()
    in_use = kept["unrecorded-in-use"].name
    real_command_lines = local_ray._command_lines
    # a process naming the directory, as `ray start --temp-dir=DIR` does while its cluster runs
    monkeypatch.setattr(local_ray, "_command_lines",
                        lambda: [*real_command_lines(), f"ray\0start\0--temp-dir=/elsewhere/{in_use}\0".encode()])

    removed = local_ray.sweep_temp_dirs(str(tmp_path))

    assert sorted(removed) == sorted(str(p) for p in stale.values())
    assert [name for name, path in stale.items() if path.exists()] == []
    assert [name for name, path in kept.items() if not path.exists()] == []


def test_a_new_temporary_directory_records_its_owner_and_is_kept_while_it_lives(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # read TMPDIR again
    made = Path(local_ray.make_temp_dir())
    assert made.parent == tmp_path and made.name.startswith(local_ray.PREFIX)
    record = json.loads((made / local_ray.OWNER_FILE).read_text())
    assert record["pid"] == os.getpid() and record["start_ticks"] == reaper.stat(os.getpid())[1]
    assert local_ray.sweep_temp_dirs() == [] and made.is_dir()
